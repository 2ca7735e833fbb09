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
import contextlib
import json
import os
import pickle
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from nblaunch.engine.detached.host_files import HISTORY_FILE, HOLDER_FILE, HOST_LOG, POOL_FILE
from nblaunch.engine.detached.lost_runs import lost_why
from nblaunch.engine.output.metrics_files import METRICS_FILE
from nblaunch.events import Event, checking_mode
from nblaunch.lab.files import RunFiles

if TYPE_CHECKING:
    from nblaunch.engine.detached.registry import Entry

# Last lines kept per rank, and of all ranks together (the folded "All ranks").
RANK_LINES = 40
ALL_LINES = 200
# Points kept per metric and rank; past it every other one is dropped (the shape stays).
MAX_POINTS = 500
# Bytes read from the end of a rank log of a run that left no history.
LOG_TAIL_BYTES = 16_384
# Bytes read from the end of ``metrics.jsonl`` of such a run.
METRICS_TAIL_BYTES = 2 << 20
# What a list needs of a run's events (its devices, cause, last step, end): not its lines.
BRIEF_KINDS = frozenset({"run_info", "started", "state", "diagnosis", "run_ended"})
BRIEF_METRICS_BYTES = 16_384
_RANK_LOG = re.compile(r"^rank\d+\.log$")


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


def from_files(files: RunFiles, rank_state: str = "ENDED", brief: bool = False) -> RunSummary:
    """The picture of a run that left no history: its rank logs' tails and ``metrics.jsonl``
    (each rank in ``rank_state``: ``ENDED``, or ``RUNNING`` for a pool that goes on).
    ``brief``: what a list shows only (no lines; the last step from the last metrics)."""
    summary = RunSummary()
    names = files.stats()
    ranks = sorted(int(name[4:-4]) for name in names if _RANK_LOG.match(name))
    for rank in ranks:
        summary.handle({"kind": "state", "rank": rank, "state": rank_state, "detail": ""})
        lines = "" if brief else files.text_tail(f"rank{rank}.log", LOG_TAIL_BYTES)
        for text in lines.splitlines():
            summary.handle(
                {"kind": "stream", "rank": rank, "fd": 1, "text": text, "carriage": False}
            )
    tail = BRIEF_METRICS_BYTES if brief else METRICS_TAIL_BYTES
    data = files.read(METRICS_FILE, tail=tail) if METRICS_FILE in names else None
    rows = []
    for line in (data or b"").splitlines()[1 if data and len(data) >= tail else 0 :]:
        with contextlib.suppress(ValueError):  # a line cut short by a crash
            rows.append(json.loads(line))
    if brief:
        steps = [row.get("step") for row in rows if isinstance(row, dict)]
        summary.last_step = max((s for s in steps if isinstance(s, int)), default=None)
        return summary
    for row in rows:
        with contextlib.suppress(KeyError, TypeError):
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
    return summary


def from_history(files: RunFiles, brief: bool = False) -> RunSummary | None:
    """The picture from the host's ``history.pkl`` (a pickle of plain event dicts, in a
    directory of this user's, read as ``files`` allows); None without a readable one.
    ``brief``: what a list shows only (:func:`brief_history`)."""
    data = files.read(HISTORY_FILE)
    if data is None:
        return None
    try:
        events = pickle.loads(data)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError):
        return None
    if brief:
        return brief_history(events)
    summary = RunSummary()
    summary.handle_many(events)
    return summary


def brief_history(events: list[Event]) -> RunSummary:
    """What a list shows of a run from its history: no lines, no metric points but the last
    step (folding a long run's points costs most of its time)."""
    summary = RunSummary()
    steps = [e["step"] for e in events if e["kind"] == "metrics"]
    summary.handle_many([e for e in events if e["kind"] in BRIEF_KINDS])
    summary.last_step = max(steps, default=None)
    return summary


def pool_summary(files: RunFiles) -> RunSummary:
    """A running pool's picture: its rank logs, each rank alive or not, on its device (the
    pool's host writes ``pool.json`` as its ranks start)."""
    try:
        pool = json.loads(files.read(POOL_FILE) or b"{}")
    except ValueError:
        pool = {}
    summary = from_files(files, "RUNNING")
    events: list[Event] = []
    devices = pool.get("devices") or []
    for rank, pid in enumerate(pool.get("pids") or []):
        alive = isinstance(pid, int) and os.path.exists(f"/proc/{pid}")
        device = str(devices[rank]) if rank < len(devices) else ""
        events.append({"kind": "started", "rank": rank, "device": device, "pid": pid, "host": ""})
        events.append({"kind": "state", "rank": rank, "state": "RUNNING" if alive else "STOPPED"})
    summary.handle_many(events)
    return summary


def pool_holder(files: RunFiles) -> dict[str, Any] | None:
    """The process a detached pool's host serves now (a kernel), while it lives."""
    try:
        holder = json.loads(files.read(HOLDER_FILE) or b"null")
    except ValueError:
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    if not os.path.exists(f"/proc/{holder['pid']}"):
        return None
    return {"pid": holder["pid"], "since": holder.get("since")}


LOST_TITLE = "the run is lost: its host ended without an outcome"
_FINAL_RANK_STATES = ("DONE", "FAILED", "STOPPED", "ENDED")


def lost_view(view: dict[str, Any], entry: Entry, files: RunFiles) -> dict[str, Any]:
    """A lost run's picture as a notebook's view explains it: every rank that did not end lost
    with the host, why, and the end of ``host.log``."""
    for rank in view["ranks"].values():
        if rank["state"] not in _FINAL_RANK_STATES:
            rank.update(state="LOST", detail="lost with its host")
    body = lost_why(entry) + "."
    host_log = files.text_tail(HOST_LOG, 8192).splitlines()[-8:]
    if host_log:
        body += "\nThe end of host.log:\n" + "\n".join(host_log)
    lost = {"title": LOST_TITLE, "body": body, "severity": "error", "rank": None}
    view["diagnoses"] = [*view["diagnoses"], lost]
    if view["ended"] is None:
        ranks = {rank: "lost with its host" for rank in view["ranks"]}
        view["ended"] = {"ok": False, "elapsed_s": time.time() - entry.started_at, "ranks": ranks}
    return view
