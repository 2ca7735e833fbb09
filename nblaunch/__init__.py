"""nblaunch: run distributed PyTorch from a Jupyter notebook, and see what every rank does.

The names a rank uses are imported here; the front ends (``notebook_launcher``, ``Pool``, ...)
when first used, so a rank process, which imports this package too, never loads the notebook's.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from nblaunch.errors import (
    AuthenticationError,
    DistributedHangError,
    DistributedOperationException,
    LaunchError,
    LaunchTimeoutError,
    NblaunchError,
    NoExecutableBatchSizeError,
    PoolRestartedError,
    RankFailedError,
    RendezvousTimeoutError,
    RunStoppedError,
)
from nblaunch.ranks.debugger import breakpoint
from nblaunch.ranks.logging import get_logger
from nblaunch.ranks.memory.batch_size import find_executable_batch_size
from nblaunch.ranks.memory.memory import free_memory, per_device_batch_size, set_seed
from nblaunch.ranks.metrics import log_metrics
from nblaunch.ranks.ops import (
    all_reduce,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from nblaunch.ranks.this_rank import (
    device,
    is_main_process,
    local_rank,
    rank,
    wait_for_everyone,
    world_size,
)
from nblaunch.ranks.trigger import check_trigger, set_trigger

if TYPE_CHECKING:
    from nblaunch.cluster.ray_nodes import RayCluster
    from nblaunch.cluster.slurm_nodes import SlurmCluster
    from nblaunch.engine.output.metrics_files import load_metrics
    from nblaunch.notebook.handle import RunHandle, attach, runs
    from nblaunch.notebook.launcher import debug_launcher, notebook_launcher
    from nblaunch.notebook.pool import Pool
    from nblaunch.notebook.pool_start import attach_pool, start_pool

__version__ = "0.1.0"

# The notebook's names, imported when first used: name -> module.
_FRONT_ENDS = {
    "notebook_launcher": "nblaunch.notebook.launcher",
    "debug_launcher": "nblaunch.notebook.launcher",
    "Pool": "nblaunch.notebook.pool",
    "start_pool": "nblaunch.notebook.pool_start",
    "load_metrics": "nblaunch.engine.output.metrics_files",
    "RunHandle": "nblaunch.notebook.handle",
    "runs": "nblaunch.notebook.handle",
    "attach": "nblaunch.notebook.handle",
    "attach_pool": "nblaunch.notebook.pool_start",
    "RayCluster": "nblaunch.cluster.ray_nodes",
    "SlurmCluster": "nblaunch.cluster.slurm_nodes",
}


def __getattr__(name: str) -> Any:
    module = _FRONT_ENDS.get(name)
    if module is None:
        raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FRONT_ENDS})


__all__ = [
    "AuthenticationError",
    "DistributedHangError",
    "DistributedOperationException",
    "LaunchError",
    "LaunchTimeoutError",
    "NblaunchError",
    "NoExecutableBatchSizeError",
    "Pool",
    "PoolRestartedError",
    "RankFailedError",
    "RayCluster",
    "RendezvousTimeoutError",
    "RunHandle",
    "RunStoppedError",
    "SlurmCluster",
    "all_reduce",
    "attach",
    "attach_pool",
    "breakpoint",
    "broadcast",
    "broadcast_object_list",
    "check_trigger",
    "debug_launcher",
    "device",
    "find_executable_batch_size",
    "free_memory",
    "gather",
    "gather_object",
    "get_logger",
    "is_main_process",
    "load_metrics",
    "local_rank",
    "log_metrics",
    "notebook_launcher",
    "pad_across_processes",
    "per_device_batch_size",
    "rank",
    "reduce",
    "runs",
    "set_seed",
    "set_trigger",
    "start_pool",
    "wait_for_everyone",
    "world_size",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nblaunch``: register the ``%%distributed`` and ``%dist`` magics."""
    from nblaunch.engine.processes.supervisor import warm_up_if_interactive
    from nblaunch.notebook.magics import register

    register(ipython)
    warm_up_if_interactive()


def unload_ipython_extension(ipython: Any) -> None:
    from nblaunch.notebook.magics import unregister

    unregister(ipython)


# In a notebook, the first launch should not wait for the ranks' forkserver to import torch, and
# the front ends are wanted anyway. Ranks, scripts and torchrun import only what they use.
if "IPython" in sys.modules:
    from nblaunch.engine.processes.supervisor import warm_up_if_interactive
    from nblaunch.notebook import launcher as _launcher
    from nblaunch.notebook import pool as _pool
    from nblaunch.notebook import pool_start as _pool_start

    notebook_launcher, debug_launcher = _launcher.notebook_launcher, _launcher.debug_launcher
    Pool, start_pool = _pool.Pool, _pool_start.start_pool
    warm_up_if_interactive()
