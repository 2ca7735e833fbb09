"""A run's files in its run directory: every rank's ``rank<N>.log``, and ``metrics.jsonl``.

Every byte a rank writes goes to ``<run dir>/rank<N>.log``, and its log records too; a line
break is added where a rank's output switches between stdout, stderr and log records in the
middle of a line (or where :mod:`nblaunch.engine.output.lines` ends a progress line), so that two
lines never run together there. The files are readable by this user only: ranks print tokens too.

The disk is not the run's to wait on: when a write fails (the disk is full, the directory turned
read-only), that kind of file (the rank logs, or the metrics) is no longer written and the
trouble is said once, naming the path; the ranks keep training and the view keeps showing them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblaunch.engine.output.metrics_files import METRICS_FILE, metric_lines, write_tensorboard_files
from nblaunch.events import Log

# The "stream" a rank's log records are written as in its log file (1 and 2 are its fds).
LOG_SOURCE = 0
# The kinds of run file, as the trouble message names them.
LOGS = "rank logs"
METRICS = "metrics"


class RunFiles:
    """Writes a run's ``rank<N>.log`` files and its ``metrics.jsonl``.

    Parameters
    ----------
    run_dir
        Directory for the files (made if missing); ``None`` writes no files.
    on_trouble
        Called once per kind of file (``"rank logs"``, ``"metrics"``) whose writing failed, with
        the kind, the file and the error; from then on that kind is not written.
    """

    def __init__(
        self,
        run_dir: Path | None,
        on_trouble: Callable[[str, Path, OSError], None] = lambda what, path, exc: None,
    ) -> None:
        self.run_dir = run_dir
        self.on_trouble = on_trouble
        self.failed: set[str] = set()  # kinds of file no longer written
        self._logs: dict[int, Any] = {}
        self._log_midline: dict[int, int] = {}  # rank -> source whose last log write ended mid-line
        self._metrics_file: Any = None  # <run dir>/metrics.jsonl, opened at the first metric
        if run_dir is not None:
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def open_rank(self, rank: int) -> None:
        """Open ``rank<N>.log`` for appending, unless it is open already."""
        if self.run_dir is not None and rank not in self._logs and LOGS not in self.failed:
            path = self.run_dir / f"rank{rank}.log"
            try:
                self._logs[rank] = open_private(path, "ab")
            except OSError as exc:
                self._trouble(LOGS, path, exc)

    def log_text(self, rank: int, text: str) -> None:
        """Write ``text`` (a record, a line from another node) to the rank's log file."""
        self.log_bytes(rank, LOG_SOURCE, text.encode("utf-8", errors="replace"))

    def log_break(self, rank: int) -> None:
        """End the line the rank's log file is in the middle of."""
        log = self._logs.get(rank)
        if log is not None and self._log_midline.pop(rank, None) is not None:
            self._write_log(rank, log, b"\n")

    def log_bytes(self, rank: int, source: int, data: bytes) -> None:
        """Write to the rank's log file, breaking the line where another source left off."""
        log = self._logs.get(rank)
        if log is None or not data:
            return
        midline = self._log_midline.pop(rank, None)
        if midline is not None and midline != source and data[:1] != b"\n":
            data = b"\n" + data
        self._write_log(rank, log, data)
        if not data.endswith(b"\n"):
            self._log_midline[rank] = source

    def _write_log(self, rank: int, log: Any, data: bytes) -> None:
        try:
            log.write(data)
        except OSError as exc:
            self._trouble(
                LOGS, Path(log.name if isinstance(log.name, str) else self._path(rank)), exc
            )

    def write_metrics(self, event: dict[str, Any]) -> None:
        """Append a ``metrics`` event to ``<run dir>/metrics.jsonl`` (nblaunch.ranks.metrics)."""
        if self.run_dir is None or METRICS in self.failed:
            return
        path = self.run_dir / METRICS_FILE
        try:
            if self._metrics_file is None:
                self._metrics_file = open_private(path, "a")
            self._metrics_file.write(metric_lines(event))
        except OSError as exc:
            self._trouble(METRICS, path, exc)

    def flush(self) -> None:
        """Write out what the files buffer."""
        for rank, log in list(self._logs.items()):
            if LOGS in self.failed:
                break  # an earlier rank's failed: every log file is closed now
            try:
                log.flush()
            except OSError as exc:
                self._trouble(LOGS, self._path(rank), exc)
        if self._metrics_file is not None:
            try:
                self._metrics_file.flush()
            except OSError as exc:
                self._trouble(METRICS, self._path(METRICS), exc)

    def close(self) -> None:
        """Close the files; write the TensorBoard files if the run logged metrics."""
        self.flush()
        wrote_metrics = self._metrics_file is not None and METRICS not in self.failed
        self._close(LOGS)
        self._close(METRICS)
        if wrote_metrics:
            # Written once the run is over: protobuf per value would slow the relay tenfold.
            assert self.run_dir is not None
            try:
                write_tensorboard_files(self.run_dir)
            except OSError as exc:
                self._trouble("TensorBoard files", self.run_dir / "tensorboard", exc)

    # --- trouble ---------------------------------------------------------------------------------

    def _trouble(self, what: str, path: Path, exc: OSError) -> None:
        """Writing ``what`` failed: stop writing it, and say so once."""
        if what in self.failed:
            return
        self.failed.add(what)
        self._close(what)
        self.on_trouble(what, path, exc)

    def _close(self, what: str) -> None:
        """Close the files of one kind; what they still buffer may be lost (the disk said no)."""
        files = list(self._logs.values()) if what == LOGS else [self._metrics_file]
        for file in files:
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()
        if what == LOGS:
            self._logs.clear()
            self._log_midline.clear()
        elif what == METRICS:
            self._metrics_file = None

    def _path(self, rank_or_metrics: int | str) -> Path:
        assert self.run_dir is not None
        if rank_or_metrics == METRICS:
            return self.run_dir / METRICS_FILE
        return self.run_dir / f"rank{rank_or_metrics}.log"


def open_private(path: Path, mode: str) -> Any:
    """A run file (``rank<N>.log``, ``metrics.jsonl``) opened for appending in ``mode``,
    readable by this user only: ranks print tokens too."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), mode)


def log_line(event: Log) -> str:
    """How a rank's ``Log`` record reads in its ``rank<N>.log`` file."""
    return f"{event['level']}:{event['name']}: {event['message']}\n"
