"""A run that goes on while the notebook does other things: the engine on a thread of its own.

``notebook_launcher(..., block=False)`` starts the ranks in the cell (so a bad start is the
cell's error), then hands the :class:`~nblaunch.engine.run.run.Run` to a thread and returns. The run
writes to an :class:`~nblaunch.engine.background.event_hub.EventHub`, so any number of views, in any
cell, can watch it, late ones included. A detached run (:mod:`nblaunch.engine.detached.registry`)
offers the same :class:`RunControl` from another process.

The thread is a daemon, so that a kernel can always exit; in its place Python's exit (an
``atexit`` hook) finishes every background run still going: in a script it waits for the run to
end, so that every line and the run's end are shown (Ctrl-C stops it), and in a kernel it stops
the run; either way it says so on stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nblaunch import tracebacks
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.run.run import Run
from nblaunch.errors import RunStoppedError
from nblaunch.events import EventSink, Lifecycle

# What ``RunControl.state`` says.
# What Python's exit does with a background run still going: wait for it, or stop it.
WAIT, STOP = "wait", "stop"
# How long Python's exit waits for a stopped run to end (the ranks' grace period and more).
STOPPED_JOIN_S = 30.0


class RunControl(Protocol):
    """What the notebook can do with a run that does not hold its cell."""

    hub: EventHub  # the run's events (and, in this process, its history for a late view)
    run_id: str
    run_dir: Path | None

    @property
    def state(self) -> Lifecycle:
        """``running``, ``done``, ``failed``, ``stopped`` (or ``lost``: its host vanished)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the run to end; True when it has."""

    def stop(self) -> None:
        """Stop every rank, as the interrupt button stops a blocking launch."""

    def watch(self, view: EventSink) -> None:
        """Give ``view`` what the run kept so far, then every event until it ends."""

    def unwatch(self, view: EventSink) -> None:
        """Give ``view`` no more events (a newer view replaced it)."""

    def values(self) -> list[Any]:
        """The values by rank, or raise what a blocking launch would have raised."""


def state_of(error: BaseException | None) -> Lifecycle:
    """The state of a run that ended with ``error`` (None: every rank returned)."""
    if error is None:
        return Lifecycle.DONE
    return Lifecycle.STOPPED if isinstance(error, RunStoppedError) else Lifecycle.FAILED


def stopped_error(run_dir: Path | None) -> RunStoppedError:
    where = f"; what the ranks wrote is in {run_dir}" if run_dir else ""
    return RunStoppedError(f"the run was stopped before every rank returned{where}")


class BackgroundTask:
    """Work that goes on in a thread of this process, seen through an :class:`EventHub`.

    Parameters
    ----------
    hub
        Where the work's events go (the run's view).
    run_id, run_dir
        What the handle says it is.
    work
        Returns the values by rank or raises as a blocking call would; a ``KeyboardInterrupt``
        from it (after ``stop``) means the work was stopped.
    stop
        Asks the work to stop, from any thread.
    after
        Called on the thread once the work ended (e.g. have spare ranks ready).
    at_exit
        What Python's exit does while the work goes on: ``"wait"`` for it, or ``"stop"`` it;
        default: stop in a Jupyter kernel, wait elsewhere (a script); see the module's doc.
    """

    def __init__(
        self,
        hub: EventHub,
        run_id: str,
        run_dir: Path | None,
        work: Callable[[], list[Any]],
        stop: Callable[[], None],
        after: Callable[[], None] | None = None,
        at_exit: str | None = None,
    ) -> None:
        self.hub = hub
        self.at_exit = at_exit  # what Python's exit does if the work goes on
        self.run_id = run_id
        self.run_dir = run_dir
        self._work = work
        self._stop = stop
        self._after = after
        self._done = threading.Event()
        self._values: list[Any] = []
        self._error: BaseException | None = None
        # The error's own traceback (the ranks' frames): each raise starts from it again.
        self._error_tb: types.TracebackType | None = None
        self._thread: threading.Thread | None = None
        self._exiting = False

    def start(self) -> None:
        """Go on in a thread, in a copy of the caller's context: ipykernel sends what the
        thread prints or displays to the cell that started it."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._main,), name=f"nblaunch-{self.run_id}", daemon=True
        )
        _going_on(self)
        self._thread.start()

    def finish_at_exit(self) -> None:
        """Python exits: wait for the work to end (``at_exit`` WAIT; Ctrl-C stops it) or stop
        it (STOP), and say so. The work's thread shows the run's end before it is done (its
        ``_done``, not ``Thread.join``, is waited on: a join that Ctrl-C broke may later say a
        living thread has ended)."""
        if self._thread is None:
            return
        self._exiting = True  # nothing to get ready for (spare ranks) after the work
        if self._done.is_set():
            return
        if (self.at_exit or (STOP if _in_kernel() else WAIT)) == WAIT:
            _say(
                f"nblaunch: waiting for background run {self.run_id} to end before Python "
                "exits (Ctrl-C stops it; h.result() in the script waits without this note)"
            )
            try:
                while not self._done.wait(0.5):  # a timed wait: Ctrl-C is noticed at once
                    pass
                return
            except KeyboardInterrupt:
                pass
        _say(f"nblaunch: Python exits: stopping background run {self.run_id}")
        self.stop()
        self._done.wait(STOPPED_JOIN_S)
        where = f"; what the ranks wrote is in {self.run_dir}" if self.run_dir else ""
        _say(f"nblaunch: background run {self.run_id} {self.state}{where}")

    def _main(self) -> None:
        try:
            self._values = self._work()
        except KeyboardInterrupt:
            self._error = stopped_error(self.run_dir)
        except BaseException as exc:  # the work's own outcome, given to whoever asks
            self._error = exc
            self._error_tb = tracebacks.without_launcher_frames(exc.__traceback__)
        finally:
            # Before the end is told: whoever waits on the result finds the spares asked for.
            try:
                if self._after is not None and not self._exiting:
                    self._after()
            finally:
                self._done.set()
                _going.discard(self)

    @property
    def state(self) -> Lifecycle:
        return state_of(self._error) if self._done.is_set() else Lifecycle.RUNNING

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stop(self) -> None:
        if not self._done.is_set():
            self._stop()

    def watch(self, view: EventSink) -> None:
        self.hub.watch(view)

    def unwatch(self, view: EventSink) -> None:
        self.hub.unwatch(view)

    def values(self) -> list[Any]:
        __tracebackhide__ = True
        if not self._done.is_set():
            raise RuntimeError("the run has not ended: wait() first")
        if self._error is not None:
            # Raising adds the caller's frames to the traceback: start from the ranks' again.
            raise self._error.with_traceback(self._error_tb)
        return self._values


