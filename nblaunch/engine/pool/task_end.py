"""How a pool's task ends: its ranks brought back, and what the pool does next.

:func:`settle_task` is the mechanics (interrupt the ranks still running, read what they said);
:func:`decide_task_end` is the decision, a pure function of what the ranks did: the pool is
ready for the next cell, broken (a rank or a node was lost: only a restart helps), or restarted
(a rank did not come back from an interrupt, not even once its peers issued the collective it
waited in, :mod:`nblaunch.engine.pool.release`: fresh ranks, their names gone, and the cell's
error says so first). The scripted engine tests (tests/test_engine.py) and tests/test_pool.py
check both.
"""

from __future__ import annotations

import contextlib
import enum
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nblaunch.engine.pool.release import Releaser
from nblaunch.engine.run.run import Run
from nblaunch.engine.verdict import Cause, RootCause, add_note, recreate_exception
from nblaunch.errors import PoolRestartedError, safe_str
from nblaunch.events import EventSink, RunState, diagnosis

# How long the ranks of an interrupted or failed task get to come back before the pool restarts.
INTERRUPT_WAIT_S = 3.0
# A task whose results all arrived: how long to wait for each rank's closing "finished" event.
FINISH_WAIT_S = 2.0
# Badges of a rank still at work.
_LIVE_STATES = (RunState.STARTING, RunState.RUNNING, RunState.DEBUGGING, RunState.STALLED)


class AfterTask(enum.Enum):
    """What the pool does once a task's ranks are back (or not)."""

    READY = "ready"  # the next cell can run on the same ranks
    BROKEN = "broken"  # a rank or node was lost: restart or stop
    RESTART = "restart"  # a rank did not come back: fresh ranks now


@dataclass(frozen=True)
class TaskEnd:
    """The pool's decision after a task, and what to tell the person."""

    after: AfterTask
    note: str = ""  # for the cell's error and the view; empty when all went to plan
    problem: str = ""  # why the pool is broken (``AfterTask.BROKEN``)


def decide_task_end(
    lost: list[RootCause],
    pending: list[int],
    where_stuck: str = "",
    describe_node: Callable[[int], str] = lambda rank: f"the node of rank {rank}",
    why: str = "",
) -> TaskEnd:
    """What the pool does after a task.

    Parameters
    ----------
    lost
        Ranks the pool lost: deaths, or a lost node (``Cause.NODE``); the first is named.
    pending
        Task ranks that did not come back (no ``finished``) after the interrupt.
    where_stuck
        Where the pending ranks were last seen, for the note (``" (rank 1 at ...)"``).
    describe_node
        ``"node 1 (host)"`` for a rank of a lost node.
    why
        Why the pending ranks could not be released from their collective, for the note.
    """
    if lost:
        first = lost[0]
        if first.cause is Cause.NODE:
            what, problem = describe_node(first.rank), first.message
            again = (
                "restart it (%dist restart, pool.restart()) once its node's join runs again, "
                "or with the nodes that remain (%dist restart --nodes N)"
            )
        else:
            what, problem = f"rank {first.rank}", f"rank {first.rank} {first.message}"
            again = "run %dist restart (or pool.restart()) for fresh ranks"
        note = f"The pool lost {what}: {again}; names from earlier cells are gone."
        return TaskEnd(AfterTask.BROKEN, note, problem)
    if pending:
        # First what the person lost, then why: this is the first line of the cell's error.
        note = (
            "The pool was restarted, so the names from earlier cells are gone: rank(s) "
            f"{', '.join(map(str, pending))} did not stop within {INTERRUPT_WAIT_S:g} s"
            f"{where_stuck}" + (f", and could not be released ({why})." if why else ".")
        )
        return TaskEnd(AfterTask.RESTART, note)
    return TaskEnd(AfterTask.READY)


def stopped_by_the_pool(failures: list[RootCause], signalled: set[int]) -> list[RootCause]:
    """The failures that were only the pool's own interrupt (a KeyboardInterrupt it sent)."""
    return [
        f
        for f in failures
        if f.cause is Cause.FAILURE
        and f.rank in signalled
        and f.exc_type == "builtins.KeyboardInterrupt"
    ]


def pending_ranks(run: Run) -> list[int]:
    """Task ranks that have not sent "finished" yet."""
    return [r for r in run.task_ranks if r not in run.outcome.finished]


