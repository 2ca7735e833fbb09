"""What the runs panel shows of one run, made from its events: a JSON-ready picture.

A view in a notebook renders every event as it comes; the panel in JupyterLab asks the server
for the run now and then, so the server folds the events into :class:`RunSummary` (each rank's
state, device and last lines, the last lines of all ranks, metric points, diagnoses, how the run
ended), bounded however long the run, and hands out :meth:`RunSummary.to_json`. The same
picture is made from what an ended run left on disk (``history.pkl``, or only its rank logs and
``metrics.jsonl`` for a run of a kernel).
"""

from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from typing import Any

from nblaunch.engine.output.metrics_files import METRICS_FILE
from nblaunch.events import Event, checking_mode

# Last lines kept per rank, and of all ranks together (the folded "All ranks").
RANK_LINES = 40
ALL_LINES = 200
# Points kept per metric and rank; past it every other one is dropped (the shape stays).
MAX_POINTS = 500
# Bytes read from the end of a rank log of a run that left no history.
LOG_TAIL_BYTES = 16_384


class RunSummary:
    """An event sink that keeps what the panel shows of a run; thread-safe.

    ``version`` grows with every event, so a reader can tell whether anything changed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self.info: dict[str, Any] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self.lines: collections.deque[list[Any]] = collections.deque(maxlen=ALL_LINES)
        self.metrics: dict[str, dict[int, list[list[float]]]] = {}
        self.last_step: int | None = None
        self.diagnoses: list[dict[str, Any]] = []
        self.progress: dict[str, str] = {}
        self.ended: dict[str, Any] | None = None

    # --- EventSink -------------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        with self._lock:
            self._add(event)

    def handle_many(self, events: list[Event]) -> None:
        with self._lock:
            for event in events:
                self._add(event)

    def flush(self, force: bool = False) -> None:
        pass  # nothing is drawn here: readers ask for to_json()

    def close(self) -> None:
        pass

    # --- folding ---------------------------------------------------------------------------------

    def _rank(self, rank: int) -> dict[str, Any]:
        found = self.ranks.get(rank)
        if found is None:
            found = self.ranks[rank] = {"state": "STARTING", "device": "", "detail": ""}
            found["lines"] = collections.deque(maxlen=RANK_LINES)
        return found

    def _add(self, event: Event) -> None:
        self.version += 1
        kind = event["kind"]
        if kind == "run_info":
            keep = ("world_size", "device_kind", "start_method", "run_dir", "started_at")
            self.info = {key: event.get(key) for key in keep}
            self.info["checks"] = checking_mode(event)
            self.info["warnings"] = list(event.get("warnings", []))
            for rank in range(event["world_size"]):
                self._rank(rank)
        elif kind == "started":
            rank = self._rank(event["rank"])
            rank.update(device=event["device"], pid=event["pid"], host=event["host"])
        elif kind == "state":
            rank = self._rank(event["rank"])
            rank.update(state=str(getattr(event["state"], "value", event["state"])))
            rank["detail"] = event.get("detail", "")
        elif kind in ("stream", "log"):
            text = event["text"] if kind == "stream" else f"{event['level']}: {event['message']}"
            self._line(event["rank"], text.rstrip("\n"), kind == "stream" and event["carriage"])
        elif kind == "metrics":
            self._metric(event)
        elif kind == "diagnosis":
            keep = ("title", "body", "severity", "rank", "secondary")
            self.diagnoses = [*self.diagnoses[-19:], {key: event.get(key) for key in keep}]
        elif kind == "progress":
            self.progress[f"{event['rank']}:{event['what']}"] = event["text"]
        elif kind == "run_ended":
            outcomes = {str(rank): text for rank, text in event["ranks"].items()}
            self.ended = {"ok": event["ok"], "elapsed_s": event["elapsed_s"], "ranks": outcomes}

    def _line(self, rank: int, text: str, carriage: bool) -> None:
        lines = self._rank(rank)["lines"]
        if carriage and lines and lines[-1][1]:
            lines[-1] = [text, True]  # a progress bar redrawing itself
            return
        lines.append([text, carriage])
        self.lines.append([rank, text])

    def _metric(self, event: Event) -> None:
        step = int(event["step"])
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        for name, value in event["values"].items():
            points = self.metrics.setdefault(name, {}).setdefault(event["rank"], [])
            points.append([step, float(value)])
            if len(points) > MAX_POINTS:
                points[:] = points[::2]

    # --- reading ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The picture now, as JSON-ready values (non-finite metric values become null)."""
        with self._lock:
            ranks = {
                str(number): {
                    **{key: value for key, value in rank.items() if key != "lines"},
                    "lines": [text for text, _ in rank["lines"]],
                }
                for number, rank in sorted(self.ranks.items())
            }
            metrics = {
                name: {
                    str(rank): [[s, _finite(v)] for s, v in points] for rank, points in by.items()
                }
                for name, by in self.metrics.items()
            }
            return {
                "version": self.version,
                "info": dict(self.info),
                "ranks": ranks,
                "lines": [list(line) for line in self.lines],
                "metrics": metrics,
                "last_step": self.last_step,
                "diagnoses": list(self.diagnoses),
                "progress": list(self.progress.values()),
                "ended": self.ended,
            }

    def root_cause(self) -> str:
        """The first line of the run's error diagnosis, or ``""``."""
        with self._lock:
            for diagnosis in reversed(self.diagnoses):
                if diagnosis["severity"] == "error":
                    return str(diagnosis["title"]).splitlines()[0] if diagnosis["title"] else ""
        return ""

    def devices(self) -> list[str]:
        with self._lock:
            return [rank["device"] for _, rank in sorted(self.ranks.items()) if rank["device"]]


def _finite(value: float) -> float | None:
    return value if value == value and abs(value) != float("inf") else None


def from_files(run_dir: Path) -> RunSummary:
    """The picture of a run that left no history: its rank logs' tails and ``metrics.jsonl``."""
    summary = RunSummary()
    logs = sorted(run_dir.glob("rank*.log"), key=lambda p: int(p.stem[4:] or 0))
    for log in logs:
        if not log.stem[4:].isdigit():
            continue
        rank = int(log.stem[4:])
        summary.handle({"kind": "state", "rank": rank, "state": "ENDED", "detail": ""})
        for text in _tail(log).splitlines():
            summary.handle(
                {"kind": "stream", "rank": rank, "fd": 1, "text": text, "carriage": False}
            )
    try:
        with open(run_dir / METRICS_FILE) as file:
            for line in collections.deque(file, maxlen=20 * MAX_POINTS):
                row = json.loads(line)
                value = row["value"] if isinstance(row["value"], (int, float)) else float("nan")
                summary.handle(
                    {
                        "kind": "metrics",
                        "rank": row["rank"],
                        "step": row["step"],
                        "values": {row["name"]: value},
                        "time": row["time"],
                    }
                )
    except (OSError, ValueError, KeyError):
        pass  # no metrics, or a line cut short by a crash
    return summary


def _tail(path: Path) -> str:
    with open(path, "rb") as file:
        file.seek(0, 2)
        size = file.tell()
        file.seek(max(0, size - LOG_TAIL_BYTES))
        data = file.read()
    if size > LOG_TAIL_BYTES:
        data = data.split(b"\n", 1)[-1]  # the first line is cut
    return data.decode(errors="replace")
