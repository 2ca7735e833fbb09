"""What a run looks like, kept from its events: the run model the views render.

:class:`RunModel` turns events into per-rank state (badges, devices, heartbeats, the bar a rank
draws now), bounded log tails, diagnoses, progress notes, small return values and metric
series. It imports neither ipywidgets nor IPython and reads no clock, so it is tested by feeding
it events. The live widget renders it as the run goes (``render``), and the static summary
renders it when the run ends (``summary``).
"""

from __future__ import annotations

import collections
import os
from typing import Any

from nblaunch.events import Event, RunState
from nblaunch.notebook.charts import MetricSeries
from nblaunch.notebook.views.ansi import plain
from nblaunch.notebook.views.shapes import TQDM, ShapeCounter
from nblaunch.options import VIEW_LINES

# Lines kept per rank and in the "All ranks" log; NBLAUNCH_VIEW_LINES changes it.
DEFAULT_VIEW_LINES = VIEW_LINES
# Runs of fewer ranks fold nothing: two or three ranks' lines read well apart.
FOLD_FROM_RANKS = 4
# "All ranks" keeps max_lines for every this many ranks.
ALL_RANKS_PER_KEEP = 8
# Returned values up to this size (pickled) are kept, to be shown if of a plain type.
SUMMARY_VALUE_BYTES = 4096

# A kept line is a small list, [rank, fd, text]: cheaper to make than an object, and mutable,
# so a "\r" progress line is redrawn in place in every buffer that holds it. In a run that
# folds alike lines, it has a fourth item: k, its place among the lines of its shape the rank
# printed (shapes.ShapeCounter), counted as it came, so that folding joins the same line of
# each rank whatever lines were dropped since.
RANK, FD, TEXT = 0, 1, 2
Line = list


