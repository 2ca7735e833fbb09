"""The run engine: start the ranks, relay what they say, find the root cause, stop, report.

:class:`Run` starts the ranks through its rank backend (:mod:`nblaunch.engine.backend`: real
processes, or a scripted stand-in in the tests), sends each its setup and task, pumps the relay,
lets the monitors (hang watchdog, out-of-memory restarts) watch every event, settles on a root
cause (the first *primary* failure, never a rank that only saw its peer die) and asks
:mod:`nblaunch.engine.verdict` what the caller gets. Every judgement reads the run's clock
(:mod:`nblaunch.engine.clock`). The one-shot launch, the persistent pool and the multi-node head
all drive it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from nblaunch.engine import restarts, shutdown, verdict
from nblaunch.engine.backend import BackendFactory, ProcessBackend
from nblaunch.engine.clock import REAL_CLOCK, Clock, Pauses
from nblaunch.engine.features import parent_monitors
from nblaunch.engine.monitor import Monitor
from nblaunch.engine.plan import LaunchPlan
from nblaunch.engine.relay import Relay
from nblaunch.engine.restarts import Attempts
from nblaunch.engine.verdict import Cause, Outcome, RootCause
from nblaunch.errors import LaunchError
from nblaunch.events import OOM_CAUGHT, STOP, Event, EventSink, NullView, RunState, task_message

# Whether this process started ranks already: the first start waits for the ranks' process
# server (the forkserver) to import torch, which it began when nblaunch was imported.
_started_before = False
# How often the view is drawn while the ranks start (the engine's loop does not run yet).
STARTING_RENDER_S = 0.25


def starting_words(start_method: str) -> str:
    """What a rank's badge says while its process starts."""
    if start_method == "forkserver" and not _started_before:
        return "starting: the first launch waits for the ranks' process server to import torch"
    return "starting its process"


def shown_while(view: EventSink, start: Callable[[], None]) -> None:
    """Call ``start`` (the ranks' processes) while another thread draws ``view`` every
    ``STARTING_RENDER_S``: the cell shows the run and what it waits for at once, not a blank
    cell for the seconds the first launch of a kernel waits for torch to be imported.

    The thread runs in a copy of the caller's context, as a background run's does (ipykernel
    routes its output by a context variable to the cell that launched).
    """
    global _started_before
    done = threading.Event()
    context = contextvars.copy_context()

    def draw() -> None:
        while not done.wait(STARTING_RENDER_S):
            with contextlib.suppress(Exception):
                context.run(view.flush, True)

    thread = threading.Thread(target=draw, name="nblaunch-starting", daemon=True)
    thread.start()
    try:
        start()
        _started_before = True
    finally:
        done.set()
        thread.join()


# --- running -------------------------------------------------------------------------------------


