"""nblaunch: run distributed PyTorch from a Jupyter notebook, and see what every rank does."""

from nblaunch.errors import (
    DistributedHangError,
    DistributedOperationException,
    LaunchError,
    LaunchTimeoutError,
    NblaunchError,
    RankFailedError,
)
from nblaunch.launcher import debug_launcher, notebook_launcher
from nblaunch.worker import device, is_main_process, local_rank, rank, wait_for_everyone, world_size

__version__ = "0.1.0"

__all__ = [
    "DistributedHangError",
    "DistributedOperationException",
    "LaunchError",
    "LaunchTimeoutError",
    "NblaunchError",
    "RankFailedError",
    "debug_launcher",
    "device",
    "is_main_process",
    "local_rank",
    "notebook_launcher",
    "rank",
    "wait_for_everyone",
    "world_size",
]


def load_ipython_extension(ipython):
    """``%load_ext nblaunch``: register the ``%%distributed`` and ``%dist`` magics."""
    from nblaunch.magics import register

    register(ipython)


def unload_ipython_extension(ipython):
    from nblaunch.magics import unregister

    unregister(ipython)