# The background work of this process still going, finished by Python's exit.
_going: set[BackgroundTask] = set()
_hooked = False


def _going_on(task: BackgroundTask) -> None:
    """``task`` starts: have Python's exit finish it (see the module's doc)."""
    global _hooked
    _going.add(task)
    if not _hooked:
        atexit.register(_finish_all)
        _hooked = True


def _finish_all() -> None:
    for task in list(_going):
        task.finish_at_exit()


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (as ``views.choose.in_notebook_kernel``, which the engine
    may not import)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr already closed
        print(text, file=sys.stderr, flush=True)


class BackgroundRun(BackgroundTask):
    """A one-shot :class:`Run` going on in a thread of this process.

    Parameters
    ----------
    run
        A run whose view is an :class:`EventHub`.
    payload
        What each rank runs.
    after
        Called on the run's thread once it ended.
    at_exit
        What Python's exit does while the run goes on: ``"wait"`` or ``"stop"`` (default:
        stop in a Jupyter kernel, wait elsewhere).
    """

    def __init__(
        self,
        run: Run,
        payload: bytes,
        after: Callable[[], None] | None = None,
        at_exit: str | None = None,
    ) -> None:
        if not isinstance(run.view, EventHub):
            raise TypeError("a background run writes to an EventHub")
        self.run = run
        super().__init__(
            run.view,
            run.plan.run_id,
            run.plan.run_dir,
            lambda: run.execute(payload, started=True),
            run.request_stop,
            after,
            at_exit,
        )

    def start(self) -> None:
        """Start the ranks here (a failure to start raises in the caller), then go on in a
        thread."""
        try:
            self.run.start()
        except BaseException:
            self.run.finish()
            raise
        super().start()
