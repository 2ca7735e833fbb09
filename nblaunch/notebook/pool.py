"""The persistent rank pool: ranks that stay alive across cells, with their state.

``%dist start -n 2`` (or :func:`start_pool`) starts the ranks once: processes, devices and the
process group. Every ``%%distributed`` cell, or :meth:`Pool.run` call, is then one *task* sent
to those same ranks, so a model built in one cell is still there in the next one, and a cell
costs a few milliseconds instead of a launch.

The pool is a :class:`~nblaunch.engine.run.run.Run` that runs many tasks: the same supervisor,
relay, root-cause logic and live view as a one-shot launch. What it adds is what happens *between*
tasks:

- a task ends only when every rank it ran on is back waiting for the next one, and whatever the
  task printed has been shown, so no output lands under another cell;
- an interrupt (the kernel's stop button, or ``q`` in a rank's debugger) raises
  ``KeyboardInterrupt`` inside the ranks; a rank waiting in a collective that the stopped ranks
  never issued (no signal reaches it inside C code) is freed by them issuing it
  (:mod:`nblaunch.engine.pool.release`); one that nothing frees gets the pool restarted,
  and the cell's error (``PoolRestartedError``) says first that the ranks' state is gone;
- a rank that dies fails its cell with the real cause and leaves the pool *broken*: the next
  cell says so at once (``%dist restart``) instead of hanging on the dead rank;
- the live view is built only for a task that runs past ``views.LIVE_VIEW_AFTER_S``; a
  quicker one shows its static summary, or nothing when it was silent and successful
  (``views.DeferredView``): the widget costs more than a quick cell on the pool.

Inside a rank, :func:`nblaunch.ranks.namespace.rank_namespace` is the dictionary cells run in;
it lives as long as the rank process. The ranks' life is :mod:`nblaunch.engine.pool.pool_engine`,
the end of a task :mod:`nblaunch.engine.pool.task_end`. :class:`Pool` holds a *transport*: that
engine in this process, or a client of a detached pool's host
(:class:`~nblaunch.notebook.pool_detached.HostPool`); it adds what a person runs and sees, and
which pool is the kernel's (:func:`current_pool`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Any

from nblaunch.engine.clock import REAL_CLOCK, Clock
from nblaunch.engine.plan.launch_plan import serialize_payload
from nblaunch.engine.pool.pool_engine import START_TIMEOUT_S
from nblaunch.engine.processes.backend import BackendFactory, ProcessBackend
from nblaunch.errors import LaunchError
from nblaunch.events import EventSink, Lifecycle
from nblaunch.notebook.pool_tasks import (
    PushedNames,
    describe_cell,
    describe_function,
    parse_ranks,
    push_payload,
    spread_by_rank,
    task_in_background,
)
from nblaunch.notebook.pool_transport import PoolTransport, make_transport
from nblaunch.options import DEFAULT_HANG_TIMEOUT_S, DISPLAY_MODES, LaunchOptions
from nblaunch.ranks import namespace

# --- the kernel's pool ---------------------------------------------------------------------------

_current: Pool | None = None
_atexit_registered = False


def current_pool() -> Pool | None:
    """The running pool of this kernel (also a broken one, so cells can say so), else ``None``."""
    if _current is not None and _current.state is not Lifecycle.CLOSED:
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


def _make_current(pool: Pool) -> None:
    global _current, _atexit_registered
    if not _atexit_registered:
        atexit.register(_close_current)
        _atexit_registered = True
    _current = pool


def _let_go(pool: Pool) -> None:
    global _current
    if _current is pool:
        _current = None


def _close_current() -> None:
    pool = current_pool()
    if pool is not None and not pool.transport.detached:  # a detached one goes on
        with contextlib.suppress(Exception):
            pool.close()


def _transports(name: str, doc: str, writable: bool = False) -> Any:
    """A property of :class:`Pool` that is its transport's attribute ``name``."""

    def read(pool: Pool) -> Any:
        return getattr(pool.transport, name, None)

    def write(pool: Pool, value: Any) -> None:
        setattr(pool.transport, name, value)

    return property(read, write if writable else None, doc=doc)


