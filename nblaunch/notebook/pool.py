"""The persistent rank pool: ranks that stay alive across cells, with their state.

``%dist start -n 2`` (or :func:`start_pool`) starts the ranks once: processes, devices and the
process group. Every ``%%distributed`` cell, or :meth:`Pool.run` call, is then one *task* sent
to those same ranks, so a model built in one cell is still there in the next one, and a cell
costs a few milliseconds instead of a launch.

The pool is a :class:`~nblaunch.engine.run.Run` that runs many tasks: the same supervisor, relay,
root-cause logic and live view as a one-shot launch. What it adds is what happens *between*
tasks:

- a task ends only when every rank it ran on is back waiting for the next one, and whatever the
  task printed has been shown, so no output lands under another cell;
- an interrupt (the kernel's stop button) raises ``KeyboardInterrupt`` inside the ranks; a rank
  that cannot react (stuck in a collective inside C code) gets the pool restarted, and the
  person is told that the ranks' state is gone;
- a rank that dies fails its cell with the real cause and leaves the pool *broken*: the next
  cell says so at once (``%dist restart``) instead of hanging on the dead rank;
- the live view is built only for a task that runs past ``widgets.LIVE_VIEW_AFTER_S``; a
  quicker one shows its static summary, or nothing when it was silent and successful
  (``widgets.DeferredView``): the widget costs more than a quick cell on the pool.

Inside a rank, :func:`rank_namespace` is the dictionary cells run in; it lives as long as the
rank process.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
import signal
import time
import warnings
from typing import Any

from nblaunch import pickling
from nblaunch.engine.plan import plan_launch, serialize_payload
from nblaunch.engine.run import Run
from nblaunch.engine.supervisor import reap_let_go
from nblaunch.engine.verdict import Cause, RootCause, add_note, recreate_exception
from nblaunch.errors import LaunchError, describe_exit
from nblaunch.events import NullView, RunState, diagnosis
from nblaunch.options import (
    DEFAULT_HANG_TIMEOUT_S,
    DISPLAY_MODES,
    LaunchOptions,
    NodeOptions,
)
from nblaunch.rank import debugger, worker

# How long the ranks of an interrupted or failed task get to come back before the pool restarts.
INTERRUPT_WAIT_S = 3.0
# A task whose results all arrived: how long to wait for each rank's closing "finished" event.
FINISH_WAIT_S = 2.0
# How long starting the ranks (imports, device, process group) may take.
START_TIMEOUT_S = 120.0

_current: Pool | None = None
_atexit_registered = False
# Inside a rank: the namespace %%distributed cells run in; it persists between tasks.
_namespace: dict[str, Any] = {}


class PoolState(str, enum.Enum):
    """Lifecycle of a pool, as ``%dist status`` shows it."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    BROKEN = "broken"  # a rank died: only restart or stop help
    CLOSED = "closed"


def rank_namespace() -> dict[str, Any]:
    """The namespace pool cells run in on this rank; it outlives each cell.

    In the notebook process this is an unused, empty dictionary.
    """
    return _namespace


def current_pool() -> Pool | None:
    """The running pool of this kernel (also a broken one, so cells can say so), else ``None``."""
    if _current is not None and _current.state is not PoolState.CLOSED:
        return _current
    return None


def refuse_if_running(what: str) -> None:
    """Raise ``LaunchError`` when a pool holds the ranks and devices.

    Parameters
    ----------
    what
        What was about to start (``"notebook_launcher"``), for the message.

    Raises
    ------
    LaunchError
        Naming the running pool and the two ways out.
    """
    pool = current_pool()
    if pool is not None:
        raise LaunchError(
            f"{what} cannot start while a pool holds the devices: {pool.describe()}. "
            "Run the work on the pool (pool.run(function, ...) or a %%distributed cell), "
            "or stop the pool first (pool.close() or %dist stop)."
        )


