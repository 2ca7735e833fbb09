"""What a :class:`~nblaunch.notebook.pool.Pool` drives, and making it: the pool's engine in this
process, or a client of a detached pool's host."""

from __future__ import annotations

from typing import Any, Protocol

from nblaunch.engine.clock import REAL_CLOCK, Clock
from nblaunch.engine.pool.pool_engine import PoolEngine
from nblaunch.engine.processes.backend import BackendFactory, ProcessBackend
from nblaunch.errors import LaunchError
from nblaunch.events import EventSink, Lifecycle
from nblaunch.notebook.pool_detached import DEFAULT_IDLE_LIMIT_S, HostPool
from nblaunch.options import LaunchOptions, NodeOptions

_MULTI_NODE = (
    "num_nodes",
    "rdzv_endpoint",
    "rdzv_timeout",
    "rdzv_id",
    "start_nodes",
    "hostfile",
    "cluster",
)


class PoolTransport(Protocol):
    """What a :class:`Pool` drives: the pool's engine in this process
    (:class:`~nblaunch.engine.pool.pool_engine.PoolEngine`), or a client of a detached pool's
    host (:class:`~nblaunch.notebook.pool_detached.HostPool`)."""

    detached: bool  # the ranks live under a host of their own and outlive this kernel
    state: Lifecycle
    problem: str
    num_processes: int | None
    options: LaunchOptions
    nodes: Any
    engine: Any  # the ranks' Run, in this process only
    start_s: float
    started_at: float
    restarts: int
    tasks_run: int
    current_task: str
    last_failed_rank: int | None

    @property
    def world_size(self) -> int: ...

    @property
    def pids(self) -> list[int | None]: ...

    def start(self) -> Any: ...

    def close(self) -> None: ...

    def restart(self, num_nodes: int | None = None) -> Any: ...

    def task_ranks(self, ranks: list[int] | None) -> list[int]: ...

    def run_task(
        self,
        payload: bytes,
        task_ranks: list[int],
        view: EventSink,
        description: str,
        timeout: float | None,
        hang_timeout: float | None,
    ) -> list[Any]: ...

    def describe(self) -> str: ...

    def status(self) -> list[dict[str, Any]]: ...

    def status_text(self) -> str: ...


def make_transport(
    num_processes: int | None,
    options: LaunchOptions,
    node_args: tuple[Any, ...],
    start_timeout: float,
    backend: BackendFactory,
    clock: Clock,
    detach: bool,
    idle_limit: float | None,
) -> PoolTransport:
    """The engine of a pool of this kernel's own (on several machines with ``node_args``: the
    multi-node options, :data:`_MULTI_NODE`), or the client of a detached pool's host.

    Raises
    ------
    LaunchError
        Options that do not go together.
    """
    if detach:
        given = [name for name, v in zip(_MULTI_NODE, node_args, strict=True) if v is not None]
        if given or backend is not ProcessBackend or clock is not REAL_CLOCK:
            raise LaunchError(
                f"a detached pool runs on this machine, with real processes: leave out "
                f"{', '.join(given) or 'backend/clock'}"
            )
        limit = DEFAULT_IDLE_LIMIT_S if idle_limit is None else idle_limit
        return HostPool(num_processes, options, start_timeout, limit)
    if idle_limit is not None:
        raise LaunchError("idle_limit= is for detached pools: add detach=True")
    nodes = None
    num_nodes, endpoint, timeout, run_id, start_nodes, hostfile, cluster = node_args
    if cluster is not None:
        from nblaunch.cluster.placement import placed_by  # not at import: ~10 ms, rarely used

        endpoint, start_nodes, num_nodes, cluster = placed_by(
            cluster, num_nodes, start_nodes, endpoint
        )
    if num_nodes is not None:
        from nblaunch.cluster.pool_nodes import PoolNodes  # not at import: ~10 ms

        node_options = NodeOptions(num_nodes, endpoint, timeout, run_id, start_nodes, hostfile)
        nodes = PoolNodes(node_options.replace(cluster=cluster))
    return PoolEngine(num_processes, options, nodes, start_timeout, backend, clock)
