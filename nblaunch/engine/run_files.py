"""A run's files in its run directory: every rank's ``rank<N>.log``, and ``metrics.jsonl``.

Every byte a rank writes goes to ``<run dir>/rank<N>.log``, and its log records too; a line
break is added where a rank's output switches between stdout, stderr and log records in the
middle of a line (or where :mod:`nblaunch.engine.lines` ends a progress line), so that two lines
never run together there. The files are readable by this user only: ranks print tokens too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nblaunch.engine.metrics_files import METRICS_FILE, metric_lines, write_tensorboard_files
from nblaunch.events import Log

# The "stream" a rank's log records are written as in its log file (1 and 2 are its fds).
LOG_SOURCE = 0


class RunFiles:
    """Writes a run's ``rank<N>.log`` files and its ``metrics.jsonl``.

    Parameters
    ----------
    run_dir
        Directory for the files (made if missing); ``None`` writes no files.
    """

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self._logs: dict[int, Any] = {}
        self._log_midline: dict[int, int] = {}  # rank -> source whose last log write ended mid-line
        self._metrics_file: Any = None  # <run dir>/metrics.jsonl, opened at the first metric
        if run_dir is not None:
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def open_rank(self, rank: int) -> None:
        """Open ``rank<N>.log`` for appending, unless it is open already."""
        if self.run_dir is not None and rank not in self._logs:
            self._logs[rank] = open_private(self.run_dir / f"rank{rank}.log", "ab")

    def log_text(self, rank: int, text: str) -> None:
        """Write ``text`` (a record, a line from another node) to the rank's log file."""
        self.log_bytes(rank, LOG_SOURCE, text.encode("utf-8", errors="replace"))

    def log_break(self, rank: int) -> None:
        """End the line the rank's log file is in the middle of."""
        log = self._logs.get(rank)
        if log is not None and self._log_midline.pop(rank, None) is not None:
            log.write(b"\n")

    def log_bytes(self, rank: int, source: int, data: bytes) -> None:
        """Write to the rank's log file, breaking the line where another source left off."""
        log = self._logs.get(rank)
        if log is None or not data:
            return
        midline = self._log_midline.pop(rank, None)
        if midline is not None and midline != source and data[:1] != b"\n":
            log.write(b"\n")
        log.write(data)
        if not data.endswith(b"\n"):
            self._log_midline[rank] = source

    def write_metrics(self, event: dict[str, Any]) -> None:
        """Append a ``metrics`` event to ``<run dir>/metrics.jsonl`` (nblaunch.ranks.metrics)."""
        if self.run_dir is None:
            return
        if self._metrics_file is None:
            self._metrics_file = open_private(self.run_dir / METRICS_FILE, "a")
        self._metrics_file.write(metric_lines(event))

    def flush(self) -> None:
        """Write out what the files buffer."""
        for log in self._logs.values():
            log.flush()
        if self._metrics_file is not None:
            self._metrics_file.flush()

    def close(self) -> None:
        """Close the files; write the TensorBoard files if the run logged metrics."""
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
            # Written once the run is over: protobuf per value would slow the relay tenfold.
            assert self.run_dir is not None
            write_tensorboard_files(self.run_dir)


def open_private(path: Path, mode: str) -> Any:
    """A run file (``rank<N>.log``, ``metrics.jsonl``) opened for appending in ``mode``,
    readable by this user only: ranks print tokens too."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), mode)


def log_line(event: Log) -> str:
    """How a rank's ``Log`` record reads in its ``rank<N>.log`` file."""
    return f"{event['level']}:{event['name']}: {event['message']}\n"