class Pool:
    """Ranks that stay alive between tasks, with their namespaces and process group.

    Create it with :func:`start_pool` (or ``Pool(...).start()``, or ``with Pool(...) as pool``).
    The parameters mean what they mean for :func:`~nblaunch.notebook_launcher`; ``display`` is
    the view every task shows.

    With ``num_nodes``, the pool spans that many machines: ``num_processes`` ranks on each,
    this one first; each other node runs ``python -m nblaunch join`` once (the command is
    printed), and stays in the pool across its restarts until the pool is closed; or the
    pool starts them itself with ``start_nodes`` (``"ssh"`` with ``hostfile``, ``"srun"``), or
    a Ray cluster places them (``cluster="ray"``).

    With ``detach=True`` the ranks live under a run host of their own and outlive the kernel
    (:mod:`nblaunch.notebook.pool_detached`); ``idle_limit`` seconds without a cell end it
    (default 24 h).

    ``backend`` and ``clock`` are the engine's (:class:`~nblaunch.engine.run.run.Run`): real
    processes and time unless a test scripts them.
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
        cluster: Any = None,
        backend: BackendFactory = ProcessBackend,
        clock: Clock = REAL_CLOCK,
        detach: bool = False,
        idle_limit: float | None = None,
        transport: PoolTransport | None = None,
    ) -> None:
        options = LaunchOptions(
            start_method=start_method,
            debug=debug,
            log_level=log_level,
            hang_timeout=hang_timeout,
            master_addr=master_addr,
            master_port=master_port,
            device_type=device_type,
            run_dir=run_dir,
        )
        self.pushed = PushedNames()  # notebook values every rank holds since %dist push
        self.display = display
        node_args = (num_nodes, rdzv_endpoint, rdzv_timeout, rdzv_id, start_nodes, hostfile)
        node_args += (cluster,)
        self.transport = transport or make_transport(
            num_processes, options, node_args, start_timeout, backend, clock, detach, idle_limit
        )

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Pool:
        """Start the ranks (a detached pool: its host, which starts them) and wait until every
        one has joined the process group; the pool is then the kernel's.

        Raises ``LaunchError`` (bad arguments, another pool running) or a rank's own exception
        when it failed to start.
        """
        other = current_pool()
        if other is not None and other is not self:
            raise LaunchError(
                f"a pool is already running: {other.describe()}. Use it, restart it "
                "(%dist restart or pool.restart()), or stop it first (%dist stop or pool.close())."
            )
        if self.display not in DISPLAY_MODES:
            raise LaunchError(f"display={self.display!r} is not one of {', '.join(DISPLAY_MODES)}")
        self.transport.start()
        self.make_current()
        return self

    def make_current(self) -> None:
        """Make this the kernel's pool: ``%%distributed`` cells run on it from now on."""
        _make_current(self)

    def close(self) -> None:
        """Stop every rank (asking nicely first) and release the pool; safe to call twice.

        The other nodes of a multi-node pool stop their ranks and their ``join`` ends; a
        detached pool's host ends too.
        """
        try:
            self.transport.close()
        finally:
            _let_go(self)

    def restart(self, num_nodes: int | None = None) -> Pool:
        """Stop the ranks and start fresh ones with the same options (their state is gone).

        The other nodes of a multi-node pool join the new start by themselves; ``num_nodes``
        changes how many take part (after a node was lost, the nodes that remain).
        """
        self.transport.restart(num_nodes)
        self.make_current()
        return self

    def detach(self) -> None:
        """Let go of a detached pool, which goes on; ``attach_pool()`` gets it back."""
        if not self.transport.detached:
            raise LaunchError("detach(): this pool's ranks are this kernel's; close() it instead")
        self.transport.detach()  # type: ignore[attr-defined]
        _let_go(self)

    def __enter__(self) -> Pool:
        return self.start() if self.state is Lifecycle.CLOSED else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten pool of this kernel's still stops its ranks
        with contextlib.suppress(Exception):
            if self.state is not Lifecycle.CLOSED and not self.transport.detached:
                self.close()

    # --- what the transport knows ----------------------------------------------------------------

    state = _transports("state", "The pool's state (:class:`Lifecycle`).")
    problem = _transports("problem", "Why the pool is broken.")
    world_size = _transports("world_size", "Number of ranks (0 before the first start).")
    pids = _transports("pids", "Process ids of the ranks, by rank (of the last start).")
    engine = _transports("engine", "The ranks' Run (a pool of this kernel's own only).")
    entry = _transports("entry", "A detached pool's registry entry (id, host pid, run directory).")
    options = _transports("options", "The launch options.", writable=True)
    num_processes = _transports("num_processes", "Ranks per machine.", writable=True)
    nodes = _transports("nodes", "The pool's other machines (PoolNodes), or None.", writable=True)
    start_s = _transports("start_s", "How long the last start took.")
    started_at = _transports("started_at", "When the ranks were started (time.time()).")
    restarts = _transports("restarts", "How many times the ranks were started again.")
    tasks_run = _transports("tasks_run", "How many tasks ran.")
    last_failed_rank = _transports("last_failed_rank", "Whose failure %dist debug opens.")

    def describe(self) -> str:
        """One line: how many ranks, on what, which processes, in what state."""
        return self.transport.describe()

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: pid, alive, state, memory (RSS; device memory on GPUs), names."""
        return self.transport.status()

    def status_text(self) -> str:
        """What ``%dist status`` prints."""
        return self.transport.status_text()

    # --- running tasks ---------------------------------------------------------------------------

    def run_payload(
        self,
        payload: bytes,
        *,
        ranks: list[int] | None = None,
        description: str = "",
        display: str | None = None,
        timeout: float | None = None,
        hang_timeout: float | None = None,
        background: bool = False,
        view: EventSink | None = None,
    ) -> Any:
        """Run a serialised ``(function, args, kwargs)`` as one task; return values by rank.

        Parameters
        ----------
        payload, ranks, description
            From :func:`~nblaunch.engine.plan.launch_plan.serialize_payload`; the ranks to run on
            (default all; values come back in rank order); what runs, for ``%dist status``.
        display
            The view for this task (default: the pool's), unless ``view`` is given.
        timeout, hang_timeout
            Fail the task with ``LaunchTimeoutError`` after ``timeout`` seconds; the hang
            watchdog's limit for this task (default: the pool's).
        background
            Return a :class:`~nblaunch.notebook.handle.RunHandle` at once, the task on a thread
            (the pool is busy until it ends; ``handle.stop()`` interrupts it, names kept).

        Raises
        ------
        LaunchError
            The pool is stopped, busy or broken, or ``ranks`` is not valid; nothing ran.
        KeyboardInterrupt
            The task was interrupted; the ranks are ready for the next one.
        """
        from nblaunch.notebook.views import choose_view  # not at import: ~13 ms

        if background and self.transport.detached:
            raise LaunchError("--bg runs on a pool of this kernel's own; leave it out here")
        task_ranks = self.transport.task_ranks(ranks)
        mode = display or self.display
        hang_timeout = self.options.hang_timeout if hang_timeout is None else hang_timeout
        if background:
            return task_in_background(
                self.transport, payload, task_ranks, mode, description, timeout, hang_timeout
            )
        if view is None:
            view = choose_view(mode, defer="always")
        return self.transport.run_task(
            payload, task_ranks, view, description, timeout, hang_timeout
        )

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
        return self.run_payload(payload, description=describe_function(function))

    def run_on(self, ranks: Any, function: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, on some ranks only (``0``, ``[0, 2]``, ``"1-3"``).

        Returns one value per chosen rank, in rank order. Collectives need every rank: one
        called here waits for ranks that are not running it.
        """
        chosen = parse_ranks(ranks, self.world_size)
        payload = serialize_payload(function, args, kwargs)
        return self.run_payload(payload, ranks=chosen, description=describe_function(function))

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
            serialize_payload(namespace.pull_value, (name,)), ranks=[rank], display="none"
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
        self.pushed.forget(name)
        payload = push_payload(name, value)
        self.run_payload(payload, ranks=chosen, description=f"push {name}", display="none")
        if chosen is None:  # every rank holds it now: cells need not send it again
            self.pushed.remember(name, value, self.started_at)

    def pinned_names(self, user_ns: dict[str, Any]) -> set[str]:
        """The notebook names whose value every rank already holds, pushed (``%dist push``) and
        not rebound since: a cell reading them does not send them again. Pushing is a copy:
        a change made to the notebook's object in place after the push stays in the notebook."""
        return self.pushed.pinned(user_ns, self.started_at)

    def debug(self, rank: int | None = None) -> None:
        """Open the debugger at the failing frame of the last cell's failure (``%dist debug``).

        Raises
        ------
        LaunchError
            No cell failed since the pool (re)started, or not on ``rank``.
        """
        if self.transport.detached:
            raise LaunchError(
                "%dist debug needs a pool of this kernel's own (the prompts wait here)"
            )
        rank = self.last_failed_rank if rank is None else rank
        if rank is None:
            raise LaunchError("%dist debug: the last cell did not fail with an exception")
        payload = serialize_payload(namespace.post_mortem, ())
        self.run_payload(payload, ranks=[rank], description=f"post-mortem on rank {rank}")

    def run_cell(
        self,
        task: Any,
        *,
        ranks: Any = None,
        timeout: float | None = None,
        hang_timeout: float | None = None,
        display: str | None = None,
        background: bool = False,
    ) -> Any:
        """Run a ``%%distributed`` cell (a :class:`~nblaunch.ranks.cell.CellTask`) on the pool.

        Each rank runs the cell in its namespace (:func:`nblaunch.ranks.namespace.rank_namespace`),
        so names persist between cells.

        Parameters
        ----------
        task
            The cell, from :func:`nblaunch.notebook.magics.prepare_cell`.
        ranks
            ``--ranks``: ``"0"``, ``"0,2"``, ``"1-3"`` (default: every rank). The lowest chosen
            rank's last expression and ``-o`` values come back.
        timeout, hang_timeout
            As for ``%%distributed``; ``hang_timeout`` defaults to the pool's.
        background
            ``%%distributed --bg``: return a ``RunHandle`` at once (see ``run_payload``).

        Returns
        -------
        list or RunHandle
            One entry per rank (``None`` where the cell did not run), or its handle.
        """
        chosen = None if ranks is None else parse_ranks(ranks, self.world_size)
        if chosen is not None:
            task.main_rank = chosen[0]
        self.transport.last_failed_rank = None  # each cell forgets the previous cell's failure
        payload = serialize_payload(namespace.run_cell, (task,))
        values = self.run_payload(
            payload,
            ranks=chosen,
            description=describe_cell(getattr(task, "source", "")),
            display=display,
            timeout=timeout,
            hang_timeout=hang_timeout,
            background=background,
        )
        by_rank = spread_by_rank(chosen, self.world_size)
        if background:
            values.finish = by_rank
            return values
        return by_rank(values)