class RunModel:
    """A run's state as its events tell it; what the live view and the summary show.

    ``handle`` is cheap for output lines (appends to bounded buffers). Each change also names
    the part of the view it touches in ``changed`` (``"head"``, ``"ranks"``, ``"panel"``,
    ``"progress"``, ``"charts"``, or a rank whose log has new lines), so a view renders only
    those; the view empties the set when it renders.

    Parameters
    ----------
    max_lines
        Lines kept per rank and in the "All ranks" log (that many for every 8 ranks); older
        ones are only counted.
    """

    def __init__(self, max_lines: int = DEFAULT_VIEW_LINES) -> None:
        self.max_lines = max_lines
        self.lines_received = 0  # finished lines (Stream events not ended by "\r")
        self.info: dict[str, Any] | None = None  # the run_info event
        self.ended: dict[str, Any] | None = None  # the run_ended event
        self.states: dict[int, RunState] = {}
        self.details: dict[int, str] = {}
        self.devices: dict[int, str] = {}
        self.diagnoses: list[dict[str, Any]] = []
        self.progress: dict[tuple[int, str], str] = {}
        self.heartbeats: dict[int, tuple[float, float, str | None]] = {}
        self.results: dict[int, bytes] = {}  # rank -> its pickled return value, when small
        self.metrics = MetricSeries()  # what ranks sent with nblaunch.log_metrics
        self.all_lines: collections.deque[Line] = collections.deque(maxlen=max_lines)
        self.rank_lines: dict[int, collections.deque[Line]] = {}
        self.line_counts: dict[int, int] = collections.Counter()  # every line, kept or not
        self.open_lines: dict[tuple[int, int], Line] = {}  # (rank, fd) -> its unfinished bar
        self._bars: set[tuple[int, int]] = set()  # (rank, fd) whose last event was a "\\r" line
        self.changed: set[str | int] = set()
        self._shapes: ShapeCounter | None = None  # from 4 ranks on (fold.FOLD_FROM_RANKS)

    def handle(self, event: Event) -> None:
        """Take one event; cheap for output lines (appends to bounded buffers)."""
        kind = event["kind"]
        if kind == "stream":
            # Every line a rank prints comes here: a few appends, no calls.
            rank = event["rank"]
            if event["carriage"] or self._bars:
                self._on_progress_line(rank, event["fd"], event["text"], event["carriage"])
                return
            self.lines_received += 1
            # _append, inlined: every line a rank prints passes here (200k lines/s)
            line = [rank, event["fd"], event["text"]]
            if self._shapes is not None:
                line.append(self._shapes.count(rank, event["fd"], event["text"]))
            self.all_lines.append(line)
            lines = self.rank_lines.get(rank)
            if lines is None:
                lines = self.rank_lines[rank] = collections.deque(maxlen=self.max_lines)
            lines.append(line)
            self.line_counts[rank] += 1
            self.changed.add(rank)
        elif kind == "log":
            # A log record is a line of its own, never part of a bar.
            text = f"{event['level']} {event['name']}: {event['message']}"
            fd = 2 if event["level"] in ("WARNING", "ERROR", "CRITICAL") else 1
            self.lines_received += 1
            self._append([event["rank"], fd, text])
        elif kind == "state":
            self.states[event["rank"]] = RunState(event["state"])
            self.details[event["rank"]] = event["detail"]
            self.changed.add("ranks")
        elif kind == "started":
            self.devices[event["rank"]] = event["device"]
            self.changed.add("ranks")
        elif kind == "heartbeat":
            busy = max(event["busy_s"], 1e-9)
            self.heartbeats[event["rank"]] = (event["wait_s"], busy, event["collective"])
            self.changed.add("ranks")
        elif kind == "progress":
            key = (event["rank"], event["what"])
            self.progress.pop(key, None)  # the newest last (the summary tells the latest)
            self.progress[key] = event["text"]
            self.changed.add("progress")
        elif kind == "result":
            if len(event["value_bytes"]) <= SUMMARY_VALUE_BYTES:
                self.results[event["rank"]] = event["value_bytes"]
        elif kind == "metrics":
            self.metrics.add(event)
            self.changed.add("charts")
        elif kind == "diagnosis":
            self._on_diagnosis(dict(event))
        elif kind == "run_info":
            self.info = dict(event)
            # "All ranks" folds alike lines: keep max_lines for every 8 ranks, so that a line
            # all 64 ranks print is still whole on screen.
            keep = self.max_lines * -(-event["world_size"] // ALL_RANKS_PER_KEEP)
            if keep > self.max_lines:
                self.all_lines = collections.deque(self.all_lines, maxlen=keep)
            if event["world_size"] >= FOLD_FROM_RANKS:
                self._shapes = ShapeCounter()
        elif kind == "run_ended":
            self.ended = dict(event)
            self.changed.add("head")

    def expect_ranks(self) -> None:
        """Every rank of the run, ``STARTING`` until its first state event.

        The live view shows each rank from the start; a summary without a live view lists
        only the ranks that reported (and a rank that never did as ``STOPPED``).
        """
        assert self.info is not None
        for rank in range(self.info["world_size"]):
            self.states.setdefault(rank, RunState.STARTING)

    # --- reading it ------------------------------------------------------------------------------

    def state(self, rank: int) -> RunState:
        """The rank's state; ``STOPPED`` for a rank that never reported one."""
        return self.states.get(rank, RunState.STOPPED)

    def outcome_word(self) -> str:
        """finished, failed, or stopped (interrupted with no rank failing)."""
        if self.ended is not None and self.ended["ok"]:
            return "finished"
        states = set(self.states.values())
        if RunState.STOPPED in states and RunState.FAILED not in states:
            return "stopped"
        return "failed"

    def last_line(self, rank: int) -> str:
        """The rank's latest line with something on it."""
        for line in reversed(self.rank_lines.get(rank, ())):
            if line[TEXT].strip():
                return line[TEXT]
        return ""

    def log_path(self, rank: int) -> str:
        """The rank's log file, where every line is; "" when the run keeps no directory."""
        run_dir = (self.info or {}).get("run_dir")
        return os.path.join(run_dir, f"rank{rank}.log") if run_dir else ""

    def progress_bar(self, rank: int) -> tuple[float, str] | None:
        """(fraction, text) of the tqdm bar the rank is drawing now, if it draws one."""
        for fd in (2, 1):  # tqdm writes to stderr by default
            line = self.open_lines.get((rank, fd))
            if line is not None:
                match = TQDM.search(plain(line[TEXT]))
                if match:
                    done, total = int(match["n"]), int(match["total"])
                    text = f"{done}/{total}"
                    if match["rate"]:
                        text += f" · {match['rate'].strip()}"
                    if match["eta"] and "?" not in match["eta"]:
                        text += f" · ETA {match['eta']}"
                    return (done / total if total else 0.0), text
        return None

    # --- events into state -----------------------------------------------------------------------

    def _on_progress_line(self, rank: int, fd: int, text: str, carriage: bool) -> None:
        """A ``\\r``-ended line (a progress bar) is redrawn in place until its line ends.

        The relay ends it with a finished line, the bar's last state, where the rank's next
        output begins. A blank last state is a bar that was cleared (tqdm's ``leave=False``):
        its line goes away, as it does in a terminal.
        """
        key = (rank, fd)
        line = self.open_lines.get(key)
        if carriage:
            self._bars.add(key)
            if line is not None:
                line[TEXT] = text
                self.changed.add(rank)
            elif text:  # not the bare "\\r" a progress bar starts with
                line = [rank, fd, text]
                self._append(line)
                self.open_lines[key] = line
            return
        ends_bar = key in self._bars
        self._bars.discard(key)
        if line is not None:
            del self.open_lines[key]
        if ends_bar and not text.strip():
            if line is not None:
                self._remove(line)
            return
        self.lines_received += 1
        if line is None:
            self._append([rank, fd, text])
        else:
            line[TEXT] = text
            self.changed.add(rank)

    def _append(self, line: Line) -> None:
        rank = line[RANK]
        if self._shapes is not None:
            line.append(self._shapes.count(rank, line[FD], line[TEXT]))
        self.all_lines.append(line)
        lines = self.rank_lines.get(rank)
        if lines is None:
            lines = self.rank_lines[rank] = collections.deque(maxlen=self.max_lines)
        lines.append(line)
        self.line_counts[rank] += 1
        self.changed.add(rank)

    def _remove(self, line: Line) -> None:
        """Take a line back off screen (a cleared progress bar); it is near the end."""
        rank = line[RANK]
        line[TEXT] = ""  # in case it is further back than this looks
        for lines in (self.all_lines, self.rank_lines.get(rank, ())):
            for back in range(1, min(len(lines), 64) + 1):
                if lines[-back] is line:
                    del lines[-back]
                    break
        self.line_counts[rank] -= 1
        self.changed.add(rank)

    def _on_diagnosis(self, event: dict[str, Any]) -> None:
        for known in self.diagnoses:
            if known["title"] == event["title"] and known["severity"] == event["severity"]:
                if known["body"] == event["body"] and known["secondary"] == event["secondary"]:
                    return  # the same finding again: show it once
                known.update(event)  # an updated finding (a straggler report, a hang)
                self.changed.add("panel")
                return
        self.diagnoses.append(event)
        self.changed.add("panel")
