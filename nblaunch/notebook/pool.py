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
the end of a task :mod:`nblaunch.engine.pool.task_end`; this module adds what a person runs and
sees.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

from nblaunch import pickling
from nblaunch.engine.background.background_run import BackgroundTask
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.clock import REAL_CLOCK, Clock
from nblaunch.engine.plan.launch_plan import serialize_payload
from nblaunch.engine.pool.pool_engine import (  # noqa: F401  (importable from here too)
    START_TIMEOUT_S,
    PoolRanks,
    current_pool,
    refuse_if_running,
)
from nblaunch.engine.pool.status import PoolState
from nblaunch.engine.processes.backend import BackendFactory, ProcessBackend
from nblaunch.errors import LaunchError
from nblaunch.events import EventSink
from nblaunch.options import DEFAULT_HANG_TIMEOUT_S, LaunchOptions, NodeOptions
from nblaunch.ranks import namespace


class Pool(PoolRanks):
    """Ranks that stay alive between tasks, with their namespaces and process group.

    Create it with :func:`start_pool` (or ``Pool(...).start()``, or ``with Pool(...) as pool``).
    The parameters mean what they mean for :func:`~nblaunch.notebook_launcher`; ``display`` is
    the view every task shows.

    With ``num_nodes``, the pool spans that many machines: ``num_processes`` ranks on each,
    this one first; each other node runs ``python -m nblaunch join`` once (the command is
    printed), and stays in the pool across its restarts until the pool is closed; or the
    pool starts them itself with ``start_nodes`` (``"ssh"`` with ``hostfile``, ``"srun"``).

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
        backend: BackendFactory = ProcessBackend,
        clock: Clock = REAL_CLOCK,
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
        nodes = None
        if num_nodes is not None:
            from nblaunch.cluster.pool_nodes import PoolNodes  # not at import: ~10 ms

            nodes = PoolNodes(
                NodeOptions(num_nodes, rdzv_endpoint, rdzv_timeout, rdzv_id, start_nodes, hostfile)
            )
        super().__init__(num_processes, options, nodes, display, start_timeout, backend, clock)

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

        As :meth:`PoolRanks.run_payload <nblaunch.engine.pool.pool_engine.PoolRanks.run_payload>`,
        shown in a view of this cell:

        Parameters
        ----------
        display
            The view for this task (default: the pool's), unless ``view`` is given.
        background
            Return a :class:`~nblaunch.notebook.handle.RunHandle` at once and run the task in a
            thread; the pool is busy (a cell on it says so) until the task ends, and
            ``handle.stop()`` interrupts it as the interrupt button would, keeping the names.
        """
        from nblaunch.notebook.views import choose_view  # not at import: ~13 ms

        task_ranks = self.task_ranks(ranks)
        mode = display or self.display
        hang_timeout = self.options.hang_timeout if hang_timeout is None else hang_timeout
        if background:
            return _task_in_background(
                self, payload, task_ranks, mode, description, timeout, hang_timeout
            )
        if view is None:
            view = choose_view(mode, defer="always")
        return self.run_task(payload, task_ranks, view, description, timeout, hang_timeout)

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
        self.pushed.pop(name, None)
        try:
            payload = pickling.dumps((namespace.push_value, (name, value), {}))
        except Exception as exc:
            raise LaunchError(
                f"{name} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                f"sent to the ranks: {type(exc).__name__}: {exc}. Make it on the ranks, in a "
                "%%distributed cell, instead."
            ) from None
        self.run_payload(payload, ranks=chosen, description=f"push {name}", display="none")
        if chosen is None:  # every rank holds it now: cells need not send it again
            with contextlib.suppress(TypeError):  # a value without weak references is small
                self.pushed[name] = weakref.ref(value)

    def pinned_names(self, user_ns: dict[str, Any]) -> set[str]:
        """The notebook names whose value every rank already holds, pushed (``%dist push``) and
        not rebound since: a cell reading them does not send them again. Pushing is a copy:
        a change made to the notebook's object in place after the push stays in the notebook."""
        return {
            name
            for name, pushed in self.pushed.items()
            if name in user_ns and pushed() is user_ns[name]
        }

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
            One entry per rank of the pool; ``None`` for ranks the cell did not run on (with
            ``background``, what the handle's ``result()`` returns).
        """
        chosen = None if ranks is None else parse_ranks(ranks, self.world_size)
        if chosen is not None:
            task.main_rank = chosen[0]
        self.last_failed_rank = None  # each cell's ranks forget the previous cell's failure
        payload = serialize_payload(namespace.run_cell, (task,))
        values = self.run_payload(
            payload,
            ranks=chosen,
            description=_describe_cell(getattr(task, "source", "")),
            display=display,
            timeout=timeout,
            hang_timeout=hang_timeout,
            background=background,
        )
        world_size = self.world_size

        def by_rank(values: list[Any]) -> list[Any]:
            spread: list[Any] = [None] * world_size
            for rank, value in zip(chosen or range(world_size), values, strict=True):
                spread[rank] = value
            return spread

        if background:
            values.finish = by_rank
            return values
        return by_rank(values)


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


def _describe_cell(source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return "cell: " + (first if len(first) <= 60 else first[:57] + "...")


def _describe_function(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def _task_in_background(
    pool: Pool,
    payload: bytes,
    task_ranks: list[int],
    display: str,
    description: str,
    timeout: float | None,
    hang_timeout: float | None,
) -> Any:
    """A pool's task on a thread (``run_payload(background=True)``); returns its handle."""
    from nblaunch.notebook.handle import RunHandle, remember

    run = pool.engine
    hub = EventHub()
    pool.state = PoolState.BUSY  # from now: no other cell slips in before the thread starts
    pool.current_task = description or "a task"
    # The header now, while the cell runs: the view is built in it.
    hub.handle(run.plan.run_info(time.time(), warnings=[], notes=[]))
    task = BackgroundTask(
        hub,
        f"{run.plan.run_id}-task{pool.task_id + 1}",
        run.plan.run_dir,
        lambda: pool.run_task(payload, task_ranks, hub, description, timeout, hang_timeout),
        run.request_stop,
    )
    handle = RunHandle(task)
    if display != "none":
        handle.view(display)
    pool.background = task
    task.start()
    return remember(handle)
