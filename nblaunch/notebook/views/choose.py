"""Which view a front end shows: ``choose_view``, and the deferral that spares quick runs.

Every front end (``notebook_launcher``, the pool, multi-node launches) asks ``choose_view`` for
its view; ``make_view`` is the seam tests and benchmarks replace to see or clock every view.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

from nblaunch.events import Event, EventSink, NullView, RunState
from nblaunch.notebook.views.text import TextView
from nblaunch.notebook.views.widget import LaunchView
from nblaunch.options import DISPLAY_MODES

# A run still going after this long gets its live view; one over before shows only its summary.
LIVE_VIEW_AFTER_S = 0.2


def choose_view(
    display: str,
    *,
    defer: Literal["widget", "always", "never"] = "widget",
    line_prefix: str | None = None,
    ranks_per_node: int | None = None,
) -> EventSink:
    """The view a front end shows for ``display``: "auto", "widget", "text" or "none".

    Parameters
    ----------
    display
        ``"auto"`` is the widget inside a Jupyter kernel with ipywidgets installed, the text
        view elsewhere (terminals, scripts, IPython without a kernel).
    defer
        Which views wait for ``LIVE_VIEW_AFTER_S`` before showing (see :class:`DeferredView`):
        ``"widget"`` the live widget only (``notebook_launcher``: a launch over in a moment
        gets its summary alone); ``"always"`` every view but ``"none"`` (a pool task: a quick,
        silent cell shows nothing, in text too); ``"never"`` none (multi-node launches).
    line_prefix, ranks_per_node
        The text view's line prefix (a ``log_line_prefix_template``; default ``[rank N]``), and
        the ranks of each node, for its ``${local_rank}``. The widget shows ranks its own way.

    Raises
    ------
    LaunchError
        ``display`` is not one of the modes, or ``line_prefix`` cannot be filled in.
    ValueError
        ``defer`` is not one of its three values.
    """
    if defer not in ("widget", "always", "never"):
        raise ValueError(f"defer={defer!r} is not one of 'widget', 'always', 'never'")
    view = make_view(display)
    if isinstance(view, TextView) and line_prefix is not None:
        view = TextView(line_prefix=line_prefix, ranks_per_node=ranks_per_node)
    if isinstance(view, NullView) or defer == "never":
        return view
    if defer == "always" or isinstance(view, LaunchView):
        return DeferredView(view)
    return view


def make_view(display: str) -> EventSink:
    """The view for ``display``, as it shows from the first event (``choose_view`` defers it).

    Raises
    ------
    LaunchError
        For a value not in ``DISPLAY_MODES``.
    """
    if display not in DISPLAY_MODES:
        from nblaunch.errors import LaunchError

        raise LaunchError(f"display={display!r} is not one of {', '.join(DISPLAY_MODES)}")
    if display == "none":
        return NullView()
    if display == "widget" or (display == "auto" and in_notebook_kernel() and widgets_available()):
        return LaunchView()
    return TextView()


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


class DeferredView:
    """Holds a view back until its run has gone on for ``LIVE_VIEW_AFTER_S``.

    Building the live widget costs milliseconds of comm messages, as much as a quick pool cell
    or launch itself. A run still going after ``LIVE_VIEW_AFTER_S`` gets the live view, with
    every event so far. One that was over before shows nothing when it was silent and
    successful, like a plain cell, and otherwise (output, logs, progress, a diagnosis, a
    failure) only the static summary: the same lines and outcome, without widgets.
    """

    def __init__(self, view: EventSink) -> None:
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
