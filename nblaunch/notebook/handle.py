"""``RunHandle``: a run that does not hold its cell, and the way back to any run's view.

``notebook_launcher(..., block=False)`` (and ``%%distributed --bg``) returns a handle to a
background run, the engine on a thread of this kernel
(:mod:`nblaunch.engine.background.background_run`); ``detach=True`` one to a detached run, the
engine in a run host that outlives the kernel (:mod:`nblaunch.engine.detached.registry`). Either way
``.view()`` shows the live view in the current cell, with the history a view keeps, as often as
asked (after a page reload too); ``.result()`` waits for the values or raises the failing rank's own
exception; ``.stop()`` stops every rank.

``runs()`` lists this kernel's runs and the detached runs of this machine; ``attach()`` gives a
handle to a detached run from any kernel.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblaunch.engine.background.background_run import BackgroundRun, BackgroundTask, RunControl
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.detached import attached
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.launch_plan import LaunchPlan
from nblaunch.engine.processes import spares
from nblaunch.engine.run.run import Run
from nblaunch.events import EventSink, Lifecycle
from nblaunch.options import NodeOptions

# Handles of this kernel's background and detached runs, oldest first; past MAX_REMEMBERED the
# oldest ended ones are forgotten (each keeps its run's history for views).
_kernel_runs: list[RunHandle] = []
MAX_REMEMBERED = 100
# How often a wait looks up: an interrupt is seen within this (the run goes on).
_WAIT_STEP_S = 0.1
# How long stop() waits for the run to end (the ranks' grace period, then SIGKILL, and more).
STOP_WAIT_S = 30.0
# The view `.view()` last showed of each run still going, and the run it watches: a newer one
# replaces it (see RunHandle.view).
_live_views: dict[str, tuple[RunControl, EventSink]] = {}
REPLACED_NOTE = "A newer view of this run replaced this one; it stopped here."


class RunHandle:
    """A background or detached run: watch it, wait for it, stop it.

    Parameters
    ----------
    control
        The run (in a thread here, or in a run host).
    finish
        Turns the ranks' values into what ``result()`` returns (``%%distributed --bg``: the
        cell's result, binding its ``-o`` names).
    localize
        Turns a rank's exception into what ``result()`` raises (the cell's line numbers).
    """

    def __init__(
        self,
        control: RunControl,
        *,
        finish: Callable[[list[Any]], Any] | None = None,
        localize: Callable[[BaseException], BaseException] | None = None,
        detached: bool = False,
        views: dict[str, Any] | None = None,
    ) -> None:
        self._control = control
        self.views = views or {}  # choose_view's options (the text view's line prefix)
        self.finish = finish
        self.localize = localize
        self.detached = detached
        self.started_at = time.time()

    @property
    def id(self) -> str:
        """The run's id: its directory's name."""
        return self._control.run_id

    @property
    def run_dir(self) -> Path | None:
        """Where the rank logs, ``metrics.jsonl`` and (detached) the outcome are."""
        return self._control.run_dir

    @property
    def state(self) -> str:
        """``running``, ``done``, ``failed``, ``stopped``, or ``lost`` (a run host that died)."""
        return self._control.state

    def done(self) -> bool:
        """True once the run ended (whatever its outcome)."""
        return self._control.state != Lifecycle.RUNNING

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the run and return each rank's value (a cell's: its result).

        Raises
        ------
        Exception
            The failing rank's own exception, as a blocking launch raises it.
        RunStoppedError
            The run was stopped.
        TimeoutError
            ``timeout`` s passed first; the run goes on.
        KeyboardInterrupt
            The wait was interrupted; the run goes on.
        """
        __tracebackhide__ = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._control.wait(_WAIT_STEP_S):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"run {self.id} is still going after {timeout:g} s (it goes on; "
                    "result() again to wait more, stop() to stop it)"
                )
        try:
            values = self._control.values()
        except BaseException as exc:
            error = exc
        else:
            return self.finish(values) if self.finish else values
        # Raised outside the except clause, with its own cause and context (a "from None" would
        # drop the rank's chained exceptions, which a blocking launch shows).
        raise self.localize(error) if self.localize else error

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop every rank (what they wrote stays in the run directory); ``result()`` then
        raises ``RunStoppedError``. The kernel's interrupt button does not stop a run that does
        not hold its cell: this does, and so does the view's Stop button. Returns once the run
        has ended, so that ``state`` says how, or after ``timeout`` s (it may still be ending)."""
        self._control.stop()
        self._control.wait(timeout)

    def view(self, display: str = "auto") -> None:
        """Show the run's view in this cell: what it kept so far, then live until the run ends.

        A newer view of the same run replaces the one shown before: that one stops, and what it
        showed last stays as static HTML (its page may be gone; a kernel cannot tell). So a run
        viewed many times costs the kernel what one view costs."""
        from nblaunch.notebook.views import choose  # choose.make_view: the seam tests replace
        from nblaunch.notebook.views.widget import LaunchView

        shown = choose.choose_view(display, defer="never", **self.views)
        if isinstance(shown, LaunchView):
            shown.on_stop = self._control.stop  # the button's thread does not wait
        _retire_view(self.id)
        control = self._control
        control.watch(shown)
        if control.state == Lifecycle.RUNNING:
            _live_views[self.id] = (control, shown)

    def watch(self, sink: EventSink) -> None:
        """Give ``sink`` (any view, e.g. a ``RecordingView``) the run's events: what was kept so
        far, then every new one until the run ends."""
        self._control.watch(sink)

    def __repr__(self) -> str:
        where = "detached" if self.detached else "background"
        return f"<RunHandle {self.id} {where} {self.state}>"


def launch_in_background(
    plan: LaunchPlan,
    payload: bytes,
    display: str,
    *,
    detach: bool,
    function: str = "",
    views: dict[str, Any] | None = None,
    nodes: NodeOptions | None = None,
) -> RunHandle:
    """Start the run of ``plan`` without holding the cell; show its view here unless ``"none"``.
    With ``nodes``, a multi-node run (``plan`` is this node's)."""
    control: RunControl
    if detach:
        entry = detached.start_run_host(plan, payload, function, nodes)
        control = attached.AttachedRun(entry)
        # The header now, while this cell runs: the view is built in it.
        control.header = plan.run_info(time.time())
    elif nodes is not None:
        from nblaunch.cluster.run import in_background  # not at import: ~9 ms, rarely used

        control = in_background(plan, payload, nodes)  # type: ignore[arg-type]
    else:
        run = Run(plan, EventHub())
        control = BackgroundRun(
            run,
            payload,
            after=lambda: spares.fork_ahead(plan.world_size, plan.start_method, plan.device_type),
        )
    handle = RunHandle(control, detached=detach, views=views)
    if display != "none":
        handle.view(display)
    if isinstance(control, BackgroundTask):
        control.start()  # the ranks start here; the header reaches the view in this cell
    return remember(handle)


def _retire_view(run_id: str) -> None:
    """Stop the view ``.view()`` last showed of ``run_id``; forget views of ended runs."""
    for key, (control, _) in list(_live_views.items()):
        if control.state != Lifecycle.RUNNING:
            del _live_views[key]
    old = _live_views.pop(run_id, None)
    if old is None:
        return
    control, view = old
    control.unwatch(view)
    retire = getattr(view, "retire", None)
    if retire is not None:
        retire(REPLACED_NOTE)


def remember(handle: RunHandle) -> RunHandle:
    """List ``handle`` among this kernel's runs (``runs()``); returns it."""
    _kernel_runs.append(handle)
    ended = [h for h in _kernel_runs if h.done()]
    for old in ended[: max(0, len(_kernel_runs) - MAX_REMEMBERED)]:
        _kernel_runs.remove(old)
    return handle


class RunList(list):
    """``runs()``: a list of :class:`RunHandle` that shows itself as a table."""

    def __repr__(self) -> str:
        if not self:
            return "no runs (neither in this kernel nor detached on this machine)"
        rows = [f"{'id':<28} {'where':<10} {'state':<8} started"]
        for handle in self:
            started = datetime.datetime.fromtimestamp(handle.started_at).strftime("%H:%M:%S")
            where = "detached" if handle.detached else "here"
            rows.append(f"{handle.id:<28} {where:<10} {handle.state:<8} {started}")
        return "\n".join(rows)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def runs() -> RunList:
    """This kernel's background and detached runs, then the other detached runs of this machine
    (newest first); each is a :class:`RunHandle` (``.view()``, ``.result()``, ``.stop()``)."""
    # By when each started: a run attached later (an older detached one) is not the newest.
    found = RunList(sorted(_kernel_runs, key=lambda handle: handle.started_at, reverse=True))
    known = {handle.id for handle in found}
    for entry in detached.entries():
        if entry.kind == "run" and entry.run_id not in known:
            found.append(_DetachedEntry(entry))
    return found


def attach(run_id: str | None = None) -> RunHandle:
    """A handle to a detached run of this machine, from any kernel of the same user.

    Parameters
    ----------
    run_id
        The run's id (or the start of it); default: the newest run still going.

    Raises
    ------
    LaunchError
        No such run (the message lists the detached runs).
    """
    entry = detached.find(run_id, kind="run")
    for handle in list(_kernel_runs):
        if _same_run(handle, entry):
            if handle.state != Lifecycle.LOST:
                return handle  # one handle per run: runs() lists it once
            _kernel_runs.remove(handle)  # lost to this kernel (its host gone?): read it again
    handle = RunHandle(attached.AttachedRun(entry), detached=True)
    handle.started_at = entry.started_at
    return remember(handle)


def _same_run(handle: RunHandle, entry: detached.Entry) -> bool:
    """Whether ``handle`` shows the run of ``entry``: the same id, directory and host (a later
    run in the same directory, or another registry's, may have the same id)."""
    known = getattr(handle._control, "entry", None) if handle.detached else None
    return known is not None and (known.run_id, known.run_dir, known.pid) == (
        entry.run_id,
        entry.run_dir,
        entry.pid,
    )


class _DetachedEntry(RunHandle):
    """A detached run listed by ``runs()``: attached to only when it is used."""

    def __init__(self, entry: detached.Entry) -> None:
        self.entry = entry
        self.detached = True
        self.started_at = entry.started_at
        self.finish = self.localize = None
        self.views = {}
        self._attached: RunHandle | None = None

    @property
    def _control(self) -> RunControl:  # type: ignore[override]
        if self._attached is None:
            self._attached = attach(self.entry.run_id)
        return self._attached._control

    @property
    def id(self) -> str:
        return self.entry.run_id

    @property
    def run_dir(self) -> Path | None:
        return self.entry.run_dir

    @property
    def state(self) -> str:
        if self._attached is not None:
            return self._attached.state
        return self.entry.live_state


# --- %dist runs, wait, view ------------------------------------------------------------------


def _one(line: str, command: str) -> RunHandle:
    """The run a ``%dist`` command names (an id or its start), default the newest."""
    from IPython.core.error import UsageError

    wanted = line.strip()
    listed = runs()
    if not listed:
        raise UsageError(f"%dist {command}: no runs yet; start one with block=False or --bg")
    if not wanted:
        return listed[0]
    matches = [h for h in listed if h.id.startswith(wanted)]
    if len(matches) != 1:
        ids = ", ".join(h.id for h in listed[:10])
        raise UsageError(f"%dist {command} {wanted}: {len(matches)} runs match; runs: {ids}")
    return matches[0]


def dist_runs(line: str) -> RunList:
    """``%dist runs``: this kernel's runs and the detached runs of this machine."""
    return runs()


def dist_wait(line: str) -> Any:
    """``%dist wait [ID]``: wait for a run (default the newest) and show its result; an
    interrupt ends the wait, not the run."""
    __tracebackhide__ = True
    return _one(line, "wait").result()


def dist_view(line: str) -> None:
    """``%dist view [ID]``: show a run's view (default the newest) in this cell."""
    _one(line, "view").view()
