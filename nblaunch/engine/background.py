"""A run that goes on while the notebook does other things: the engine on a thread of its own.

``notebook_launcher(..., block=False)`` starts the ranks in the cell (so a bad start is the
cell's error), then hands the :class:`~nblaunch.engine.run.Run` to a thread and returns. The run
writes to an :class:`~nblaunch.engine.history.EventHub`, so any number of views, in any cell,
can watch it, late ones included. A detached run (:mod:`nblaunch.engine.detached`) offers the
same :class:`RunControl` from another process.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nblaunch.engine.history import EventHub
from nblaunch.engine.run import Run
from nblaunch.errors import RunStoppedError
from nblaunch.events import EventSink

# What ``RunControl.state`` says.
RUNNING, DONE, FAILED, STOPPED, LOST = "running", "done", "failed", "stopped", "lost"


class RunControl(Protocol):
    """What the notebook can do with a run that does not hold its cell."""

    hub: EventHub  # the run's events (and, in this process, its history for a late view)
    run_id: str
    run_dir: Path | None

    @property
    def state(self) -> str:
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


def state_of(error: BaseException | None) -> str:
    """The state of a run that ended with ``error`` (None: every rank returned)."""
    if error is None:
        return DONE
    return STOPPED if isinstance(error, RunStoppedError) else FAILED


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
    """

    def __init__(
        self,
        hub: EventHub,
        run_id: str,
        run_dir: Path | None,
        work: Callable[[], list[Any]],
        stop: Callable[[], None],
        after: Callable[[], None] | None = None,
    ) -> None:
        self.hub = hub
        self.run_id = run_id
        self.run_dir = run_dir
        self._work = work
        self._stop = stop
        self._after = after
        self._done = threading.Event()
        self._values: list[Any] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Go on in a thread, in a copy of the caller's context: ipykernel sends what the
        thread prints or displays to the cell that started it."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._main,), name=f"nblaunch-{self.run_id}", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        try:
            self._values = self._work()
        except KeyboardInterrupt:
            self._error = stopped_error(self.run_dir)
        except BaseException as exc:  # the work's own outcome, given to whoever asks
            self._error = exc
        finally:
            self._done.set()
            if self._after is not None:
                self._after()

    @property
    def state(self) -> str:
        return state_of(self._error) if self._done.is_set() else RUNNING

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
            raise self._error
        return self._values


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
    """

    def __init__(self, run: Run, payload: bytes, after: Callable[[], None] | None = None) -> None:
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
