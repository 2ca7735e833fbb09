"""A pool's engine: its ranks through their life, start, one task at a time, break, restart, close.

:class:`PoolEngine` owns a pool's ranks and its :class:`~nblaunch.engine.run.run.Run`: it starts
them and waits until every one joined the process group, runs one task at a time
(:mod:`nblaunch.engine.pool.task_end` decides what happens after it), breaks when a rank is lost,
starts fresh ranks when one could not be stopped, and stops them. It knows no notebook: the
notebook's :class:`~nblaunch.notebook.pool.Pool` holds one (or a client of a detached pool's
host) and adds what a person runs and sees, and which pool is the kernel's; a detached pool's
host runs one headless.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from nblaunch.engine.background.background_run import BackgroundTask
from nblaunch.engine.clock import REAL_CLOCK, Clock
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.pool import status as pool_status
from nblaunch.engine.pool.task_end import INTERRUPT_WAIT_S, AfterTask, run_task
from nblaunch.engine.processes.backend import BackendFactory, ProcessBackend
from nblaunch.engine.processes.supervisor import reap_let_go
from nblaunch.engine.run.run import Run
from nblaunch.errors import LaunchError, describe_exit
from nblaunch.events import EventSink, Lifecycle, NullView
from nblaunch.options import LaunchOptions
from nblaunch.ranks import namespace

# How long starting the ranks (imports, device, process group) may take.
START_TIMEOUT_S = 120.0


class Nodes(Protocol):
    """A pool's other machines (:class:`nblaunch.cluster.pool_nodes.PoolNodes`), as the pool's
    ranks use them: the cluster package sits above the engine, so the engine names only this."""

    options: Any  # NodeOptions

    def plan(self, function: Any, num_processes: int | None, options: LaunchOptions) -> Any: ...

    def new_run(self, plan: Any) -> Run: ...

    def end_joins(self) -> None: ...


def checked_task_ranks(ranks: list[int] | None, world_size: int) -> list[int]:
    """The ranks a task asked for (None: all), sorted, or ``LaunchError`` naming the pool's."""
    task_ranks = list(range(world_size)) if ranks is None else sorted(set(ranks))
    if not task_ranks or any(not 0 <= r < world_size for r in task_ranks):
        raise LaunchError(f"ranks {ranks!r}: the pool has ranks 0-{world_size - 1}")
    return task_ranks


def _pool_task() -> None:
    """Stands in for the function during planning: a pool's tasks come later."""


