"""Views of a run: ``LaunchView`` for notebooks, ``TextView`` for terminals and scripts.

A view is an :class:`~nblaunch.events.EventSink`: the relay hands it every event on the thread
that launched the run, it keeps what it needs and renders in ``flush`` (called many times a
second) and ``close``. Views never infer the state of a rank; they show the ``StateChange`` and
``Diagnosis`` events the launcher sends.

``LaunchView`` is built from ipywidgets' core widgets (no JavaScript of its own). It stays calm
under any amount of output: ``handle`` only appends to bounded per-rank buffers, and ``flush``
renders what changed while keeping the number of messages to the browser under ``max_rate`` a
second. When the run ends it displays a static summary (text and HTML) with each rank's outcome
and last lines, so a saved notebook shows what happened even without widget state.
"""

from __future__ import annotations

import collections
import html
import itertools
import os
import re
import signal
import sys
import threading
import time
from typing import Any, TextIO

from nblaunch.events import Event, NullView, RunState
from nblaunch.notebook.charts import MetricSeries, render_svg
from nblaunch.options import DISPLAY_MODES

# Lines a LaunchView keeps on screen per rank; NBLAUNCH_VIEW_LINES changes it.
DEFAULT_VIEW_LINES = 200
# The static summary keeps each rank's last lines, within a total, each cut to a length.
SUMMARY_LINES = 20
SUMMARY_TOTAL_LINES = 200
SUMMARY_LINE_CHARS = 300
# Returned values up to this size (pickled) are shown in the summary, if of a plain type.
SUMMARY_VALUE_BYTES = 4096


class TextView:
    """Prints every event as ``[rank N]``-prefixed text; for terminals, scripts and logs.

    Output is batched and written at most ``max_rate`` times a second, so fast ranks cost few
    writes; a ``\\r`` progress line is printed at most once a second per rank, and its last state
    once, when the line ends (a bar that was cleared leaves nothing). Ranks' stderr,
    logs and nblaunch's notes go to stderr, the rest to stdout, in the order they happened.
    """

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        *,
        max_rate: float = 20.0,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._pending: list[tuple[bool, str]] = []  # (to stderr?, text), in arrival order
        self._interval = 1.0 / max_rate
        self._last_flush = 0.0
        self._last_carriage: dict[int, float] = {}
        self._bars: set[tuple[int, int]] = set()  # (rank, fd) whose last line was a "\\r" one
        self.world_size = 0

    @property
    def stdout(self) -> TextIO:
        return self._stdout or sys.stdout

    @property
    def stderr(self) -> TextIO:
        return self._stderr or sys.stderr

    def handle(self, event: Event) -> None:
        kind = event["kind"]
        if kind == "stream":
            rank = event["rank"]
            key = (rank, event["fd"])
            if event["carriage"]:
                self._bars.add(key)
                now = time.monotonic()
                if not event["text"].strip() or now - self._last_carriage.get(rank, 0.0) < 1.0:
                    return
                self._last_carriage[rank] = now
            elif key in self._bars:
                self._bars.discard(key)
                if not event["text"].strip():
                    return  # the bar was cleared (tqdm's leave=False): nothing to keep
            self._pending.append((event["fd"] == 2, f"[rank {rank}] {event['text']}\n"))
        elif kind == "log":
            self._pending.append(
                (True, f"[rank {event['rank']}] {event['level']} {event['message']}\n")
            )
        elif kind == "progress":
            self._pending.append((False, f"[rank {event['rank']}] {event['text']}\n"))
        elif kind == "run_info":
            self.world_size = event["world_size"]
            line = (
                f"nblaunch: {event['world_size']} rank(s) on {event['device_kind']} "
                f"({event['start_method']}{', debug' if event['debug'] else ''})"
            )
            if event["run_dir"]:
                line += f", logs in {event['run_dir']}"
            self._pending.append((False, line + "\n"))
            self._pending.extend((False, f"nblaunch: {note}\n") for note in event.get("notes", ()))
            self._pending.extend((False, f"nblaunch: warning: {w}\n") for w in event["warnings"])
        elif kind == "state":
            if event["state"] in (RunState.STALLED, RunState.RETRYING) and event["detail"]:
                self._pending.append(
                    (True, f"[rank {event['rank']}] {event['state'].value}: {event['detail']}\n")
                )
        elif kind == "diagnosis":
            if event["severity"] != "error":  # errors are raised; the traceback shows them
                self._pending.append((True, f"nblaunch: {event['title']}\n{event['body']}\n"))
        elif kind == "run_ended":
            summary = _summary_text(event["ok"], event["elapsed_s"], event["ranks"])
            self._pending.append((False, summary))

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < self._interval:
            return
        self._last_flush = now
        pending, self._pending = self._pending, []
        for to_stderr, texts in itertools.groupby(pending, key=lambda item: item[0]):
            stream = self.stderr if to_stderr else self.stdout
            stream.write("".join(text for _, text in texts))
            stream.flush()

    def close(self) -> None:
        self.flush(force=True)