def lost_ranks(run: Run) -> list[RootCause]:
    """Ranks the pool lost: dead processes, and the ranks of a lost node."""
    root = run.outcome.root
    lost_node = [root] if root is not None and root.cause is Cause.NODE else []
    return [*lost_node, *run.outcome.deaths()]


@dataclass
class TaskReport:
    """How a pool task ended, for the pool (what next) and the caller (values or the error)."""

    run: Run
    end: TaskEnd
    interrupted: bool
    stopped: list[RootCause]  # the failures that were only the pool's own interrupt
    ok: bool
    released: str = ""  # which ranks issued which collectives so that their peers could stop

    @property
    def raises(self) -> bool:
        """Whether :meth:`conclude` raises rather than returning the values."""
        outcome = self.run.outcome
        complete = len(outcome.results) == len(self.run.task_ranks)
        return not (
            outcome.root is None and not self.interrupted and (complete or not self.end.note)
        )

    @property
    def failed_rank(self) -> int | None:
        """The rank whose own exception the task raises (what ``%dist debug`` opens)."""
        outcome = self.run.outcome
        root = outcome.root or next(iter(outcome.failures), None)
        return root.rank if root is not None and root.cause is Cause.FAILURE else None

    def conclude(self) -> list[Any]:
        """Return the task's values, or raise its root cause with the pool's note attached."""
        run, note = self.run, self.end.note
        if not self.raises:
            if note:  # every value arrived, but a rank then did not come back
                warnings.warn(note, RuntimeWarning, stacklevel=3)
            return run.conclude()
        # A rank's own error or death seen during the interrupt comes before the interrupt.
        root = run.outcome.root or next(iter(run.outcome.failures), None)
        if root is not None:
            exc = run.exception_for(root)
        else:
            stopped = self.stopped
            exc = recreate_exception(stopped[0], run.plan.world_size) if stopped else None
            if not isinstance(exc, KeyboardInterrupt):
                exc = KeyboardInterrupt()
            ranks = ", ".join(str(f.rank) for f in stopped) or "none"
            ready = "" if note else "; the pool is ready for the next cell"
            add_note(exc, f"interrupted on rank(s) {ranks}{ready}")
        if self.released:
            add_note(exc, self.released)
        if self.end.after is AfterTask.RESTART:
            # The names are gone: the error says so before anything else (the cell's own
            # error is its cause, shown above it).
            restarted = PoolRestartedError(
                f"{note}\nThe cell's own error is above: {_headline(exc)}"
            )
            raise restarted from exc
        if note:
            add_note(exc, note)
        raise exc


def _headline(exc: BaseException) -> str:
    lines = safe_str(exc).splitlines()
    return type(exc).__name__ + (f": {lines[0]}" if lines else "")


def run_task(
    run: Run,
    payload: bytes,
    task_id: int,
    task_ranks: list[int],
    view: EventSink,
    *,
    timeout: float | None,
    hang_timeout: float | None,
    first: bool,
    describe_node: Callable[[int], str],
) -> TaskReport:
    """Run one task on a pool's engine and bring its ranks back (see the module docstring).

    ``first``: the pool's first task, whose header says what the start set up.
    """
    guard = TaskGuard()
    releaser = Releaser(task_id)
    monitors = [guard, releaser]
    run.begin_task(view, task_ranks, timeout=timeout, hang_timeout=hang_timeout, monitors=monitors)
    previous_handler = guard.install()
    try:
        interrupted = False
        try:
            run.announce(warnings=[], notes=None if first else [])
            for rank in task_ranks:
                run.set_state(rank, RunState.RUNNING)
            run.send_task(payload, task_id, task_ranks)
            run.watch()
        except KeyboardInterrupt:
            interrupted = True
        stopped = settle_task(run, guard, interrupted, releaser)
    finally:
        guard.uninstall(previous_handler)
    lost, pending = lost_ranks(run), pending_ranks(run)
    why = releaser.why(pending) if pending else ""
    end = decide_task_end(lost, pending, guard.where(pending), describe_node, why)
    # No rank's badge may still say it runs once the task is over (a pool that lost a rank
    # stops the others without a word from them: they read "RUNNING · stopped" before).
    if end.after is AfterTask.RESTART:
        why_stopped = "did not stop; the pool was restarted"
    elif end.after is AfterTask.BROKEN:
        why_stopped = "stopped: the " + end.note.split(":")[0].removeprefix("The ")
    else:
        why_stopped = "interrupted"
    for rank in run.task_ranks:
        still = run.states.get(rank) in _LIVE_STATES or (
            end.after is AfterTask.RESTART and rank in pending
        )
        if still and rank not in run.outcome.results:
            run.set_state(rank, RunState.STOPPED, why_stopped)
    ok = (
        run.outcome.root is None
        and not interrupted
        and not end.note
        and len(run.outcome.results) == len(run.task_ranks)
    )
    if end.note:
        broken = end.after is AfterTask.BROKEN
        run.publish(
            diagnosis(
                "the pool lost a rank" if broken else "the pool was restarted",
                end.note,
                "warning",
                lost[0].rank if broken else pending[0],
            )
        )
    run.publish(run.run_ended(ok))
    run.view.close()
    released = releaser.done if end.after is AfterTask.READY else ""
    return TaskReport(run, end, interrupted, stopped, ok, released)