class PoolEngine:
    """The ranks of a pool and their run, through their life (see the module docstring).

    Parameters
    ----------
    num_processes, options
        As for a launch (:func:`~nblaunch.engine.plan.launch_plan.plan_launch`).
    nodes
        The pool's other machines, or None (this one only).
    start_timeout
        How long starting the ranks may take.
    backend, clock
        The run's (:class:`~nblaunch.engine.run.run.Run`): real processes and time unless a
        test scripts them.
    """

    detached = False  # its ranks are this process's children (a host's client says True)

    def __init__(
        self,
        num_processes: int | None,
        options: LaunchOptions,
        nodes: Nodes | None = None,
        start_timeout: float = START_TIMEOUT_S,
        backend: BackendFactory = ProcessBackend,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        self.num_processes = num_processes
        self.options = options
        self.nodes = nodes  # a pool on several machines (None: this one only)
        self.backend = backend
        self.clock = clock
        self.start_timeout = start_timeout
        self.state = Lifecycle.CLOSED
        self.problem = ""  # why the pool is broken
        self.started_at = 0.0
        self.start_s = 0.0  # how long the last start took
        self.tasks_run = 0
        self.last_task = ""  # what ran last, and how it ended
        self.last_failed_rank: int | None = None  # whose failure %dist debug opens
        self.current_task = ""
        self.restarts = 0
        self.engine: Run | None = None  # the ranks' run, while the pool runs
        self._task_id = 0
        self._pids: list[int | None] = []
        self.background: BackgroundTask | None = None  # a task going on in a thread (--bg)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> PoolEngine:
        """Start the ranks and wait until every one has joined the process group.

        Raises
        ------
        LaunchError
            Bad arguments, or the pool runs already.
        Exception
            A rank's own exception when it failed to start.
        """
        if self.state is not Lifecycle.CLOSED:
            raise LaunchError(f"this pool is already {self.state.value}; close() it first")
        if self.nodes is None:
            plan = plan_launch(_pool_task, self.num_processes, self.options)
        else:
            plan = self.nodes.plan(_pool_task, self.num_processes, self.options)
        self.state = Lifecycle.STARTING
        self.problem = ""
        began = time.monotonic()
        self.engine = None
        try:
            run = self.engine = self._new_run(plan)
            run.start()
            run.await_started(self.start_timeout)
        except BaseException:
            self._shut_down(grace=1.0)
            self.state = Lifecycle.CLOSED
            raise
        self.start_s = time.monotonic() - began
        self._pids = [rank.pid for rank in run.backend.ranks]
        self.started_at = time.time()
        self.state = Lifecycle.IDLE
        return self

    def close(self) -> None:
        """Stop every rank (asking nicely first) and release the pool; safe to call twice.

        The other nodes of a multi-node pool stop their ranks and their ``join`` ends.
        """
        self._close(rejoin=False)

    def restart(self, num_nodes: int | None = None) -> PoolEngine:
        """Stop the ranks and start fresh ones with the same options (their state is gone).

        The other nodes of a multi-node pool join the new start by themselves; ``num_nodes``
        changes how many take part (after a node was lost, the nodes that remain).
        """
        if num_nodes is not None:
            if self.nodes is None:
                raise LaunchError("num_nodes: this pool runs on this machine only")
            # checked before closing
            self.nodes.options = self.nodes.options.replace(num_nodes=num_nodes)
        self._close(rejoin=True)
        self.restarts += 1
        return self.start()

    def _close(self, rejoin: bool) -> None:
        if self.state is Lifecycle.CLOSED:
            return
        if self.background is not None and self.background.state == Lifecycle.RUNNING:
            self.background.stop()  # interrupt the task first, as the interrupt button would
            self.background.wait(INTERRUPT_WAIT_S + 5.0)
        run = self.engine
        if run is not None and self.state is Lifecycle.IDLE:
            run.hang_up(limit_s=3.0)
        self._shut_down(grace=1.0, rejoin=rejoin)
        if not rejoin and self.nodes is not None:
            self.nodes.end_joins()
        reap_let_go(wait=True)  # closed means gone: their memory is free again
        self.state = Lifecycle.CLOSED

    def __enter__(self) -> PoolEngine:
        if self.state is Lifecycle.CLOSED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten pool still stops its ranks
        with contextlib.suppress(Exception):
            if self.state is not Lifecycle.CLOSED:
                self.close()

    # --- one task at a time --------------------------------------------------------------------

    def run_payload(
        self,
        payload: bytes,
        *,
        ranks: list[int] | None = None,
        description: str = "",
        timeout: float | None = None,
        hang_timeout: float | None = None,
        view: EventSink | None = None,
    ) -> list[Any]:
        """Run a serialised ``(function, args, kwargs)`` as one task; return values by rank.

        Parameters
        ----------
        payload
            From :func:`~nblaunch.engine.plan.launch_plan.serialize_payload`.
        ranks
            The ranks to run on (default all); values come back in rank order.
        description
            What runs, for ``%dist status``.
        timeout
            Fail the task with ``LaunchTimeoutError`` after this many seconds.
        hang_timeout
            For this task, instead of the pool's ``hang_timeout``.
        view
            Where the task's events go (default: nowhere; a detached pool's host sends them to
            the notebook, the notebook's pool to the view it chose).

        Raises
        ------
        LaunchError
            The pool is stopped, busy or broken, or ``ranks`` is not valid; nothing ran.
        KeyboardInterrupt
            The task was interrupted; the ranks are ready for the next one.
        """
        task_ranks = self.task_ranks(ranks)
        hang_timeout = self.options.hang_timeout if hang_timeout is None else hang_timeout
        return self.run_task(
            payload, task_ranks, view or NullView(), description, timeout, hang_timeout
        )

    def task_ranks(self, ranks: list[int] | None) -> list[int]:
        """The ranks a task asked for, checked; raises ``LaunchError`` unless the pool can take
        a task on them now."""
        self._check_usable()
        return checked_task_ranks(ranks, self.world_size)

    def reserve(self, description: str) -> None:
        """Hold the pool for a task that starts on a thread soon (``--bg``): no other cell slips
        in before it; :meth:`run_task` on that thread then runs it."""
        self.state = Lifecycle.BUSY
        self.current_task = description or "a task"

    def run_task(
        self,
        payload: bytes,
        task_ranks: list[int],
        view: EventSink,
        description: str,
        timeout: float | None,
        hang_timeout: float | None,
    ) -> list[Any]:
        """Run one task on ``task_ranks`` (from :meth:`task_ranks`), its events to ``view``."""
        run = self.engine
        self._task_id += 1
        self.state = Lifecycle.BUSY
        self.current_task = description or "a task"
        try:
            report = run_task(
                run,
                payload,
                self._task_id,
                task_ranks,
                view,
                timeout=timeout,
                hang_timeout=hang_timeout,
                first=self.tasks_run == 0,
                describe_node=self._describe_node,
            )
            self.last_task = f"{self.current_task} ({'ok' if report.ok else 'failed'})"
            if report.end.after is AfterTask.BROKEN:
                self._break(report.end.problem)
            elif report.end.after is AfterTask.RESTART:
                self._replace_ranks()
            else:
                self.state = Lifecycle.IDLE
        finally:
            self.current_task = ""
            if self.state is Lifecycle.BUSY:  # the task did not end cleanly: trust no rank
                self._break("a task did not end cleanly (see the error above)")
        self.tasks_run += 1
        if report.raises:
            self.last_failed_rank = report.failed_rank
        try:
            return report.conclude()
        finally:  # the values are the caller's now: a pull's 50 MB is not kept to the next task
            run.outcome.results.clear()

    # --- information -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks (0 before the first start)."""
        return self.engine.plan.world_size if self.engine is not None else 0

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the ranks, by rank (of the last start, after ``close`` too)."""
        return list(self._pids)

    @property
    def task_id(self) -> int:
        """The number of the last task started (0 before the first)."""
        return self._task_id

    def describe(self) -> str:
        """One line: how many ranks, on what, which processes, in what state."""
        return pool_status.describe(self)

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: pid, alive, state, memory (RSS; device memory on GPUs), names.

        When the pool is idle, this asks the ranks (a task of a few milliseconds) for their
        device memory and the names earlier cells defined.
        """
        rank_info: dict[int, dict[str, Any]] = {}
        if self.state is Lifecycle.IDLE:
            with contextlib.suppress(Exception):
                payload = serialize_payload(namespace.rank_info)
                ranks = self.task_ranks(None)
                hang_timeout = self.options.hang_timeout
                values = self.run_task(
                    payload, ranks, NullView(), "%dist status", None, hang_timeout
                )
                rank_info = dict(enumerate(values))
                self.tasks_run -= 1  # asking for the status is not the person's work
        return pool_status.status(self, rank_info)

    def status_text(self) -> str:
        """What ``%dist status`` prints."""
        rows = self.status() if self.state is not Lifecycle.CLOSED else []
        return pool_status.status_text(self, rows)

    # --- internals -------------------------------------------------------------------------------

    def _new_run(self, plan: Any) -> Run:
        """The engine: this machine's ranks, or with the other nodes once they all joined."""
        if self.nodes is None:
            return Run(plan, NullView(), backend=self.backend, clock=self.clock)
        return self.nodes.new_run(plan)

    def _check_usable(self) -> None:
        """Raise ``LaunchError`` unless the pool can take a task now."""
        if self.state is Lifecycle.CLOSED:
            raise LaunchError(
                "the pool is stopped; start one with %dist start -n N or nblaunch.start_pool(N)"
            )
        if self.background is not None and self.background.state == Lifecycle.RUNNING:
            raise LaunchError(
                f"the pool is busy with a background cell ({self.current_task}): %dist wait "
                "for it, or stop it with nblaunch.runs()[0].stop(); its names stay"
            )
        if self.state in (Lifecycle.STARTING, Lifecycle.BUSY):
            raise LaunchError(f"the pool is busy: {self.describe()}")
        if self.state is Lifecycle.IDLE:  # a rank may have died since the last task
            dead = self.engine.backend.reap()
            if dead:
                words, _ = describe_exit(dead[0].exitcode)
                self._break(f"rank {dead[0].rank} (pid {dead[0].pid}) {words} between cells")
        if self.state is Lifecycle.BROKEN:
            raise LaunchError(
                f"the pool cannot run cells: {self.problem}. Run %dist restart (or "
                "pool.restart()) for fresh ranks, whose names from earlier cells are gone; "
                "or %dist stop."
            )

    def _describe_node(self, rank: int) -> str:
        """``node 1 (host)``: the node of ``rank`` in a multi-node pool."""
        assert self.engine is not None
        return self.engine.node_named(rank // self.engine.plan.nproc_per_node)

    def _break(self, problem: str) -> None:
        """A rank died: stop the others (their process group is broken) and remember why."""
        self.problem = problem
        self._shut_down(grace=1.0, close_pipes=False)
        self.state = Lifecycle.BROKEN

    def _replace_ranks(self) -> None:
        """Restart ranks that could not be stopped politely (the caller tells the person)."""
        self._shut_down(grace=1.0)
        self.state = Lifecycle.CLOSED
        self.restarts += 1
        try:
            self.start()
        except Exception as exc:  # the task's error carries the note; the pool says why
            self.state = Lifecycle.BROKEN
            self.problem = f"restarting the ranks failed: {type(exc).__name__}: {exc}"

    def _shut_down(self, grace: float, close_pipes: bool = True, rejoin: bool = True) -> None:
        run = self.engine
        if run is None:
            return
        with contextlib.suppress(Exception):
            run.stop_ranks(grace=grace)
        if close_pipes:  # a broken pool keeps its other nodes until it is restarted or closed
            with contextlib.suppress(Exception):
                run.close(rejoin=rejoin)