class Run:
    """One launch: start the ranks, watch them, stop them, report.

    Parameters
    ----------
    plan
        The validated launch plan.
    view
        Where events go (widget, text, none).
    backend
        Makes the ranks (``backend(world_size, start_method)``); real processes by default.
    clock
        The time every judgement reads (hang, grace periods, ``timeout=``); real by default.
    """

    # Whether a monitor may have every rank stopped and started again (a batch-size restart):
    # only ranks this machine started can be; otherwise the request's own exception is raised.
    restarts_ranks = True

    def __init__(
        self,
        plan: LaunchPlan,
        view: EventSink,
        backend: BackendFactory = ProcessBackend,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        self.plan = plan
        self.view = view
        self.make_backend = backend
        self.clock = clock
        self.backend = backend(plan.world_size, plan.start_method)
        self.relay: Relay | None = None
        self.outcome = Outcome()
        self.started_at = time.time()
        self.states: dict[int, RunState] = {}
        self.monitors = parent_monitors(plan)
        self.task_ranks: list[int] = list(range(plan.world_size))  # the ranks running a task
        self.announced = False  # the run's header was shown
        self.pauses = Pauses(clock)  # the clocks stand still while a rank waits in the debugger
        self._stop = threading.Event()  # request_stop: another thread asks this run to stop
        self.attempts = Attempts(plan.max_restarts)  # restarts after a failure (max_restarts=)

    def execute(self, payload: bytes, *, started: bool = False) -> list[Any]:
        """Run the payload on every rank and return the results, or raise the root cause.

        ``started``: :meth:`start` was called already (a background run starts its ranks in the
        cell, then goes on in a thread of its own).
        """
        __tracebackhide__ = True
        interrupted = False
        try:
            if not started:
                self.start()
            self.send_task(payload)
            self.watch()
            while True:
                if self._restart_requested():  # e.g. a peer's out-of-memory left ranks blocked
                    self._restart(payload)
                elif self.restarts_ranks and self.attempts.due(self.outcome.root):
                    restarts.restart_after_failure(self, payload)
                else:
                    break
                self.watch()
        except KeyboardInterrupt:
            interrupted = True
            self.stop_on_interrupt()
        finally:
            self.finish()
        if interrupted:
            raise KeyboardInterrupt
        return self.conclude()

    def start(self) -> None:
        """Start this machine's ranks (each gets its set-up as it starts), open the relay and
        announce the run (unless a front end did already)."""
        if not self.announced:
            self.announce()
        for rank in range(self.plan.world_size):
            self.set_state(rank, RunState.STARTING, starting_words(self.plan.start_method))
        shown_while(self.view, self.start_processes)  # the first one waits for torch's import
        self.relay = Relay(self.backend.ranks, self.view, self.plan.run_dir, self.clock)

    def start_processes(self) -> None:
        # GPU ranks wait for an earlier run's ranks to be gone: their device memory comes first.
        wait = self.plan.device_type != "cpu"
        self.backend.start(setup=self.plan.setup_message, wait_for_previous=wait)

    def announce(self, warnings: list[str] | None = None, notes: list[str] | None = None) -> None:
        """Publish the run's header (``RunInfo``); a pool sends one per task, to each new view."""
        self.announced = True
        self.publish(self.plan.run_info(self.started_at, warnings, notes))

    def await_started(self, limit_s: float) -> None:
        """Pump until every rank joined the process group and said ``started``.

        Raises
        ------
        Exception
            The rank's own exception when one could not start (the root cause).
        LaunchError
            Not every rank started within ``limit_s`` seconds.
        """
        deadline = self.now() + limit_s
        ranks = range(self.plan.world_size)
        while not all(self.states.get(r) is RunState.RUNNING for r in ranks):
            self.pump(self.plan.monitor_interval)
            root = verdict.settle(self.outcome, self.task_ranks, self.now())
            if root is not None:
                raise self.exception_for(root)
            if self.now() > deadline:
                started = [r for r in ranks if self.states.get(r) is RunState.RUNNING]
                raise LaunchError(
                    f"the ranks did not start within {limit_s:g} s (started: "
                    f"{started or 'none'}); see the logs in {self.plan.run_dir}"
                )

    def begin_task(
        self,
        view: EventSink,
        ranks: list[int],
        *,
        timeout: float | None,
        hang_timeout: float | None,
        monitors: list[Monitor],
    ) -> None:
        """Make the run ready for another task on its ranks (a persistent pool's next cell): a
        new view, outcome, states and fresh monitors (``monitors`` first, then the features').

        What the ranks wrote since the last task (a background thread) belongs to no task: it
        goes to their log files only, never under the wrong cell.
        """
        assert self.relay is not None
        self.relay.sink = NullView()
        self.relay.drain_ready()
        self.relay.in_order.start_task(ranks)  # in-order records wait for these ranks only
        self.view = self.relay.sink = view
        self.plan = dataclasses.replace(self.plan, timeout=timeout, hang_timeout=hang_timeout)
        self.outcome = Outcome()
        self.states = {}
        self.started_at = time.time()
        self.monitors = [*monitors, *parent_monitors(self.plan)]
        self.pauses.reset()

    def hang_up(self, limit_s: float) -> None:
        """Ask every rank to stop after its task and read what they say until each closed its
        pipes or exited (at most ``limit_s``); those still exiting are left to finish alone."""
        for rank in self.backend.ranks:
            self.backend.send(rank, {"kind": STOP})
        shutdown.relay_until_hung_up(self, limit_s)

    def send_task(self, payload: bytes, task_id: int = 0, ranks: list[int] | None = None) -> None:
        """Send one task to ``ranks`` (default: all); the run then waits for those ranks only."""
        self.task_ranks = list(range(self.plan.world_size)) if ranks is None else list(ranks)
        message = task_message(payload, task_id, self.task_ranks, self.plan.world_size)
        for rank in self.backend.ranks:  # this machine's (a multi-node run has others)
            if rank.rank in self.task_ranks:
                self.backend.send(rank, message)

    def request_stop(self) -> None:
        """Stop this run as an interrupt would, from any thread: the run's own thread raises
        ``KeyboardInterrupt`` at its next turn (:meth:`pump`) and stops every rank."""
        self._stop.set()

    def interrupt(self, ranks: list[int]) -> None:
        """A KeyboardInterrupt in the task of each of ``ranks`` (SIGINT)."""
        self.backend.interrupt(ranks)

    def release_nodes(self, rejoin: bool) -> None:
        """Let go of other nodes (a multi-node pool's); a single-node run has none."""

    def publish(self, event: Event) -> None:
        if self.relay is not None:
            self.relay.publish(event)
        else:
            self.view.handle(event)

    def set_state(self, rank: int, state: RunState, detail: str = "") -> None:
        if self.states.get(rank) == state and not detail:
            return
        self.states[rank] = state
        self.publish({"kind": "state", "rank": rank, "state": state, "detail": detail})

    # --- watching --------------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """One turn of the engine: wait up to ``timeout`` s for output or events, act on every
        event, and record a rank whose process ended without saying so as a death."""
        assert self.relay is not None
        if self._stop.is_set():  # once, as one press of the interrupt button
            self._stop.clear()
            raise KeyboardInterrupt
        for event in self.relay.poll(timeout):
            self.on_event(event)
        for rank in self.backend.reap():
            for event in self.relay.drain_events(rank.rank):
                self.on_event(event)
            if rank.rank not in self.outcome.finished:
                self.on_death(rank.rank, rank.exitcode)
            elif rank.rank in self.outcome.results and not self._all_returned():
                # A rank waits for STOP after its value: an exit now is a crash its peers,
                # still running, may wait for in a collective that can never complete.
                self.on_death(rank.rank, rank.exitcode, after_return=True)

    def _all_returned(self) -> bool:
        return len(self.outcome.results) == len(self.task_ranks)

    def watch(self) -> None:
        """Pump until every rank returned, a root cause is known, or the timeout runs out."""
        outcome = self.outcome
        deadline = None if self.plan.timeout is None else self.now() + self.plan.timeout
        while True:
            self.pump(self.plan.monitor_interval)  # output and events wake it at once
            # Monitors first: what the ranks sent before their values may show that the run
            # went wrong although every rank returned (collectives that disagreed).
            for monitor in self.monitors if self.pauses.judging() else []:
                root = monitor.check(self)
                if root is not None:
                    outcome.root = root
                    return
            if self._all_returned():
                return
            root = verdict.settle(outcome, self.task_ranks, self.now())
            if root is not None:
                outcome.root = root
                return
            if deadline is not None and self.now() - self.pauses.paused_s() > deadline:
                outcome.root = verdict.timed_out(outcome, self.plan.world_size, self.plan.timeout)
                return

    # --- for features: pauses, a rank's pipe, the view ------------------------------------------

    def pause(self, key: object) -> None:
        """Stop the clocks while ``key`` (a rank in the debugger) waits for the person."""
        self.pauses.pause(key)

    def resume(self, key: object) -> None:
        self.pauses.resume(key)

    def now(self) -> float:
        """The run's clock (monotonic seconds)."""
        return self.clock.now()

    def seconds_since_output(self, rank: int) -> float | None:
        """How long ago ``rank`` last wrote anything; None before its first output."""
        last = self.relay.last_output.get(rank) if self.relay is not None else None
        return None if last is None else self.now() - last

    def runs_here(self, rank: int) -> bool:
        """True when ``rank`` is a process of this machine (not another node's)."""
        return any(process.rank == rank for process in self.backend.ranks)

    def send_to_rank(self, rank: int, message: dict[str, Any]) -> bool:
        """Send a message down a rank's pipe; False when it is not here or has gone."""
        process = next((p for p in self.backend.ranks if p.rank == rank), None)
        return process is not None and self.backend.send(process, message)

    def show_now(self) -> None:
        """Render the view at once (before something blocks this thread)."""
        self.view.flush(force=True)

    def on_event(self, event: dict[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.on_event(self, event)
        kind = event["kind"]
        rank = event.get("rank")
        if kind == "started":
            self.set_state(rank, RunState.RUNNING)
        elif kind == "result":
            self.outcome.results[rank] = event["value_bytes"]
        elif kind == "failure":
            failure = RootCause.from_failure(event, received_at=self.now())
            self.outcome.failures.append(failure)
            self.set_state(rank, RunState.FAILED, failure.outcome_words()[:200])
        elif kind == "progress" and event["what"] == OOM_CAUGHT:
            self.outcome.caught_oom[rank] = event  # each tells the sizes so far
        elif kind == "finished":
            self.outcome.finished.add(rank)
            if rank in self.outcome.results:
                self.set_state(rank, RunState.DONE)

    def _restart_requested(self) -> bool:
        root = self.outcome.root
        return root is not None and root.cause is Cause.RESTART and self.restarts_ranks

    def _restart(self, payload: bytes) -> None:
        """Stop every rank and start them again with the setup options a monitor asked for.

        :class:`~nblaunch.engine.batch_size.BatchSizeMonitor` asks for this when a rank ran out
        of memory while its peers were blocked in a collective of the same step: only fresh
        processes, all at the smaller batch size, can go on from there. Output and log files
        carry on.
        """
        request = self.outcome.root
        assert request is not None
        if request.progress:
            self.publish(request.progress)
        self.plan.options.update(request.options)
        restarts.start_again(self, payload, request.message)

    def on_death(self, rank: int, exitcode: int | None, after_return: bool = False) -> None:
        death = RootCause.death(rank, exitcode, after_return)
        self.outcome.finished.add(rank)
        self.outcome.failures.append(death)
        self.set_state(rank, RunState.FAILED, death.message)

    # --- stopping --------------------------------------------------------------------------------

    def stop_on_interrupt(self) -> None:
        """The notebook was interrupted: SIGINT every rank, then escalate; within ~5 s in all."""
        shutdown.stop_on_interrupt(self)

    def finish(self) -> None:
        """Stop every rank (asking nicely first when the run went well) and close everything."""
        shutdown.finish(self)

    def run_ended(self, ok: bool) -> Event:
        """The run's last event: how it went, and each task rank's outcome in a few words."""
        elapsed_s = time.time() - self.started_at
        return verdict.run_ended(
            self.outcome, self.task_ranks, ok, elapsed_s, self.attempts.restarts
        )

    # --- reporting -------------------------------------------------------------------------------

    def conclude(self) -> list[Any]:
        """Return the results by rank, or raise the root cause."""
        __tracebackhide__ = True
        outcome = self.outcome
        if outcome.root is None and self._all_returned():
            return verdict.values(outcome, self.task_ranks)
        root = outcome.root or RootCause(Cause.TIMEOUT, 0, "no rank reported")
        raise self.exception_for(root)

    def exception_for(self, root: RootCause) -> BaseException:
        """The exception to raise in the notebook for ``root``; the view shows its diagnosis."""
        context = verdict.Context(
            world_size=self.plan.world_size,
            task_ranks=tuple(self.task_ranks),
            debug=self.plan.debug,
            run_dir=self.plan.run_dir,
            tails=self.relay.tails if self.relay is not None else {},
        )
        exc, shown = verdict.exception_for(root, self.outcome, context)
        if shown is not None:
            self.publish(shown)
        self.attempts.annotate(exc)  # why each earlier attempt ended
        return exc