class RecordingView:
    """Keeps every event it is given, in order: a view for tests and for code that inspects a run.

    ``notebook_launcher``'s views are chosen by ``display=``; pass this one to
    ``nblaunch.engine.run.Run(plan, RecordingView())`` to see exactly what a view would have shown.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def flush(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[Event]:
        """The events of one kind (``"stream"``, ``"log"``, ``"state"``, ...)."""
        return [event for event in self.events if event["kind"] == kind]


# What tqdm draws: "desc:  42%|████▏     | 42/100 [00:01<00:02, 30.12it/s]".
_TQDM = re.compile(
    r"(?P<pct>\d+)%\|.*\|\s*(?P<n>\d+)/(?P<total>\d+)\s*"
    r"\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+)(?:,\s*(?P<rate>[^\]]*))?\]"
)


def _bar_html(fraction: float, text: str) -> str:
    return (
        f"<span class='nbl-meter'><span class='nbl-pbar'><span style='width:"
        f"{min(1.0, max(0.0, fraction)) * 100:.0f}%'></span></span> {fraction:.0%} · "
        f"{_esc(text)}</span>"
    )


def _summary_text(ok: bool, elapsed_s: float, ranks: dict[int, str]) -> str:
    lines = [f"nblaunch: {'finished' if ok else 'failed'} in {elapsed_s:.2f} s"]
    lines += [f"  rank {rank}: {outcome}" for rank, outcome in sorted(ranks.items())]
    return "\n".join(lines) + "\n"


# --- the notebook view ---------------------------------------------------------------------------

# Calm colours: a soft background and a dark foreground per state.
STATE_COLORS: dict[RunState, tuple[str, str]] = {
    RunState.STARTING: ("#f1f5f9", "#475569"),
    RunState.RUNNING: ("#e0f2fe", "#075985"),
    RunState.RETRYING: ("#fef3c7", "#92400e"),
    RunState.STALLED: ("#ffedd5", "#9a3412"),
    RunState.DEBUGGING: ("#ede9fe", "#5b21b6"),
    RunState.FAILED: ("#fee2e2", "#991b1b"),
    RunState.DONE: ("#dcfce7", "#166534"),
    RunState.STOPPED: ("#e5e7eb", "#374151"),
}
# Rank tags in the "All ranks" log, repeated past eight ranks.
RANK_COLORS = (
    "#2563eb",
    "#c2410c",
    "#15803d",
    "#7c3aed",
    "#0e7490",
    "#be185d",
    "#4d7c0f",
    "#b45309",
)
SEVERITY_COLORS = {"error": ("#fef2f2", "#b91c1c"), "warning": ("#fffbeb", "#b45309")}
SEVERITY_COLORS["info"] = ("#f0f9ff", "#0369a1")

CSS = """<style>
.nbl-root{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px}
.nbl-head{color:#334155;line-height:1.6}
.nbl-head b{color:#0f172a}
.nbl-dim{color:#64748b}
.nbl-warn{color:#b45309}
.nbl-ranks{display:flex;flex-direction:column;gap:3px;margin:2px 0}
.nbl-rank{display:flex;align-items:center;gap:8px;min-width:0}
.nbl-badge{display:inline-block;min-width:8.5em;padding:1px 8px;border-radius:9px;
  font-size:12px;font-weight:600;white-space:nowrap}
.nbl-last{font-family:var(--jp-code-font-family,monospace);font-size:12px;color:#334155;
  overflow:hidden;text-overflow:ellipsis;white-space:nowrap;flex:1;min-width:0}
.nbl-bar{display:inline-block;width:60px;height:6px;background:#fcd34d;border-radius:3px;
  overflow:hidden;vertical-align:middle}
.nbl-bar span{display:block;height:100%;background:#38bdf8}
.nbl-meter{font-size:11px;color:#64748b;white-space:nowrap}
.nbl-pbar{display:inline-block;width:140px;height:8px;background:#e2e8f0;border-radius:4px;
  overflow:hidden;vertical-align:middle}
.nbl-pbar span{display:block;height:100%;background:#2563eb}
.nbl-log{max-height:24em;overflow-y:auto;display:flex;flex-direction:column-reverse;
  border:1px solid #e2e8f0;border-radius:4px;background:#fcfcfd}
.nbl-log pre{flex:none;overflow:visible;margin:0;padding:6px 8px;font-size:12px;
  line-height:1.4;white-space:pre-wrap;overflow-wrap:anywhere;font-family:var(--jp-code-font-family,monospace);color:#1e293b}
.nbl-err{color:#9a3412}
.nbl-tag{font-weight:600}
.nbl-diag{border-left:4px solid;border-radius:3px;padding:6px 10px;margin:4px 0}
.nbl-diag pre{margin:4px 0 0;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere;
  max-height:20em;overflow-y:auto;font-family:var(--jp-code-font-family,monospace)}
.nbl-title{font-weight:600}
.nbl-diag details{margin-top:4px;color:#475569}
.nbl-progress{padding:4px 10px;border-left:4px solid #f59e0b;background:#fffbeb;margin:4px 0}
</style>"""


_shared: dict[str, Any] = {}


def _shared_models() -> dict[str, Any]:
    """Layouts and styles shared by every view's widgets, made once per kernel.

    Each ipywidget otherwise makes a Layout and a Style model of its own: two more comms to open
    per widget, which made up most of a view's ~15 ms build. Shared models are never changed
    (a widget that should look different gets another one), since other views show them too.
    """
    if not _shared:
        import ipywidgets as widgets
        from ipywidgets.widgets.widget_string import HTMLStyle

        _shared.update(
            plain=widgets.Layout(),
            hidden=widgets.Layout(display="none"),
            grow=widgets.Layout(flex="1 1 auto"),
            button=widgets.Layout(width="auto", flex="0 0 auto"),
            row=widgets.Layout(align_items="flex-start"),
            html_style=HTMLStyle(),
            button_style=widgets.ButtonStyle(),
        )
    return _shared


# A visible line is a small list, [rank, fd, text]: cheaper to make than an object, and mutable,
# so a "\r" progress line is redrawn in place in every buffer that holds it.
_RANK, _FD, _TEXT = 0, 1, 2
_Line = list


class LaunchView:
    """The live view of a run in a notebook cell, built from ipywidgets.

    A header (ranks, device, start method, debug, run directory, elapsed time) with a Stop
    button; one status badge per rank with its last line and, once heartbeats arrive, the share
    of time it spends computing versus waiting in collectives; an error panel for diagnoses; a
    progress area for multi-attempt operations (out-of-memory retries); and the logs, in an
    "All ranks" tab and one tab per rank.

    Parameters
    ----------
    max_lines
        Lines kept on screen per rank and in the "All ranks" tab (default 200, or
        ``NBLAUNCH_VIEW_LINES``); every line is in the run directory's ``rank<N>.log`` anyway.
    max_rate
        Most messages sent to the browser per second, whatever the ranks print.
    max_line_chars
        Longer lines are shown cut, with a note (the log file has them whole).

    Notes
    -----
    ``handle``, ``flush`` and ``close`` run on the thread that launched the run (the kernel's
    main thread), so every update belongs to the cell that launched it. The Stop button has to
    work while that thread is busy running the launcher: its clicks are noticed on ipykernel's
    shell-channel thread (ipykernel 7+, which routes each comm message there first) and turned
    into the kernel's own interrupt, SIGINT to this process, which the launcher answers by
    stopping every rank.
    """

    def __init__(
        self, *, max_lines: int | None = None, max_rate: float = 20.0, max_line_chars: int = 1000
    ) -> None:
        if max_lines is None:
            max_lines = _env_lines()
        if max_lines < 1 or max_rate <= 0 or max_line_chars < 1:
            raise ValueError("max_lines, max_rate and max_line_chars must be positive")
        self.max_lines = max_lines
        self.max_rate = max_rate
        self.max_line_chars = max_line_chars
        # What the view has taken in (read by tests and benchmarks).
        self.lines_received = 0  # finished lines (Stream events not ended by "\r")
        self.renders = 0
        self.messages_sent = 0  # widget updates sent to the browser
        self.summary_shown = False
        self._summary_id: str | None = None  # display id of the summary, to update it in place
        self._summary_sent: dict[str, str] = {}
        self.stop_hooked = False  # the Stop button works while the run is busy
        self.info: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None
        self.states: dict[int, RunState] = {}
        self.details: dict[int, str] = {}
        self.devices: dict[int, str] = {}
        self.diagnoses: list[dict[str, Any]] = []
        self.progress: dict[tuple[int, str], str] = {}
        self.heartbeats: dict[int, tuple[float, float, str | None]] = {}
        self.results: dict[int, bytes] = {}  # rank -> its pickled return value, when small
        self.metrics = MetricSeries()  # what ranks sent with nblaunch.log_metrics
        self._all: collections.deque[_Line] = collections.deque(maxlen=max_lines)
        self._per_rank: dict[int, collections.deque[_Line]] = {}
        self._counts: dict[int, int] = collections.Counter()
        self._open: dict[tuple[int, int], _Line] = {}  # (rank, fd) -> its unfinished "\r" line
        self._bars: set[tuple[int, int]] = set()  # (rank, fd) whose last event was a "\\r" line
        self._dirty: set[Any] = set()
        self._rendered: set[Any] = set()
        self._next_render = 0.0
        self._last_header = 0.0
        self._started_clock = time.monotonic()
        self._widgets: dict[str, Any] = {}
        self._logs: list[Any] = []
        self._shown: dict[int, str] = {}  # id(widget) -> value last sent
        self._running = False
        self._stop_lock = threading.Lock()
        self.stop_requested = False
        # False: build no widgets, show only the static summary at the end (a run that was
        # over before its live view would have appeared; see DeferredView).
        self.live = True

    # --- EventSink -------------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Take one event; cheap for output lines (appends to bounded buffers)."""
        kind = event["kind"]
        if kind == "stream":
            # Every line a rank prints comes here: a few appends, no calls; render in flush.
            rank = event["rank"]
            if event["carriage"] or self._bars:
                self._on_progress_line(rank, event["fd"], event["text"], event["carriage"])
                return
            self.lines_received += 1
            line = [rank, event["fd"], event["text"]]
            self._all.append(line)
            lines = self._per_rank.get(rank)
            if lines is None:
                lines = self._per_rank[rank] = collections.deque(maxlen=self.max_lines)
            lines.append(line)
            self._counts[rank] += 1
            self._dirty.add(rank)
        elif kind == "log":
            text = f"{event['level']} {event['name']}: {event['message']}"
            fd = 2 if event["level"] in ("WARNING", "ERROR", "CRITICAL") else 1
            self._on_stream(event["rank"], fd, text)
        elif kind == "state":
            self.states[event["rank"]] = RunState(event["state"])
            self.details[event["rank"]] = event["detail"]
            self._dirty.add("ranks")
        elif kind == "started":
            self.devices[event["rank"]] = event["device"]
            self._dirty.add("ranks")
        elif kind == "heartbeat":
            busy = max(event["busy_s"], 1e-9)
            self.heartbeats[event["rank"]] = (event["wait_s"], busy, event["collective"])
            self._dirty.add("ranks")
        elif kind == "progress":
            self.progress[(event["rank"], event["what"])] = event["text"]
            self._dirty.add("progress")
        elif kind == "result":
            if len(event["value_bytes"]) <= SUMMARY_VALUE_BYTES:
                self.results[event["rank"]] = event["value_bytes"]
        elif kind == "metrics":
            self.metrics.add(event)
            self._dirty.add("charts")
        elif kind == "diagnosis":
            self._on_diagnosis(dict(event))
        elif kind == "run_info":
            self.info = dict(event)
            self._started_clock = time.monotonic() - max(0.0, time.time() - event["started_at"])
            self._running = True
            self._build()
        elif kind == "run_ended":
            self.ended = dict(event)
            self._dirty.add("head")
        if self.summary_shown and kind in ("diagnosis", "state", "progress"):
            self._after_close()

    def flush(self, force: bool = False) -> None:
        """Render what changed, keeping under ``max_rate`` browser messages a second."""
        now = time.monotonic()
        if self._running and now - self._last_header >= 1.0:
            self._dirty.add("head")  # the elapsed time
        if not self._dirty or not self._widgets or (not force and now < self._next_render):
            return
        sent = self._render()
        self._last_header = now if "head" in self._rendered else self._last_header
        # A render that sent k messages buys the next one k / max_rate seconds later.
        self._next_render = now + sent / self.max_rate

    def close(self) -> None:
        """The run is over: final render, retire the Stop button, show the static summary."""
        with self._stop_lock:
            self._running = False
        if self._widgets:
            self._dirty.update(("head", "ranks", "panel", "progress", "charts", "logs"))
            self._dirty.update(self._per_rank)
            self.flush(force=True)
            stop = self._widgets["stop"]
            stop.disabled = True
            stop.layout = _shared_models()["hidden"]
        elif self.live:
            return  # no run to show
        if self.ended is not None and not self.summary_shown:
            self.summary_shown = True
            self._summary_id = f"nblaunch-summary-{id(self):x}-{time.time_ns():x}"
            self._summary_sent = self.summary_bundle()
            _display(self._summary_sent, raw=True, display_id=self._summary_id)

    def _after_close(self) -> None:
        """An event after the run ended (the root cause comes last): show it, update the summary."""
        self.flush(force=True)
        if self._summary_id is None:
            return
        bundle = self.summary_bundle()
        if bundle != self._summary_sent:
            self._summary_sent = bundle
            _display(bundle, raw=True, display_id=self._summary_id, update=True)

    # --- the Stop button -------------------------------------------------------------------------

    def request_stop(self) -> bool:
        """Interrupt the run like the kernel's interrupt button: SIGINT to this process.

        Safe from any thread; does nothing once the run is over or a stop was requested.
        Returns True when the interrupt was sent.
        """
        with self._stop_lock:
            if not self._running or self.stop_requested:
                return False
            self.stop_requested = True
        os.kill(os.getpid(), signal.SIGINT)
        return True

    def _hook_stop(self, button: Any) -> bool:
        """Notice clicks on ipykernel's shell-channel thread, before they queue behind the run.

        ipykernel 7 asks each comm, on that thread, where to route a frontend message
        (``_reply_subshell_for``); wrapping that question lets a click be seen while the main
        thread is busy in the launcher. The message still goes on to its usual handler.
        """
        comm = getattr(button, "comm", None)
        route = getattr(comm, "_reply_subshell_for", None)
        if route is None:
            return False

        def route_and_watch(data: Any, default: Any) -> Any:
            content = data.get("content") if isinstance(data, dict) else None
            if isinstance(content, dict) and content.get("event") == "click":
                self.request_stop()
            return route(data, default)

        comm._reply_subshell_for = route_and_watch
        return True

    # --- events into state -----------------------------------------------------------------------

    def _on_stream(self, rank: int, fd: int, text: str) -> None:
        """A line that did not come as a Stream event (a Log record): never part of a bar."""
        self.lines_received += 1
        self._append([rank, fd, text])

    def _on_progress_line(self, rank: int, fd: int, text: str, carriage: bool) -> None:
        """A ``\\r``-ended line (a progress bar) is redrawn in place until its line ends.

        The relay ends it with a finished line, the bar's last state, where the rank's next
        output begins. A blank last state is a bar that was cleared (tqdm's ``leave=False``):
        its line goes away, as it does in a terminal.
        """
        key = (rank, fd)
        line = self._open.get(key)
        if carriage:
            self._bars.add(key)
            if line is not None:
                line[_TEXT] = text
                self._dirty.add(rank)
            elif text:  # not the bare "\\r" a progress bar starts with
                line = [rank, fd, text]
                self._append(line)
                self._open[key] = line
            return
        ends_bar = key in self._bars
        self._bars.discard(key)
        if line is not None:
            del self._open[key]
        if ends_bar and not text.strip():
            if line is not None:
                self._remove(line)
            return
        self.lines_received += 1
        if line is None:
            self._append([rank, fd, text])
        else:
            line[_TEXT] = text
            self._dirty.add(rank)

    def _append(self, line: _Line) -> None:
        rank = line[_RANK]
        self._all.append(line)
        lines = self._per_rank.get(rank)
        if lines is None:
            lines = self._per_rank[rank] = collections.deque(maxlen=self.max_lines)
        lines.append(line)
        self._counts[rank] += 1
        self._dirty.add(rank)

    def _remove(self, line: _Line) -> None:
        """Take a line back off screen (a cleared progress bar); it is near the end."""
        rank = line[_RANK]
        line[_TEXT] = ""  # in case it is further back than this looks
        for lines in (self._all, self._per_rank.get(rank, ())):
            for back in range(1, min(len(lines), 64) + 1):
                if lines[-back] is line:
                    del lines[-back]
                    break
        self._counts[rank] -= 1
        self._dirty.add(rank)

    def _on_diagnosis(self, event: dict[str, Any]) -> None:
        for known in self.diagnoses:
            if known["title"] == event["title"] and known["severity"] == event["severity"]:
                if known["body"] == event["body"] and known["secondary"] == event["secondary"]:
                    return  # the same finding again: show it once
                known.update(event)  # an updated finding (a straggler report, a hang)
                self._dirty.add("panel")
                return
        self.diagnoses.append(event)
        self._dirty.add("panel")

    # --- widgets ---------------------------------------------------------------------------------

    def _build(self) -> None:
        """Create the widgets once the run's size is known, and show them in this cell."""
        import ipywidgets as widgets

        if self._widgets or not self.live:
            return
        assert self.info is not None
        world = self.info["world_size"]
        shared = _shared_models()

        def html(value: str = "", layout: str = "plain") -> Any:
            return widgets.HTML(value, layout=shared[layout], style=shared["html_style"])

        head = html(layout="grow")
        stop = widgets.Button(
            description="Stop",
            icon="stop",
            tooltip="Interrupt every rank, like the notebook's interrupt button",
            layout=shared["button"],
            style=shared["button_style"],
        )
        stop.on_click(lambda _button: self.request_stop())
        self.stop_hooked = self._hook_stop(stop)
        if not self.stop_hooked:
            stop.tooltip = "Takes effect only between cells here: use the notebook's interrupt"
        ranks = html()
        panel = html(layout="hidden")
        progress = html(layout="hidden")
        charts = html(layout="hidden")
        self._logs = [html() for _ in range(world + 1)]
        tabs = widgets.Tab(
            children=self._logs,
            titles=["All ranks", *(f"rank {r}" for r in range(world))],
            layout=shared["plain"],
        )
        top = widgets.HBox([head, stop], layout=shared["row"])
        root = widgets.VBox(
            [html(CSS), top, ranks, panel, progress, charts, tabs], layout=shared["plain"]
        )
        root.add_class("nbl-root")
        self._widgets = {
            "root": root,
            "head": head,
            "stop": stop,
            "ranks": ranks,
            "panel": panel,
            "progress": progress,
            "charts": charts,
            "tabs": tabs,
        }
        for rank in range(world):
            self.states.setdefault(rank, RunState.STARTING)
        self._dirty.update(("head", "ranks", "logs"))
        _display(root)
        self.flush(force=True)

    def _render(self) -> int:
        """Push what changed to the widgets; return how many messages that sent."""
        dirty, self._dirty = self._dirty, set()
        if any(isinstance(part, int) for part in dirty):  # new lines: the log and last lines
            dirty.update(("logs", "ranks"))
        self._rendered = dirty
        self.renders += 1
        sent = 0
        w = self._widgets
        if "head" in dirty:
            sent += self._set(w["head"], self._head_html())
        if "ranks" in dirty:
            sent += self._set(w["ranks"], self._ranks_html())
        if "panel" in dirty:
            sent += self._show(w["panel"], self._panel_html())
        if "progress" in dirty:
            sent += self._show(w["progress"], self._progress_html())
        if "charts" in dirty:
            sent += self._show(w["charts"], render_svg(self.metrics) if self.metrics else "")
        if "logs" in dirty:
            sent += self._set(self._logs[0], self._log_html(self._all, None, tagged=True))
        for rank, log in enumerate(self._logs[1:]):
            if rank in dirty:
                lines = self._per_rank.get(rank, ())
                sent += self._set(log, self._log_html(lines, rank, tagged=False))
        self.messages_sent += sent
        return sent

    def _set(self, widget: Any, value: str) -> int:
        if self._shown.get(id(widget)) == value:
            return 0
        self._shown[id(widget)] = value
        widget.value = value
        return 1

    def _show(self, widget: Any, value: str) -> int:
        sent = self._set(widget, value)
        # Swap the shared layout rather than change it: other widgets and views use it too.
        layout = _shared_models()["plain" if value else "hidden"]
        if widget.layout is not layout:
            widget.layout = layout
            sent += 1
        return sent

    # --- HTML --------------------------------------------------------------------------------

    def _head_html(self) -> str:
        info = self.info or {}
        world = info.get("world_size", 0)
        parts = [
            f"<b>{world} rank{'s' if world != 1 else ''}</b>",
            _esc(info.get("device_kind", "")),
            _esc(info.get("start_method", "")),
            f"debug {'on' if info.get('debug') else 'off'}",
        ]
        if self.ended is not None:
            parts.append(f"<b>{self._outcome_word()}</b> in {self.ended['elapsed_s']:.1f} s")
        else:
            parts.append(f"{time.monotonic() - self._started_clock:.0f} s")
        out = "<div class='nbl-head'>nblaunch · " + " · ".join(parts)
        if info.get("run_dir"):
            out += f"<br><span class='nbl-dim'>logs: {_esc(info['run_dir'])}</span>"
        for note in info.get("notes", ()):
            out += f"<br><span class='nbl-dim'>{_esc(note)}</span>"
        for warning in info.get("warnings", ()):
            out += f"<br><span class='nbl-warn'>⚠ {_esc(warning)}</span>"
        return out + "</div>"

    def _ranks_html(self) -> str:
        rows = []
        bars = []  # the tqdm bars ranks draw now
        for rank in sorted(self.states):
            state = self.states[rank]
            bg, fg = STATE_COLORS[state]
            detail = self.details.get(rank, "")
            if state in (RunState.FAILED, RunState.STALLED, RunState.RETRYING, RunState.STOPPED):
                last = detail or self._last_line(rank)
            else:
                last = self._last_line(rank) or detail
            device = self.devices.get(rank, "")
            row = (
                f"<div class='nbl-rank'><span class='nbl-badge' style='background:{bg};"
                f"color:{fg}'>rank {rank} · {state.value}</span>"
            )
            if device:
                row += f"<span class='nbl-dim'>{_esc(device)}</span>"
            bar = self._progress_bar(rank)
            if bar is not None:  # a tqdm bar: drawn as a bar, with its count, rate and ETA
                bars.append(bar)
                row += _bar_html(*bar)
            else:
                preview = _ansi_strip(last[:500])
                row += f"<span class='nbl-last' title='{preview}'>{preview}</span>"
            beat = self.heartbeats.get(rank)
            if beat is not None:
                wait, busy, collective = beat
                share = min(1.0, max(0.0, (busy - wait) / busy))
                inside = f" · in {_esc(collective)}" if collective else ""
                row += (
                    f"<span class='nbl-meter'><span class='nbl-bar'><span style='width:"
                    f"{share * 100:.0f}%'></span></span> compute {share:.0%} · wait "
                    f"{1 - share:.0%}{inside}</span>"
                )
            rows.append(row + "</div>")
        if len(bars) > 1:  # all ranks: as far as the slowest
            slowest = min(bars, key=lambda bar: bar[0])
            rows.insert(
                0,
                "<div class='nbl-rank'><span class='nbl-badge' style='background:#f1f5f9;"
                f"color:#334155'>all ranks</span>{_bar_html(*slowest)}</div>",
            )
        return "<div class='nbl-ranks'>" + "".join(rows) + "</div>"

    def _progress_bar(self, rank: int) -> tuple[float, str] | None:
        """(fraction, text) of the tqdm bar the rank is drawing now, if it draws one."""
        for fd in (2, 1):  # tqdm writes to stderr by default
            line = self._open.get((rank, fd))
            if line is not None:
                match = _TQDM.search(_ansi_plain(line[_TEXT]))
                if match:
                    done, total = int(match["n"]), int(match["total"])
                    text = f"{done}/{total}"
                    if match["rate"]:
                        text += f" · {match['rate'].strip()}"
                    if match["eta"] and "?" not in match["eta"]:
                        text += f" · ETA {match['eta']}"
                    return (done / total if total else 0.0), text
        return None

    def _panel_html(self) -> str:
        errors = [d for d in self.diagnoses if d["severity"] == "error"]
        others = [d for d in self.diagnoses if d["severity"] != "error"]
        blocks = []
        if errors:
            root, *later = errors
            secondary = list(root["secondary"]) + [d["title"] for d in later]
            blocks.append(_diagnosis_html(root, secondary))
        blocks += [_diagnosis_html(d, d["secondary"]) for d in others]
        return "".join(blocks)

    def _progress_html(self) -> str:
        if not self.progress:
            return ""
        rows = [
            f"<div><b>rank {rank}</b> · {_esc(what)}: {_esc(text)}</div>"
            for (rank, what), text in sorted(self.progress.items())
        ]
        return "<div class='nbl-progress'>" + "".join(rows) + "</div>"

    def _log_html(self, lines: Any, rank: int | None, *, tagged: bool) -> str:
        limit = self.max_line_chars
        parts = []
        if rank is not None and self._counts[rank] > len(lines):
            earlier = self._counts[rank] - len(lines)
            where = self._log_path(rank)
            parts.append(
                f"<span class='nbl-dim'>… {earlier} earlier line{'s' if earlier != 1 else ''}"
                f"{' in ' + _esc(where) if where else ''}</span>\n"
            )
        for line in lines:
            text = line[_TEXT]
            if len(text) > limit:
                text = text[:limit]
                cut = (
                    f"<span class='nbl-dim'> … ({len(line[_TEXT]) - limit} more characters)</span>"
                )
            else:
                cut = ""
            body = _ansi_to_html(text)
            if line[_FD] == 2:
                body = f"<span class='nbl-err'>{body}</span>"
            if tagged:
                rank_tag = line[_RANK]
                color = RANK_COLORS[rank_tag % len(RANK_COLORS)]
                body = f"<span class='nbl-tag' style='color:{color}'>[{rank_tag}]</span> {body}"
            parts.append(body + cut + "\n")
        return f"<div class='nbl-log'><pre>{''.join(parts)}</pre></div>"

    def _last_line(self, rank: int) -> str:
        """The rank's latest line with something on it."""
        for line in reversed(self._per_rank.get(rank, ())):
            if line[_TEXT].strip():
                return line[_TEXT]
        return ""

    def _log_path(self, rank: int) -> str:
        run_dir = (self.info or {}).get("run_dir")
        return os.path.join(run_dir, f"rank{rank}.log") if run_dir else ""

    # --- the static summary ----------------------------------------------------------------------

    def summary_bundle(self) -> dict[str, str]:
        """The end-of-run summary as ``text/plain`` and ``text/html``, for saved notebooks.

        Per rank: its state and outcome (what it returned, or its error), then its last lines
        (``SUMMARY_LINES`` each, ``SUMMARY_TOTAL_LINES`` in all, with a note of how many
        earlier lines its log file holds), and the error that ended the run. A notebook opened
        without widget state (GitHub, nbviewer, another Lab) shows this instead of the view.
        """
        ended = self.ended or {"ok": False, "elapsed_s": 0.0, "ranks": {}}
        ranks = sorted(set(self.states) | set(ended["ranks"]))
        outcomes = {r: self._outcome(r, ended["ranks"].get(r, "")) for r in ranks}
        header = f"nblaunch: {self._outcome_word()} in {ended['elapsed_s']:.2f} s"
        run_dir = (self.info or {}).get("run_dir", "")
        errors = [d["title"] for d in self.diagnoses if d["severity"] == "error"][:1]
        notes = [d["title"] for d in self.diagnoses if d["severity"] != "error"][:5]
        tails = self._summary_tails(ranks)

        plain = [header]
        plain += [f"  rank {r}: {self._state(r).value} · {outcomes[r]}" for r in ranks]
        plain += [f"  logs: {run_dir}"] if run_dir else []
        plain += [f"error: {title}" for title in errors] + [f"note: {title}" for title in notes]
        for r, lines, earlier in tails:
            plain.append(f"--- rank {r}, last {_plural(len(lines), 'line')}")
            if earlier:
                plain.append(f"  {self._earlier_note(r, earlier)}")
            plain += [f"  {_ansi_plain(_cut(line[_TEXT]))}" for line in lines]

        cell = "padding:2px 10px;text-align:left;border-bottom:1px solid #e5e7eb;white-space:nowrap"
        rows = []
        for r in ranks:
            bg, fg = STATE_COLORS[self._state(r)]
            rows.append(
                f"<tr><td style='{cell}'>rank {r}</td><td style='{cell}'><span style='"
                f"background:{bg};color:{fg};padding:1px 8px;border-radius:9px;font-weight:600'>"
                f"{self._state(r).value}</span></td><td style='{cell};white-space:normal'>"
                f"{_esc(outcomes[r])}</td>"
                + (f"<td style='{cell}'><code>rank{r}.log</code></td>" if run_dir else "")
                + "</tr>"
            )
        title = _esc(header.removeprefix("nblaunch: "))
        where = f"<div style='color:#64748b'>logs in <code>{_esc(run_dir)}</code></div>"
        found = "".join(
            f"<div style='color:{SEVERITY_COLORS[kind][1]};margin:4px 0'><b>{label}:</b> "
            f"{_esc(text)}</div>"
            for kind, label, texts in (("error", "error", errors), ("warning", "note", notes))
            for text in texts
        )
        pre = (
            "margin:2px 0 6px;padding:4px 8px;font-size:12px;line-height:1.4;white-space:pre-wrap;"
            "overflow-wrap:anywhere;background:#fcfcfd;border:1px solid #e2e8f0;border-radius:4px"
        )
        blocks = []
        for r, lines, earlier in tails:
            body = "".join(
                (
                    f"<span style='color:#9a3412'>{_ansi_to_html(_cut(line[_TEXT]))}</span>"
                    if line[_FD] == 2
                    else _ansi_to_html(_cut(line[_TEXT]))
                )
                + "\n"
                for line in lines
            )
            note = (
                f"<span style='color:#64748b'>{_esc(self._earlier_note(r, earlier))}</span>\n"
                if earlier
                else ""
            )
            blocks.append(
                f"<div style='color:#475569;margin-top:4px'>rank {r}, last "
                f"{_plural(len(lines), 'line')}</div><pre style='{pre}'>{note}{body}</pre>"
            )
        charts = render_svg(self.metrics) if self.metrics else ""  # kept in the saved file
        if self.metrics:
            names = ", ".join(sorted(self.metrics.series))
            plain.append(f"metrics: {names} (in {run_dir or 'the run'}/metrics.jsonl)")
        html_out = (
            f"<div><b>nblaunch</b> {title}<table style='border-collapse:collapse;"
            f"margin:4px 0'>{''.join(rows)}</table>{where if run_dir else ''}{found}"
            f"{charts}{''.join(blocks)}</div>"
        )
        return {"text/plain": "\n".join(plain), "text/html": html_out}

    def _summary_tails(self, ranks: list[int]) -> list[tuple[int, list[_Line], int]]:
        """``(rank, last lines, earlier lines)`` for the summary, within its line budget."""
        with_lines = [r for r in ranks if self._per_rank.get(r)]
        if not with_lines:
            return []
        each = max(1, min(SUMMARY_LINES, SUMMARY_TOTAL_LINES // len(with_lines)))
        tails = []
        budget = SUMMARY_TOTAL_LINES
        for r in with_lines:
            lines = list(self._per_rank[r])[-min(each, budget) :] if budget else []
            budget -= len(lines)
            tails.append((r, lines, self._counts[r] - len(lines)))
        return tails

    def _earlier_note(self, rank: int, earlier: int) -> str:
        where = self._log_path(rank)
        return f"… {_plural(earlier, 'earlier line')}{' in ' + where if where else ''}"

    def _outcome(self, rank: int, outcome: str) -> str:
        """The rank's outcome, with a short form of what it returned when that is cheap."""
        value = self.results.get(rank)
        if outcome != "returned" or value is None:
            return outcome
        shown = _short_repr(value)
        return f"returned {shown}" if shown else outcome

    def _outcome_word(self) -> str:
        """finished, failed, or stopped (interrupted with no rank failing)."""
        if self.ended is not None and self.ended["ok"]:
            return "finished"
        states = set(self.states.values())
        if RunState.STOPPED in states and RunState.FAILED not in states:
            return "stopped"
        return "failed"

    def _state(self, rank: int) -> RunState:
        return self.states.get(rank, RunState.STOPPED)


def _plural(count: int, what: str) -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def _cut(text: str) -> str:
    return text if len(text) <= SUMMARY_LINE_CHARS else text[:SUMMARY_LINE_CHARS] + " …"


def _ansi_plain(text: str) -> str:
    return _ANSI.sub("", text) if "\x1b" in text else text


def _short_repr(value_bytes: bytes) -> str:
    """A one-line repr of a small returned value of a plain type; "" for anything else.

    The view does not unpickle what it cannot show in a line anyway (large values, objects of
    the user's own classes): the launcher returns those to the caller.
    """
    import pickle
    import reprlib

    if len(value_bytes) > SUMMARY_VALUE_BYTES:
        return ""
    try:
        value = pickle.loads(value_bytes)
    except Exception:
        return ""
    if type(value).__module__ not in ("builtins", "numpy", "torch"):
        return ""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 60
    try:
        text = short.repr(value) if type(value).__module__ == "builtins" else repr(value)
    except Exception:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= 120 else text[:117] + "..."


def _env_lines() -> int:
    """``NBLAUNCH_VIEW_LINES``, the lines a view keeps per rank (200 when unset or invalid)."""
    try:
        return max(1, int(os.environ.get("NBLAUNCH_VIEW_LINES", "")))
    except ValueError:
        return DEFAULT_VIEW_LINES


def _diagnosis_html(diagnosis: dict[str, Any], secondary: list[str]) -> str:
    bg, fg = SEVERITY_COLORS.get(diagnosis["severity"], SEVERITY_COLORS["info"])
    icon = {"error": "⛔", "warning": "⚠"}.get(diagnosis["severity"], "ℹ")
    out = (
        f"<div class='nbl-diag' style='background:{bg};border-color:{fg}'>"
        f"<div class='nbl-title' style='color:{fg}'>{icon} {_esc(diagnosis['title'])}</div>"
    )
    if diagnosis["body"] and diagnosis["body"] != diagnosis["title"]:
        out += f"<pre>{_ansi_to_html(diagnosis['body'])}</pre>"
    if secondary:
        items = "".join(f"<li>{_esc(line)}</li>" for line in secondary)
        count = len(secondary)
        out += (
            f"<details><summary>{count} other failure{'s' if count != 1 else ''}"
            f" (consequences)</summary><ul>{items}</ul></details>"
        )
    return out + "</div>"


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


# Any escape sequence: CSI (ESC [ ... final byte), OSC (ESC ] ... BEL/ST) or a two-byte ESC x.
_ANSI = re.compile(r"\x1b(?:\[([0-9;?]*)([@-~])|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_BASIC = ("#000000", "#cd3131", "#0d7a3e", "#949800", "#0451a5", "#bc05bc", "#0598bc", "#555555")
_BRIGHT = ("#666666", "#e53e3e", "#16a34a", "#b59f00", "#2563eb", "#d946ef", "#0891b2", "#a5a5a5")


def _ansi_strip(text: str) -> str:
    """HTML-escaped text without escape sequences (for one-line previews)."""
    return _esc(_ANSI.sub("", text)) if "\x1b" in text else _esc(text)


def _ansi_to_html(text: str) -> str:
    """HTML-escape ``text``, turning SGR colour codes into spans and dropping other escapes."""
    if "\x1b" not in text:
        return _esc(text)
    out: list[str] = []
    style: dict[str, str] = {}
    pos = 0
    opened = False
    for match in _ANSI.finditer(text):
        if match.start() > pos:
            out.append(_esc(text[pos : match.start()]))
        pos = match.end()
        if match.group(2) != "m":
            continue  # cursor movement, erase line, titles: not meaningful in a log
        style = _apply_sgr(style, match.group(1) or "0")
        if opened:
            out.append("</span>")
            opened = False
        if style:
            css = ";".join(f"{k}:{v}" for k, v in sorted(style.items()))
            out.append(f"<span style='{css}'>")
            opened = True
    out.append(_esc(text[pos:]))
    if opened:
        out.append("</span>")
    return "".join(out)


def _apply_sgr(style: dict[str, str], params: str) -> dict[str, str]:
    style = dict(style)
    codes = [int(c) if c.isdigit() else 0 for c in params.split(";")]
    i = 0
    while i < len(codes):
        code = codes[i]
        if code == 0:
            style.clear()
        elif code == 1:
            style["font-weight"] = "bold"
        elif code == 3:
            style["font-style"] = "italic"
        elif code == 4:
            style["text-decoration"] = "underline"
        elif code == 22:
            style.pop("font-weight", None)
        elif 30 <= code <= 37:
            style["color"] = _BASIC[code - 30]
        elif 90 <= code <= 97:
            style["color"] = _BRIGHT[code - 90]
        elif 40 <= code <= 47:
            style["background"] = _BASIC[code - 40]
        elif 100 <= code <= 107:
            style["background"] = _BRIGHT[code - 100]
        elif code == 39:
            style.pop("color", None)
        elif code == 49:
            style.pop("background", None)
        elif code in (38, 48) and i + 1 < len(codes):
            key = "color" if code == 38 else "background"
            if codes[i + 1] == 5 and i + 2 < len(codes):
                style[key] = _xterm_256(codes[i + 2])
                i += 2
            elif codes[i + 1] == 2 and i + 4 < len(codes):
                r, g, b = (min(255, c) for c in codes[i + 2 : i + 5])
                style[key] = f"#{r:02x}{g:02x}{b:02x}"
                i += 4
        i += 1
    return style


def _xterm_256(n: int) -> str:
    if n < 8:
        return _BASIC[n]
    if n < 16:
        return _BRIGHT[n - 8]
    if n < 232:
        n -= 16
        levels = (0, 95, 135, 175, 215, 255)
        return f"#{levels[n // 36]:02x}{levels[(n // 6) % 6]:02x}{levels[n % 6]:02x}"
    grey = 8 + 10 * (min(n, 255) - 232)
    return f"#{grey:02x}{grey:02x}{grey:02x}"


def _display(obj: Any, **kwargs: Any) -> None:
    from IPython.display import display

    display(obj, **kwargs)


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render), False in terminals and scripts."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def widgets_available() -> bool:
    """True when ipywidgets can be imported."""
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None


# A run still going after this long gets its live view; one over before shows only its summary.
LIVE_VIEW_AFTER_S = 0.2


class DeferredView:
    """Holds a view back until its run has gone on for ``LIVE_VIEW_AFTER_S``.

    Building the live widget costs milliseconds of comm messages, as much as a quick pool cell
    or launch itself. A run still going after ``LIVE_VIEW_AFTER_S`` gets the live view, with
    every event so far. One that was over before shows nothing when it was silent and
    successful, like a plain cell, and otherwise (output, logs, progress, a diagnosis, a
    failure) only the static summary: the same lines and outcome, without widgets.
    """

    def __init__(self, view: Any) -> None:
        self.view = view
        self._began = time.monotonic()
        self._pending: list[Event] = []
        self._worth_showing = False
        self._shown = False

    def handle(self, event: Event) -> None:
        if self._shown:
            self.view.handle(event)
            return
        self._pending.append(event)
        kind = event["kind"]
        if kind in ("stream", "log", "progress", "diagnosis", "metrics") or (
            kind == "run_ended" and not event["ok"]
        ):
            self._worth_showing = True
        if kind == "state" and event["state"] is RunState.DEBUGGING:
            self._show(live=True)  # a prompt waits: show the ranks' states with it

    def flush(self, force: bool = False) -> None:
        if not self._shown and time.monotonic() - self._began >= LIVE_VIEW_AFTER_S:
            self._show(live=True)
        if self._shown:
            self.view.flush(force)

    def close(self) -> None:
        if not self._shown and self._worth_showing:
            self._show(live=False)
        if self._shown:
            self.view.close()

    def _show(self, live: bool) -> None:
        self._shown = True
        if isinstance(self.view, LaunchView):
            self.view.live = live
        for event in self._pending:
            self.view.handle(event)
        self._pending.clear()


def make_view(display: str):
    """The view for ``display``: "auto", "widget", "text" or "none".

    ``"auto"`` is the widget inside a Jupyter kernel with ipywidgets installed, the text view
    elsewhere (terminals, scripts, IPython without a kernel).

    Raises
    ------
    LaunchError
        For any other value.
    """
    if display not in DISPLAY_MODES:
        from nblaunch.errors import LaunchError

        raise LaunchError(f"display={display!r} is not one of {', '.join(DISPLAY_MODES)}")
    if display == "none":
        return NullView()
    if display == "widget" or (display == "auto" and in_notebook_kernel() and widgets_available()):
        return LaunchView()
    return TextView()
