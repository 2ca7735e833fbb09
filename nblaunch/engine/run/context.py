"""What a run is to its monitors and its caller, and the hooks a run on several machines changes.

:class:`RunBase` holds a run's state (plan, view, ranks, outcome, states, monitors, attempts) and
offers what every monitor reads of a run (:class:`~nblaunch.engine.monitors.protocol.RunContext`:
the clock, pauses, a rank's pipe, the view), what the caller gets (:meth:`RunBase.conclude`), and
the hooks that :class:`nblaunch.cluster.run.MultiNodeRun` changes. Its life (start, watch,
restart, stop) is :class:`~nblaunch.engine.run.run.Run`'s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from nblaunch.engine import verdict
from nblaunch.engine.clock import REAL_CLOCK, Clock, Pauses
from nblaunch.engine.monitors.protocol import Monitor
from nblaunch.engine.monitors.registry import parent_monitors
from nblaunch.engine.output.relay import EventSource, Relay
from nblaunch.engine.plan.launch_plan import LaunchPlan
from nblaunch.engine.processes.backend import BackendFactory, ProcessBackend
from nblaunch.engine.run.restarts import Attempts
from nblaunch.engine.verdict import Cause, Outcome, RootCause
from nblaunch.events import Event, EventSink, RunState


class RunBase:
    """A run's state, what its monitors and its caller see of it, and its hooks.

    A run on several machines (:class:`nblaunch.cluster.run.MultiNodeRun`) changes only the
    hooks: :meth:`~nblaunch.engine.run.run.Run.start_processes` (which ranks are this machine's),
    :meth:`more_monitors`, :meth:`event_sources` (the other nodes' events), :meth:`task_sent`,
    :meth:`interrupt_elsewhere`, :meth:`stopping` (tell the other nodes) and
    :meth:`release_nodes`; a single-node run's do nothing.

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
        self.monitors = self.new_monitors()
        self.task_ranks: list[int] = list(range(plan.world_size))  # the ranks running a task
        self.announced = False  # the run's header was shown
        self.pauses = Pauses(clock)  # the clocks stand still while a rank waits in the debugger
        self._stop = threading.Event()  # request_stop: another thread asks this run to stop
        self.attempts = Attempts(plan.max_restarts)  # restarts after a failure (max_restarts=)

    # --- what monitors see: the clock, pauses, a rank's pipe, the view ---------------------------

    def now(self) -> float:
        """The run's clock (monotonic seconds)."""
        return self.clock.now()

    def pause(self, key: object) -> None:
        """Stop the clocks while ``key`` (a rank in the debugger) waits for the person."""
        self.pauses.pause(key)

    def resume(self, key: object) -> None:
        self.pauses.resume(key)

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

    # --- hooks: what a run on several machines changes -----------------------------------------

    def new_monitors(self) -> list[Monitor]:
        """The features' monitors for this run (fresh ones for each task and restart)."""
        return [*parent_monitors(self.plan), *self.more_monitors()]

    def more_monitors(self) -> list[Monitor]:
        """Monitors of this kind of run beside the features'."""
        return []

    def event_sources(self, relay: Relay) -> list[EventSource]:
        """Where events come from besides this machine's ranks."""
        return []

    def task_sent(self, task_id: int, payload: bytes) -> None:
        """A task was sent to this machine's ranks among ``self.task_ranks``."""

    def interrupt_elsewhere(self, ranks: list[int]) -> None:
        """Interrupt ``ranks``, which are not this machine's."""

    def stopping(self, ok: bool | None) -> None:
        """The ranks are about to be stopped: ``ok`` (every rank returned), not, or None (an
        interrupt)."""

    def host_of(self, node: int) -> str:
        """The host name of ``node`` (``"?"`` until it said)."""
        return "?"

    def node_named(self, node: int) -> str:
        """``node 1 (its host)``, or ``node 1`` until it said its host name."""
        host = self.host_of(node)
        return f"node {node}" if host == "?" else f"node {node} ({host})"

    def release_nodes(self, rejoin: bool) -> None:
        """Let go of other nodes (a multi-node pool's); a single-node run has none."""

    # --- what the caller gets ------------------------------------------------------------------

    def run_ended(self, ok: bool) -> Event:
        """The run's last event: how it went, and each task rank's outcome in a few words."""
        elapsed_s = time.time() - self.started_at
        return verdict.run_ended(
            self.outcome, self.task_ranks, ok, elapsed_s, self.attempts.restarts
        )

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
