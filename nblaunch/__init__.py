"""nblaunch: run distributed PyTorch from a Jupyter notebook, and see what every rank does."""

from nblaunch.engine.metrics_files import load_metrics
from nblaunch.engine.supervisor import warm_up_if_interactive
from nblaunch.errors import (
    AuthenticationError,
    DistributedHangError,
    DistributedOperationException,
    LaunchError,
    LaunchTimeoutError,
    NblaunchError,
    NoExecutableBatchSizeError,
    RankFailedError,
    RendezvousTimeoutError,
)
from nblaunch.notebook.launcher import debug_launcher, notebook_launcher
from nblaunch.notebook.pool import Pool, start_pool
from nblaunch.ranks.batch_size import find_executable_batch_size
from nblaunch.ranks.debugger import breakpoint
from nblaunch.ranks.logging import get_logger
from nblaunch.ranks.memory import free_memory, per_device_batch_size, set_seed
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
from nblaunch.ranks.trigger import check_trigger, set_trigger
from nblaunch.ranks.worker import (
    device,
    is_main_process,
    local_rank,
    rank,
    wait_for_everyone,
    world_size,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "DistributedHangError",
    "DistributedOperationException",
    "LaunchError",
    "LaunchTimeoutError",
    "NblaunchError",
    "NoExecutableBatchSizeError",
    "Pool",
    "RankFailedError",
    "RendezvousTimeoutError",
    "all_reduce",
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
    "set_seed",
    "set_trigger",
    "start_pool",
    "wait_for_everyone",
    "world_size",
]


def load_ipython_extension(ipython):
    """``%load_ext nblaunch``: register the ``%%distributed`` and ``%dist`` magics."""
    from nblaunch.notebook.magics import register

    register(ipython)
    warm_up_if_interactive()


def unload_ipython_extension(ipython):
    from nblaunch.notebook.magics import unregister

    unregister(ipython)


# In a notebook, the first launch should not wait for the ranks' forkserver to import torch.
warm_up_if_interactive()
