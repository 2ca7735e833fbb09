"""What ``%dist status`` and a busy pool's messages say about a pool.

The pool's methods of the same names call these with what they need to know
(:class:`PoolFacts`, a protocol of this module's own: the pool engine imports this module, never
the other way round).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from nblaunch.engine.run.run import Run
from nblaunch.events import Lifecycle


class PoolFacts(Protocol):
    """What the status of a pool is made from."""

    state: Lifecycle
    problem: str
    engine: Run | None
    nodes: Any
    current_task: str
    started_at: float
    tasks_run: int
    last_task: str
    restarts: int

    @property
    def pids(self) -> list[int | None]: ...

    @property
    def world_size(self) -> int: ...

    def describe(self) -> str: ...


def describe(pool: PoolFacts) -> str:
    """One line: how many ranks, on what, which processes, in what state."""
    if pool.engine is None:
        return f"a pool ({pool.state.value})"
    plan = pool.engine.plan
    pids = ", ".join(str(p) for p in pool.pids)
    nodes = pids_here = ""
    if pool.nodes is not None:
        nodes, pids_here = f" on {plan.num_nodes} nodes", " here"
    text = (
        f"a pool of {plan.world_size} {plan.device_kind} rank(s){nodes} "
        f"({plan.start_method}{', debug' if plan.debug else ''}; pids{pids_here} {pids}), "
        f"{pool.state.value}"
    )
    if pool.state is Lifecycle.BUSY:
        text += f" running {pool.current_task}"
    if pool.state is Lifecycle.BROKEN:
        text += f": {pool.problem}"
    return text


def status(pool: PoolFacts, rank_info: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rank: pid, alive, state, memory (RSS; device memory on GPUs), and what the
    ranks answered (``rank_info``: device memory, the names earlier cells defined)."""
    import psutil

    rows: list[dict[str, Any]] = []
    if pool.engine is None or pool.state is Lifecycle.CLOSED:
        return rows
    local = {process.rank: process.pid for process in pool.engine.backend.ranks}
    for rank in range(pool.world_size):
        info = rank_info.get(rank, {})
        row: dict[str, Any] = {"rank": rank, "pid": local.get(rank), "alive": False}
        if rank in local:
            with contextlib.suppress(psutil.Error, ValueError, TypeError):
                process = psutil.Process(row["pid"])
                row["alive"] = process.status() != psutil.STATUS_ZOMBIE
                row["rss_mb"] = process.memory_info().rss / 2**20
        else:  # another node's: alive if it answered just now
            row["alive"] = "pid" in info
        if pool.nodes is not None:
            row["node"] = node = rank // pool.engine.plan.nproc_per_node
            row["host"] = pool.engine.host_of(node)
        if not row["alive"]:
            row["state"] = "dead"
        else:
            row["state"] = "idle" if pool.state is Lifecycle.IDLE else pool.state.value
        row.update(info)
        rows.append(row)
    return rows


def status_text(pool: PoolFacts, rows: list[dict[str, Any]]) -> str:
    """What ``%dist status`` prints, with the rows of :func:`status`."""
    if pool.state is Lifecycle.CLOSED:
        return "nblaunch pool: stopped; %dist start -n N starts one"
    lines = [f"nblaunch pool: {pool.describe()}, up {_seconds(time.time() - pool.started_at)}"]
    lines.append(
        f"  cells run: {pool.tasks_run}; last: {pool.last_task or 'none'}; "
        f"restarts: {pool.restarts}; logs in {pool.engine.plan.run_dir}"
    )
    for row in rows:
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
    if pool.state is Lifecycle.BROKEN:
        lines.append("  run %dist restart for fresh ranks, or %dist stop")
    return "\n".join(lines)


def _seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