def settle_task(
    run: Run, guard: TaskGuard, interrupted: bool, releaser: Releaser | None = None
) -> list[RootCause]:
    """Bring the task's ranks back to waiting for the next task, as far as they come.

    After an interrupt or a failure, ranks still running get SIGINT and ``INTERRUPT_WAIT_S`` to
    come back (a second press of the interrupt button stops the waiting); ranks waiting in a
    collective that ranks already back never issued are released by those (``releaser``), and
    waited for as long as that takes. What the ranks still
    said is read, so it shows under this cell. Returns the failures that were only the pool's
    own interrupt: they are taken out of the outcome and those ranks marked STOPPED.
    """
    outcome = run.outcome
    stop_others = interrupted or outcome.root is not None
    # The parent's interrupt reached every rank's task; after a failure only the others.
    signalled = set(run.task_ranks) if interrupted else set()
    if pending_ranks(run) and not lost_ranks(run):
        if stop_others:
            signalled.update(pending_ranks(run))
            run.interrupt(pending_ranks(run))
        deadline = run.now() + (INTERRUPT_WAIT_S if stop_others else FINISH_WAIT_S)
        while pending_ranks(run) and run.now() < deadline and guard.interrupts < 2:
            run.pump(0.05)
            if stop_others and releaser is not None and pending_ranks(run):
                deadline = max(deadline, releaser.step(run, pending_ranks(run)))
                if releaser.gave_up:
                    break
    assert run.relay is not None
    for event in run.relay.drain_ready():
        run.on_event(event)
    stopped = stopped_by_the_pool(outcome.failures, signalled)
    outcome.failures = [f for f in outcome.failures if f not in stopped]
    for failure in stopped:
        why = "interrupted" if interrupted else "stopped after another rank failed"
        run.set_state(failure.rank, RunState.STOPPED, why)
    return stopped


class TaskGuard:
    """A monitor for one pool task: takes the notebook's interrupt, and records heartbeats.

    While a task runs, SIGINT in the notebook only counts; the watch loop turns it into a
    ``KeyboardInterrupt`` at a safe point (``check``), never in the middle of reading a message
    from a rank, which would leave the pool's pipes unreadable.
    """

    def __init__(self) -> None:
        self.interrupts = 0
        self.last_heartbeat: dict[int, dict[str, Any]] = {}

    def install(self) -> Any:
        try:
            return signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: interrupts cannot reach us anyway
            return None

    def uninstall(self, previous: Any) -> None:
        if previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupts += 1

    def on_event(self, run: Any, event: dict[str, Any]) -> None:
        if event["kind"] == "heartbeat":
            self.last_heartbeat[event["rank"]] = event

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: Any) -> None:
        if self.interrupts:
            raise KeyboardInterrupt

    def where(self, ranks: list[int]) -> str:
        """Where stuck ranks were last seen, from their heartbeats, for the note."""
        places = []
        for rank in ranks:
            beat = self.last_heartbeat.get(rank)
            if beat and beat.get("where"):
                inside = f" in {beat['collective']}" if beat.get("collective") else ""
                places.append(f"rank {rank} at {beat['where']}{inside}")
        return f" ({'; '.join(places)})" if places else " (probably waiting in a collective)"
