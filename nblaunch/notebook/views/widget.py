"""``LaunchView``: the live view of a run in a notebook cell, built from ipywidgets.

It keeps a :class:`~nblaunch.notebook.views.model.RunModel`, renders it with ``render`` into
ipywidgets' core widgets (no JavaScript of its own) and stays calm under any amount of output:
``handle`` only feeds the model, and ``flush`` sends the parts that changed while keeping the
messages to the browser under ``max_rate`` a second. When the run ends it displays the static
summary (``summary``), so a saved notebook shows what happened even without widget state.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from nblaunch.events import Event
from nblaunch.notebook.views import render
from nblaunch.notebook.views.model import RunModel
from nblaunch.notebook.views.summary import summary_bundle
from nblaunch.options import view_lines_from_env

_shared: dict[str, Any] = {}
# Views of ended runs whose widgets stay live (their tabs and rank picker still work); past
# this the oldest are retired: static HTML of what they showed, widgets closed. Without a bound
# a kernel kept every view's widgets forever (13 each: 1,567 after 120 launches).
KEEP_ENDED = 20
_ended: collections.deque[LaunchView] = collections.deque()


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


class LaunchView:
    """The live view of a run in a notebook cell, built from ipywidgets.

    A header (ranks, device, start method, debug, run directory, elapsed time) with a Stop
    button; one status badge per rank with its last line and, once heartbeats arrive, the share
    of time it spends computing versus waiting in collectives; an error panel for diagnoses; a
    progress area for multi-attempt operations (out-of-memory retries); and the logs, in an
    "All ranks" tab (alike lines folded) and one tab per rank. Past ``render.GRID_AFTER``
    ranks, a grid of badges replaces the rows and a rank picker the rank tabs.

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
            max_lines = view_lines_from_env()
        if max_lines < 1 or max_rate <= 0 or max_line_chars < 1:
            raise ValueError("max_lines, max_rate and max_line_chars must be positive")
        self.max_lines = max_lines
        self.max_rate = max_rate
        self.max_line_chars = max_line_chars
        self.model = RunModel(max_lines)
        # What the view has sent (read by tests and benchmarks).
        self.renders = 0
        self.messages_sent = 0  # widget updates sent to the browser
        self.summary_shown = False
        self._summary_id: str | None = None  # display id of the summary, to update it in place
        self._summary_sent: dict[str, str] = {}
        self.stop_hooked = False  # the Stop button works while the run is busy
        self._rendered: set[str | int] = set()
        self._next_render = 0.0
        self._last_header = 0.0
        self._started_clock = time.monotonic()
        self._widgets: dict[str, Any] = {}
        self._logs: list[Any] = []  # "All ranks", then each rank's (or the picked rank's)
        self._picker: Any = None  # the rank picker, past GRID_AFTER ranks
        self.picked = 0  # the rank it shows (set from the shell-channel thread too)
        self._picked_shown: int | None = None
        self._shown: dict[int, str] = {}  # id(widget) -> value last sent
        self._running = False
        self._stop_lock = threading.Lock()
        self.stop_requested = False
        # What the Stop button does for a run that does not hold the cell (RunHandle.stop);
        # None: interrupt this process, which the blocking launch in the cell answers.
        self.on_stop: Callable[[], None] | None = None
        # False: build no widgets, show only the static summary at the end (a run that was
        # over before its live view would have appeared; see DeferredView).
        self.live = True
        self.retired = False  # see retire()
        self._display_id = f"nblaunch-view-{id(self):x}-{time.time_ns():x}"
        self._all: list[Any] = []  # every widget of this view, to close them (not shared ones)

    # --- EventSink -------------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Take one event; cheap for output lines (the model appends to bounded buffers)."""
        if self.retired:
            return
        self.model.handle(event)
        kind = event["kind"]
        if kind == "run_info":
            self._started_clock = time.monotonic() - max(0.0, time.time() - event["started_at"])
            self._running = True
            self._build()
        elif self.summary_shown and kind in ("diagnosis", "state", "progress"):
            self._after_close()

    def flush(self, force: bool = False) -> None:
        """Render what changed, keeping under ``max_rate`` browser messages a second."""
        now = time.monotonic()
        changed = self.model.changed
        if self._running and now - self._last_header >= 1.0:
            changed.add("head")  # the elapsed time
        if self._picker is not None and self.picked != self._picked_shown:
            changed.add(self.picked)  # picked on the shell-channel thread
        if not changed or not self._widgets or (not force and now < self._next_render):
            return
        sent = self._render()
        self._last_header = now if "head" in self._rendered else self._last_header
        # A render that sent k messages buys the next one k / max_rate seconds later.
        self._next_render = now + sent / self.max_rate

    def close(self) -> None:
        """The run is over: final render, retire the Stop button, show the static summary."""
        with self._stop_lock:
            self._running = False
        if self.retired:
            return
        if self._widgets:
            self.model.changed.update(("head", "ranks", "panel", "progress", "charts", "logs"))
            self.model.changed.update(self.model.rank_lines)
            self.flush(force=True)
            stop = self._widgets["stop"]
            stop.disabled = True
            stop.layout = _shared_models()["hidden"]
        elif self.live:
            return  # no run to show
        if self.model.ended is not None and not self.summary_shown:
            self.summary_shown = True
            self._summary_id = f"nblaunch-summary-{id(self):x}-{time.time_ns():x}"
            self._summary_sent = self.summary_bundle()
            _display(self._summary_sent, raw=True, display_id=self._summary_id)
        if self._widgets and self not in _ended:
            _ended.append(self)
            while len(_ended) > KEEP_ENDED:
                _ended.popleft().retire()

    def retire(self, note: str = "") -> None:
        """Stop for good: what the widgets showed last stays as static HTML in their place
        (under ``note``), the widgets are closed, and later events are ignored. For a view of
        an ended run past ``KEEP_ENDED``, or one a newer view of the same run replaced."""
        with self._stop_lock:
            self._running = False
        if self.retired:
            return
        self.retired = True
        self.live = False
        if not self._widgets:
            return
        w = self._widgets
        parts = [w["head"], w["ranks"], w["panel"], w["progress"], w["charts"], self._logs[0]]
        _display(
            _static(note, [self._shown.get(id(p), "") for p in parts]),
            raw=True,
            display_id=self._display_id,
            update=True,
        )
        for widget in self._all:
            widget.close()
        self._all, self._logs, self._picker, self._widgets = [], [], None, {}
        self._shown.clear()

    def summary_bundle(self) -> dict[str, str]:
        """The end-of-run summary as ``text/plain`` and ``text/html`` (see ``summary``)."""
        return summary_bundle(self.model)

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
        """Interrupt the run like the kernel's interrupt button: SIGINT to this process (or
        ``on_stop``, for a background or detached run).

        Safe from any thread; does nothing once the run is over or a stop was requested.
        Returns True when the stop was asked for.
        """
        with self._stop_lock:
            if not self._running or self.stop_requested:
                return False
            self.stop_requested = True
        if self.on_stop is not None:
            self.on_stop()
        else:
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

    # --- the rank picker -------------------------------------------------------------------------

    def _pick(self, rank: int) -> None:
        """Show ``rank``'s log under the picker, now when the run is over (else at the next
        flush)."""
        self.picked = rank
        if not self._running:
            self.flush(force=True)

    def _hook_picker(self, picker: Any) -> None:
        """Notice a pick on ipykernel's shell-channel thread while the run keeps the main thread
        busy, as the Stop button's clicks are (see ``_hook_stop``); the next flush shows it."""
        comm = getattr(picker, "comm", None)
        route = getattr(comm, "_reply_subshell_for", None)
        if route is None:
            return

        def route_and_watch(data: Any, default: Any) -> Any:
            state = data.get("state") if isinstance(data, dict) else None
            index = state.get("index") if isinstance(state, dict) else None
            if isinstance(index, int) and 0 <= index < len(picker.options):
                self.picked = index  # the options are the ranks in order
            return route(data, default)

        comm._reply_subshell_for = route_and_watch

    # --- widgets ---------------------------------------------------------------------------------

    def _build(self) -> None:
        """Create the widgets once the run's size is known, and show them in this cell."""
        import ipywidgets as widgets

        if self._widgets or not self.live:
            return
        assert self.model.info is not None
        world = self.model.info["world_size"]
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
        if self.on_stop is not None:
            stop.tooltip = "Stop every rank of this run (the interrupt button does not)"
        elif not self.stop_hooked:
            stop.tooltip = "Takes effect only between cells here: use the notebook's interrupt"
        ranks = html()
        panel = html(layout="hidden")
        progress = html(layout="hidden")
        charts = html(layout="hidden")
        if world > render.GRID_AFTER:  # one tab per rank stops working: a picker
            self._logs = [html(), html()]
            self._picker = widgets.Dropdown(
                options=[(f"rank {r}", r) for r in range(world)], value=0, description="Rank"
            )
            self._picker.observe(lambda change: self._pick(change["new"]), names="value")
            self._hook_picker(self._picker)
            pages = [self._logs[0], widgets.VBox([self._picker, self._logs[1]])]
            titles = ["All ranks", "One rank"]
        else:
            self._logs = pages = [html() for _ in range(world + 1)]
            titles = ["All ranks", *(f"rank {r}" for r in range(world))]
        tabs = widgets.Tab(children=pages, titles=titles, layout=shared["plain"])
        top = widgets.HBox([head, stop], layout=shared["row"])
        root = widgets.VBox(
            [html(render.CSS), top, ranks, panel, progress, charts, tabs], layout=shared["plain"]
        )
        root.add_class("nbl-root")
        self._all = [root, top, head, stop, ranks, panel, progress, charts, tabs, *pages]
        self._all += [*root.children[:1], *self._logs[1:]]
        if self._picker is not None:
            self._all.append(self._picker)
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
        self.model.expect_ranks()
        self.model.changed.update(("head", "ranks", "logs"))
        _display(root, display_id=self._display_id)
        self.flush(force=True)

    def _render(self) -> int:
        """Push what changed to the widgets; return how many messages that sent."""
        model = self.model
        dirty, model.changed = model.changed, set()
        if any(isinstance(part, int) for part in dirty):  # new lines: the log and last lines
            dirty.update(("logs", "ranks"))
        self._rendered = dirty
        self.renders += 1
        sent = 0
        w = self._widgets
        if "head" in dirty:
            elapsed_s = time.monotonic() - self._started_clock
            sent += self._set(w["head"], render.head_html(model, elapsed_s))
        if "ranks" in dirty:
            sent += self._set(w["ranks"], render.ranks_html(model))
        if "panel" in dirty:
            sent += self._show(w["panel"], render.panel_html(model))
        if "progress" in dirty:
            sent += self._show(w["progress"], render.progress_html(model))
        if "charts" in dirty:
            sent += self._show(w["charts"], render.charts_html(model))
        if "logs" in dirty:
            sent += self._set(self._logs[0], render.log_html(model, None, self.max_line_chars))
        if self._picker is None:
            for rank, log in enumerate(self._logs[1:]):
                if rank in dirty:
                    sent += self._set(log, render.log_html(model, rank, self.max_line_chars))
        elif self.picked in dirty or self.picked != self._picked_shown:
            self._picked_shown = picked = self.picked
            sent += self._set(self._logs[1], render.log_html(model, picked, self.max_line_chars))
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


def _static(note: str, shown: list[str]) -> dict[str, str]:
    """A retired view's place: what its widgets showed last, as HTML, under ``note``."""
    html = render.CSS + (f"<div><i>{note}</i></div>" if note else "") + "".join(shown)
    plain = note or "(the run's live view, closed; its summary and run directory remain)"
    return {"text/html": f'<div class="nbl-root">{html}</div>', "text/plain": plain}


def _display(obj: Any, **kwargs: Any) -> None:
    from IPython.display import display

    display(obj, **kwargs)