def start_pool(num_processes: int | None = None, **options: Any) -> Pool:
    """Start ``num_processes`` ranks that stay alive until :meth:`Pool.close`.

    ``options`` are :class:`Pool`'s keywords (``start_method``, ``debug``, ``log_level``,
    ``hang_timeout``, ``device_type``, ``run_dir``, ``display``, ``num_nodes``, ...); they mean
    what they mean for :func:`~nblaunch.notebook_launcher`. Use the pool as a context manager
    to close it on exit.

    Returns
    -------
    Pool
        The started pool; also what ``%%distributed`` cells now run on.

    Raises
    ------
    LaunchError
        Bad arguments, or a pool is already running (stop it first).
    Exception
        A rank's own exception when it failed to start (device, process group).
    """
    return Pool(num_processes, **options).start()


def _pool_task() -> None:
    """Stands in for the function during planning: a pool's tasks come later."""


class Pool:
    """Ranks that stay alive between tasks, with their namespaces and process group.

    Create it with :func:`start_pool` (or ``Pool(...).start()``, or ``with Pool(...) as pool``).
    The parameters mean what they mean for :func:`~nblaunch.notebook_launcher`; ``display`` is
    the view every task shows.

    With ``num_nodes``, the pool spans that many machines: ``num_processes`` ranks on each,
    this one first; each other node runs ``python -m nblaunch join`` once (the command is
    printed), and stays in the pool across its restarts until the pool is closed; or the
    pool starts them itself with ``start_nodes`` (``"ssh"`` with ``hostfile``, ``"srun"``).
    """

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        start_method: str = "forkserver",
        debug: bool | None = None,
        log_level: str | None = None,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        device_type: str | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        display: str = "auto",
        start_timeout: float = START_TIMEOUT_S,
        num_nodes: int | None = None,
        rdzv_endpoint: str | None = None,
        rdzv_timeout: float | None = None,
        rdzv_id: str | None = None,
        start_nodes: str | None = None,
        hostfile: str | os.PathLike[str] | None = None,
    ) -> None:
        self.num_processes = num_processes
        self.options = LaunchOptions(
            start_method=start_method,
            debug=debug,
            log_level=log_level,
            hang_timeout=hang_timeout,
            master_addr=master_addr,
            master_port=master_port,
            device_type=device_type,
            run_dir=run_dir,
        )
        # A pool on several machines (None: this one only).
        self.nodes: NodeOptions | None = None
        if num_nodes is not None:
            self.nodes = NodeOptions(
                num_nodes, rdzv_endpoint, rdzv_timeout, rdzv_id, start_nodes, hostfile
            )
        # A multi-node pool's secret, kept so the nodes' joins stay valid across restarts, and
        # the join commands it started itself (start_nodes), which rejoin every restart.
        self._secret: Any = None
        self._starter: Any = None
        self.display = display
        self.start_timeout = start_timeout
        self.state = PoolState.CLOSED
        self.problem = ""  # why the pool is broken
        self.started_at = 0.0
        self.start_s = 0.0  # how long the last start took
        self.tasks_run = 0
        self.last_task = ""  # what ran last, and how it ended
        self.last_failed_rank: int | None = None  # whose failure %dist debug opens
        self.current_task = ""
        self.restarts = 0
        self._run: Run | None = None  # the engine, while the pool runs
        self._task_id = 0
        self._pids: list[int | None] = []

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Pool:
        """Start the ranks and wait until every one has joined the process group.

        Raises
        ------
        LaunchError
            Bad arguments, or another pool is running.
        Exception
            A rank's own exception when it failed to start.
        """
        global _current, _atexit_registered
        other = current_pool()
        if other is not None and other is not self:
            raise LaunchError(
                f"a pool is already running: {other.describe()}. Use it, restart it "
                "(%dist restart or pool.restart()), or stop it first (%dist stop or pool.close())."
            )
        if self.state is not PoolState.CLOSED:
            raise LaunchError(f"this pool is already {self.state.value}; close() it first")
        if self.display not in DISPLAY_MODES:
            raise LaunchError(f"display={self.display!r} is not one of {', '.join(DISPLAY_MODES)}")
        if self.nodes is None:
            plan = plan_launch(_pool_task, self.num_processes, self.options)
        else:
            plan = self._plan_nodes()
        self.state = PoolState.STARTING
        self.problem = ""
        _current = self
        if not _atexit_registered:
            atexit.register(_close_current)
            _atexit_registered = True
        began = time.monotonic()
        self._run = None
        try:
            run = self._run = self._new_run(plan)
            run.start()
            run.await_started(self.start_timeout)
        except BaseException:
            self._shut_down(grace=1.0)
            self.state = PoolState.CLOSED
            _current = None
            raise
        self.start_s = time.monotonic() - began
        self._pids = [rank.pid for rank in run.supervisor.ranks]
        self.started_at = time.time()
        self.state = PoolState.IDLE
        return self

    def close(self) -> None:
        """Stop every rank (asking nicely first) and release the pool; safe to call twice.

        The other nodes of a multi-node pool stop their ranks and their ``join`` ends.
        """
        self._close(rejoin=False)

    def restart(self, num_nodes: int | None = None) -> Pool:
        """Stop the ranks and start fresh ones with the same options (their state is gone).

        The other nodes of a multi-node pool join the new start by themselves; ``num_nodes``
        changes how many take part (after a node was lost, the nodes that remain).
        """
        if num_nodes is not None:
            if self.nodes is None:
                raise LaunchError("num_nodes: this pool runs on this machine only")
            self.nodes = self.nodes.replace(num_nodes=num_nodes)  # checked before closing
        self._close(rejoin=True)
        self.restarts += 1
        return self.start()

    def _close(self, rejoin: bool) -> None:
        global _current
        if self.state is PoolState.CLOSED:
            return
        run = self._run
        if run is not None and self.state is PoolState.IDLE:
            run.hang_up(limit_s=3.0)
        self._shut_down(grace=1.0, rejoin=rejoin)
        if not rejoin:
            self._end_joins()
        reap_let_go(wait=True)  # closed means gone: their memory is free again
        self.state = PoolState.CLOSED
        if _current is self:
            _current = None

    def __enter__(self) -> Pool:
        if self.state is PoolState.CLOSED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten pool still stops its ranks
        with contextlib.suppress(Exception):
            if self.state is not PoolState.CLOSED:
                self.close()

    # --- running tasks ---------------------------------------------------------------------------

    def run(self, function: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on every rank; return the values by rank.

        Same rules as :func:`~nblaunch.notebook_launcher`: the failing rank's own exception is
        raised here, ``RankFailedError`` when a rank died.

        Raises
        ------
        LaunchError
            The pool is stopped or broken (after a rank died: ``restart()``), or the function
            does not pickle.
        KeyboardInterrupt
            The task was interrupted; the ranks are ready for the next one.
        """
        payload = serialize_payload(function, args, kwargs)
        return self.run_payload(payload, description=_describe_function(function))

    def run_on(self, ranks: Any, function: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, on some ranks only (``0``, ``[0, 2]``, ``"1-3"``).

        Returns one value per chosen rank, in rank order. Collectives need every rank: one
        called here waits for ranks that are not running it.
        """
        chosen = parse_ranks(ranks, self.world_size)
        payload = serialize_payload(function, args, kwargs)
        return self.run_payload(payload, ranks=chosen, description=_describe_function(function))

    def pull(self, name: str, rank: int = 0) -> Any:
        """A CPU copy of the value ``name`` has in ``rank``'s namespace (``%dist pull``).

        Raises
        ------
        NameError
            The rank has no such name.
        TypeError
            The value cannot be pickled back to the notebook.
        """
        (value,) = self.run_payload(
            serialize_payload(_pull_value, (name,)), ranks=[rank], display="none"
        )
        return value

    def push(self, name: str, value: Any, ranks: Any = None) -> None:
        """Bind ``name`` to ``value`` in every rank's namespace (or ``ranks``'), as a cell would.

        Raises
        ------
        LaunchError
            The value cannot be pickled (nothing was sent).
        """
        chosen = None if ranks is None else parse_ranks(ranks, self.world_size)
        try:
            payload = pickling.dumps((_push_value, (name, value), {}))
        except Exception as exc:
            raise LaunchError(
                f"{name} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                f"sent to the ranks: {type(exc).__name__}: {exc}. Make it on the ranks, in a "
                "%%distributed cell, instead."
            ) from None
        self.run_payload(payload, ranks=chosen, description=f"push {name}", display="none")

    def debug(self, rank: int | None = None) -> None:
        """Open the debugger at the failing frame of the last cell's failure (``%dist debug``).

        Raises
        ------
        LaunchError
            No cell failed since the pool (re)started, or not on ``rank``.
        """
        rank = self.last_failed_rank if rank is None else rank
        if rank is None:
            raise LaunchError("%dist debug: the last cell did not fail with an exception")
        payload = serialize_payload(_post_mortem_on_rank, ())
        self.run_payload(payload, ranks=[rank], description=f"post-mortem on rank {rank}")

    def run_cell(
        self,
        task: Any,
        *,
        ranks: Any = None,
        timeout: float | None = None,
        hang_timeout: float | None = None,
        display: str | None = None,
    ) -> list[Any]:
        """Run a ``%%distributed`` cell (a :class:`~nblaunch.rank.cell.CellTask`) on the pool.

        Each rank runs the cell in its :func:`rank_namespace`, so names persist between cells.

        Parameters
        ----------
        task
            The cell, from :func:`nblaunch.notebook.magics.prepare_cell`.
        ranks
            ``--ranks``: ``"0"``, ``"0,2"``, ``"1-3"`` (default: every rank). The lowest chosen
            rank's last expression and ``-o`` values come back.
        timeout, hang_timeout
            As for ``%%distributed``; ``hang_timeout`` defaults to the pool's.

        Returns
        -------
        list
            One entry per rank of the pool; ``None`` for ranks the cell did not run on.
        """
        chosen = None if ranks is None else parse_ranks(ranks, self.world_size)
        if chosen is not None:
            task.main_rank = chosen[0]
        self.last_failed_rank = None  # each cell's ranks forget the previous cell's failure
        payload = serialize_payload(run_cell_on_rank, (task,))
        values = self.run_payload(
            payload,
            ranks=chosen,
            description=_describe_cell(getattr(task, "source", "")),
            display=display,
            timeout=timeout,
            hang_timeout=hang_timeout,
        )
        by_rank: list[Any] = [None] * self.world_size
        for rank, value in zip(chosen or range(self.world_size), values, strict=True):
            by_rank[rank] = value
        return by_rank

    def run_payload(
        self,
        payload: bytes,
        *,
        ranks: list[int] | None = None,
        description: str = "",
        display: str | None = None,
        timeout: float | None = None,
        hang_timeout: float | None = None,
    ) -> list[Any]:
        """Run a serialised ``(function, args, kwargs)`` as one task; return values by rank.

        Parameters
        ----------
        payload
            From :func:`~nblaunch.engine.plan.serialize_payload`.
        ranks
            The ranks to run on (default all); values come back in rank order.
        description
            What runs, for ``%dist status``.
        display
            The view for this task (default: the pool's).
        timeout
            Fail the task with ``LaunchTimeoutError`` after this many seconds.
        hang_timeout
            For this task, instead of the pool's ``hang_timeout``.

        Raises
        ------
        LaunchError
            The pool is stopped or broken, or ``ranks`` is not valid; nothing ran.
        KeyboardInterrupt
            The task was interrupted; the ranks are ready for the next one.
        """
        from nblaunch.notebook.widgets import DeferredView, make_view

        self._check_usable()
        task_ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        if not task_ranks or any(not 0 <= r < self.world_size for r in task_ranks):
            raise LaunchError(f"ranks {ranks!r}: the pool has ranks 0-{self.world_size - 1}")
        mode = display or self.display
        view = DeferredView(make_view(mode)) if mode != "none" else NullView()
        run = self._run
        guard = _TaskGuard()
        run.begin_task(
            view,
            task_ranks,
            timeout=timeout,
            hang_timeout=self.options.hang_timeout if hang_timeout is None else hang_timeout,
            monitors=[guard],
        )
        self._task_id += 1
        self.state = PoolState.BUSY
        self.current_task = description or "a task"
        previous_handler = guard.install()
        try:
            interrupted = False
            try:
                # The first task's header says what the start set up; later ones stay short.
                run.announce(warnings=[], notes=None if self.tasks_run == 0 else [])
                for rank in task_ranks:
                    run.set_state(rank, RunState.RUNNING)
                run.send_task(payload, self._task_id, task_ranks)
                run.watch()
            except KeyboardInterrupt:
                interrupted = True
            note, stopped = self._end_task(run, guard, interrupted)
        finally:
            guard.uninstall(previous_handler)
            self.current_task = ""
            if self.state is PoolState.BUSY:  # the task did not end cleanly: trust no rank
                self._break("a task did not end cleanly (see the error above)")
        self.tasks_run += 1
        return self._conclude(run, interrupted, note, stopped)

    # --- information -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks (0 before the first start)."""
        return self._run.plan.world_size if self._run is not None else 0

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the ranks, by rank (of the last start, after ``close`` too)."""
        return list(self._pids)

    def describe(self) -> str:
        """One line: how many ranks, on what, which processes, in what state."""
        if self._run is None:
            return f"a pool ({self.state.value})"
        plan = self._run.plan
        pids = ", ".join(str(p) for p in self.pids)
        nodes = pids_here = ""
        if self.nodes is not None:
            nodes, pids_here = f" on {plan.num_nodes} nodes", " here"
        text = (
            f"a pool of {plan.world_size} {plan.device_kind} rank(s){nodes} "
            f"({plan.start_method}{', debug' if plan.debug else ''}; pids{pids_here} {pids}), "
            f"{self.state.value}"
        )
        if self.state is PoolState.BUSY:
            text += f" running {self.current_task}"
        if self.state is PoolState.BROKEN:
            text += f": {self.problem}"
        return text

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: pid, alive, state, memory (RSS; device memory on GPUs), names.

        When the pool is idle, this asks the ranks (a task of a few milliseconds) for their
        device memory and the names earlier cells defined.
        """
        import psutil

        rows: list[dict[str, Any]] = []
        if self._run is None or self.state is PoolState.CLOSED:
            return rows
        rank_info: dict[int, dict[str, Any]] = {}
        if self.state is PoolState.IDLE:
            with contextlib.suppress(Exception):
                values = self.run_payload(
                    serialize_payload(_rank_info), description="%dist status", display="none"
                )
                rank_info = dict(enumerate(values))
                self.tasks_run -= 1  # asking for the status is not the person's work
        local = {process.rank: process.pid for process in self._run.supervisor.ranks}
        for rank in range(self.world_size):
            info = rank_info.get(rank, {})
            row: dict[str, Any] = {"rank": rank, "pid": local.get(rank), "alive": False}
            if rank in local:
                with contextlib.suppress(psutil.Error, ValueError, TypeError):
                    process = psutil.Process(row["pid"])
                    row["alive"] = process.status() != psutil.STATUS_ZOMBIE
                    row["rss_mb"] = process.memory_info().rss / 2**20
            else:  # another node's: alive if it answered just now
                row["alive"] = "pid" in info
            if self.nodes is not None:
                row["node"] = node = rank // self._run.plan.nproc_per_node
                row["host"] = self._run.head.hosts.get(node, "?")
            if not row["alive"]:
                row["state"] = "dead"
            else:
                row["state"] = "idle" if self.state is PoolState.IDLE else self.state.value
            row.update(info)
            rows.append(row)
        return rows

    def status_text(self) -> str:
        """What ``%dist status`` prints."""
        if self.state is PoolState.CLOSED:
            return "nblaunch pool: stopped; %dist start -n N starts one"
        lines = [f"nblaunch pool: {self.describe()}, up {_seconds(time.time() - self.started_at)}"]
        lines.append(
            f"  cells run: {self.tasks_run}; last: {self.last_task or 'none'}; "
            f"restarts: {self.restarts}; logs in {self._run.plan.run_dir}"
        )
        for row in self.status():
            memory = f"{row['rss_mb']:.0f} MB RSS" if "rss_mb" in row else "memory unknown"
            if row.get("device_mb") is not None:
                memory += f", {row['device_mb']:.0f} MB allocated on {row['device']}"
            names = row.get("names")
            defined = ""
            if names is not None:
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                defined = f"; {len(names)} name(s) defined" + (f": {shown}" if names else "")
            where = f" on node {row['node']} ({row['host']})" if "node" in row else ""
            lines.append(
                f"  rank {row['rank']}{where}: pid {row['pid']}, {row['state']}, {memory}{defined}"
            )
        if self.state is PoolState.BROKEN:
            lines.append("  run %dist restart for fresh ranks, or %dist stop")
        return "\n".join(lines)

    # --- internals -------------------------------------------------------------------------------

    def _plan_nodes(self) -> Any:
        """The plan of this node of a multi-node pool (node 0)."""
        from nblaunch.cluster.plan import plan_nodes  # not at import: ~10 ms

        assert self.nodes is not None
        plan = plan_nodes(_pool_task, self.num_processes, self.options, self.nodes, True)
        # Restarts keep the run id (and the secret): the nodes' join commands stay valid.
        self.nodes = self.nodes.replace(rdzv_id=plan.rdzv_run_id)
        return plan

    def _new_run(self, plan: Any) -> Run:
        """The engine: this machine's ranks, or with the other nodes once they all joined."""
        if self.nodes is None:
            return Run(plan, NullView())
        from nblaunch.cluster.head import Head
        from nblaunch.cluster.run import MultiNodeRun
        from nblaunch.cluster.store import signal_handlers_kept

        head = Head(plan, NullView(), secret=self._secret)
        self._secret = head.secret
        try:
            if self.nodes.start_nodes and self._starter is None:
                self._starter = head.start_joins(self.nodes.start_nodes, self.nodes.hostfile)
            elif self._starter is not None:  # a lost node's join is started again
                self._starter.renew(self.nodes.num_nodes - 1)
            with signal_handlers_kept():
                head.rendezvous(None, self.nodes.rdzv_timeout, self._starter)
        except BaseException:
            head.close()
            self._end_joins()
            raise
        return MultiNodeRun(plan, NullView(), head)

    def _end_joins(self) -> None:
        """The join commands this pool started end with it (they are given a while)."""
        if self._starter is not None:
            self._starter.close()
            self._starter = None

    def _check_usable(self) -> None:
        """Raise ``LaunchError`` unless the pool can take a task now."""
        if self.state is PoolState.CLOSED:
            raise LaunchError(
                "the pool is stopped; start one with %dist start -n N or nblaunch.start_pool(N)"
            )
        if self.state in (PoolState.STARTING, PoolState.BUSY):
            raise LaunchError(f"the pool is busy: {self.describe()}")
        if self.state is PoolState.IDLE:  # a rank may have died since the last task
            dead = self._run.supervisor.reap()
            if dead:
                words, _ = describe_exit(dead[0].exitcode)
                self._break(f"rank {dead[0].rank} (pid {dead[0].pid}) {words} between cells")
        if self.state is PoolState.BROKEN:
            raise LaunchError(
                f"the pool cannot run cells: {self.problem}. Run %dist restart (or "
                "pool.restart()) for fresh ranks, whose names from earlier cells are gone; "
                "or %dist stop."
            )

    def _end_task(
        self, run: Any, guard: _TaskGuard, interrupted: bool
    ) -> tuple[str, list[RootCause]]:
        """Bring the task's ranks back to waiting for the next task.

        Returns a note for the person (empty when all went to plan) and the ranks' failures
        that were only the pool's own interrupt.

        After an interrupt or a failure, ranks still running get SIGINT. A rank that does not
        come back within ``INTERRUPT_WAIT_S`` (stuck in C, e.g. in a collective whose peer
        left) gets the pool restarted; a rank that died leaves the pool broken.
        """
        outcome = run.outcome
        stop_others = interrupted or outcome.root is not None
        # The parent's interrupt reached every rank's task; after a failure only the others.
        signalled = set(run.task_ranks) if interrupted else set()
        if _pending(run) and not _deaths(run):
            if stop_others:
                signalled.update(_pending(run))
                run.interrupt(_pending(run))
            limit = INTERRUPT_WAIT_S if stop_others else FINISH_WAIT_S
            deadline = time.monotonic() + limit
            # A second press of the interrupt button stops the waiting.
            while _pending(run) and time.monotonic() < deadline and guard.interrupts < 2:
                run.pump(0.05)
        for event in run.relay.drain_ready():
            run.on_event(event)
        # A KeyboardInterrupt the pool caused is not a failure of that rank: it was stopped.
        stopped = [
            f
            for f in outcome.failures
            if f.cause is Cause.FAILURE
            and f.rank in signalled
            and f.exc_type == "builtins.KeyboardInterrupt"
        ]
        outcome.failures = [f for f in outcome.failures if f not in stopped]
        for failure in stopped:
            why = "interrupted" if interrupted else "stopped after another rank failed"
            run.set_state(failure.rank, RunState.STOPPED, why)
        deaths = _deaths(run)
        pending = _pending(run)
        note = ""
        if deaths:
            rank = deaths[0].rank
            if deaths[0].cause is Cause.NODE:
                self._break(deaths[0].message)
                node = rank // run.plan.nproc_per_node
                lost = f"node {node} ({run.head.hosts.get(node, '?')})"
                again = (
                    "restart it (%dist restart, pool.restart()) once its node's join runs again, "
                    "or with the nodes that remain (%dist restart --nodes N)"
                )
            else:
                self._break(f"rank {rank} {deaths[0].message}")
                lost = f"rank {rank}"
                again = "run %dist restart (or pool.restart()) for fresh ranks"
            note = f"The pool lost {lost}: {again}; names from earlier cells are gone."
        elif pending:
            for rank in pending:
                run.set_state(rank, RunState.STOPPED, "did not stop; the pool was restarted")
            note = (
                f"Rank(s) {', '.join(map(str, pending))} did not stop within "
                f"{INTERRUPT_WAIT_S:g} s{guard.where(pending)}, so the pool was restarted: "
                "fresh ranks, names from earlier cells are gone."
            )
        else:
            for rank in run.task_ranks:
                if rank not in outcome.results and run.states.get(rank) is RunState.RUNNING:
                    run.set_state(rank, RunState.STOPPED, "interrupted")
        ok = (
            outcome.root is None
            and not interrupted
            and not note
            and len(outcome.results) == len(run.task_ranks)
        )
        if note:
            run.publish(
                diagnosis(
                    "the pool lost a rank" if deaths else "the pool was restarted",
                    note,
                    "warning",
                    deaths[0].rank if deaths else pending[0],
                )
            )
        run.publish(run.run_ended(ok))
        run.view.close()
        self.last_task = f"{self.current_task} ({'ok' if ok else 'failed'})"
        if pending and not deaths:
            self._replace_ranks()
        elif not deaths:
            self.state = PoolState.IDLE
        return note, stopped

    def _conclude(
        self, run: Any, interrupted: bool, note: str, stopped: list[RootCause]
    ) -> list[Any]:
        """Return the task's values, or raise its root cause with the pool's note attached."""
        outcome = run.outcome
        complete = len(outcome.results) == len(run.task_ranks)
        if outcome.root is None and not interrupted and (complete or not note):
            if note:  # every value arrived, but a rank then did not come back
                warnings.warn(note, RuntimeWarning, stacklevel=3)
            return run.conclude()
        # A rank's own error or death seen during the interrupt comes before the interrupt.
        root = outcome.root or next(iter(outcome.failures), None)
        if root is not None:
            self.last_failed_rank = root.rank if root.cause is Cause.FAILURE else None
            exc = run.exception_for(root)
        else:
            exc = recreate_exception(stopped[0], run.plan.world_size) if stopped else None
            if not isinstance(exc, KeyboardInterrupt):
                exc = KeyboardInterrupt()
            ranks = ", ".join(str(f.rank) for f in stopped) or "none"
            ready = "" if note else "; the pool is ready for the next cell"
            add_note(exc, f"interrupted on rank(s) {ranks}{ready}")
        if note:
            add_note(exc, note)
        raise exc

    def _break(self, problem: str) -> None:
        """A rank died: stop the others (their process group is broken) and remember why."""
        self.problem = problem
        self._shut_down(grace=1.0, close_pipes=False)
        self.state = PoolState.BROKEN

    def _replace_ranks(self) -> None:
        """Restart ranks that could not be stopped politely (the caller tells the person)."""
        global _current
        self._shut_down(grace=1.0)
        self.state = PoolState.CLOSED
        self.restarts += 1
        try:
            self.start()
        except Exception as exc:  # the task's error carries the note; the pool says why
            self.state = PoolState.BROKEN
            self.problem = f"restarting the ranks failed: {type(exc).__name__}: {exc}"
            _current = self

    def _shut_down(self, grace: float, close_pipes: bool = True, rejoin: bool = True) -> None:
        run = self._run
        if run is None:
            return
        with contextlib.suppress(Exception):
            run.supervisor.stop(grace=grace)
        if close_pipes:  # a broken pool keeps its other nodes until it is restarted or closed
            with contextlib.suppress(Exception):
                run.release_nodes(rejoin)
            with contextlib.suppress(Exception):
                if run.relay is not None:
                    run.relay.close()
            with contextlib.suppress(Exception):
                run.supervisor.close()


class _TaskGuard:
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


def _pending(run: Any) -> list[int]:
    """Task ranks that have not sent "finished" yet."""
    return [r for r in run.task_ranks if r not in run.outcome.finished]


def _deaths(run: Any) -> list[RootCause]:
    """Ranks the pool lost: dead processes, and the ranks of a lost node."""
    root = run.outcome.root
    lost_node = [root] if root is not None and root.cause is Cause.NODE else []
    return [*lost_node, *run.outcome.deaths()]


def parse_ranks(spec: Any, world_size: int) -> list[int]:
    """Turn ``0``, ``"0,2"``, ``"1-3"`` or ``[0, 2]`` into a sorted list of ranks.

    Raises
    ------
    LaunchError
        A rank outside ``0 .. world_size-1`` or text that is not a rank list.
    """
    if isinstance(spec, bool):
        raise LaunchError(f"ranks must be rank numbers, got {spec!r}")
    if isinstance(spec, int):
        chosen = {spec}
    elif isinstance(spec, str):
        chosen = set()
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part.strip("-"):
                    low, high = part.split("-", 1)
                    chosen.update(range(int(low), int(high) + 1))
                else:
                    chosen.add(int(part))
            except ValueError:
                raise LaunchError(f"--ranks {spec!r}: write ranks like 0, 0,2 or 1-3") from None
    else:
        try:
            chosen = {int(r) for r in spec}
        except (TypeError, ValueError):
            raise LaunchError(f"ranks must be rank numbers, got {spec!r}") from None
    bad = sorted(r for r in chosen if not 0 <= r < world_size)
    if not chosen or bad:
        raise LaunchError(
            f"ranks {spec!r}: the pool has ranks 0-{world_size - 1}"
            + (f"; {', '.join(map(str, bad))} do not exist" if bad else "")
        )
    return sorted(chosen)


def _rank_info() -> dict[str, Any]:
    """Runs on each rank for ``%dist status``: memory and the names cells defined."""
    import psutil
    import torch

    context = worker.current()
    device = context.device if context else torch.device("cpu")
    info: dict[str, Any] = {
        "device": str(device),
        "device_mb": None,
        "pid": os.getpid(),
        "rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    if device.type == "cuda":
        info["device_mb"] = torch.cuda.memory_allocated(device) / 2**20
    info["names"] = sorted(
        name
        for name in _namespace
        if not name.startswith("_") and name not in ("rank", "local_rank", "world_size", "device")
    )
    return info


def run_cell_on_rank(task: Any) -> Any:
    """On a rank: run a ``%%distributed`` cell in the namespace this rank keeps between cells."""
    debugger.forget_failure()  # %dist debug opens the last cell's failure
    return task(_namespace)


def _pull_value(name: str) -> Any:
    """On a rank: the value of ``name`` in its namespace, ready for the notebook."""
    from nblaunch.rank.cell import to_notebook

    if name not in _namespace:
        defined = ", ".join(n for n in sorted(_namespace) if not n.startswith("_")) or "none"
        raise NameError(f"rank {worker.rank()} has no name {name!r} (its names: {defined})")
    return to_notebook(_namespace[name])


def _push_value(name: str, value: Any) -> None:
    """On a rank: bind ``name`` in its namespace, as a cell assigning it would."""
    _namespace[name] = value


def _post_mortem_on_rank() -> None:
    debugger.post_mortem_last()


def _describe_cell(source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return "cell: " + (first if len(first) <= 60 else first[:57] + "...")


def _describe_function(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def _seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _close_current() -> None:
    pool = current_pool()
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.close()
