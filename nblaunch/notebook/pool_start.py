"""``start_pool`` and ``attach_pool``: the pool a person gets, one of this kernel's or a detached
one (:class:`~nblaunch.notebook.pool.Pool`, driving the engine here or a detached pool's host).
"""

from __future__ import annotations

from typing import Any

from nblaunch.errors import LaunchError
from nblaunch.events import Lifecycle
from nblaunch.notebook.pool import Pool, current_pool
from nblaunch.notebook.pool_detached import HostPool


def start_pool(num_processes: int | None = None, *, detach: bool = False, **options: Any) -> Pool:
    """Start ``num_processes`` ranks that stay alive until :meth:`Pool.close`.

    With ``detach=True`` the ranks live under a run host of their own and outlive the kernel
    (a restart, a crash): ``nblaunch.attach_pool()`` connects a new kernel to them, names and
    all (see :mod:`nblaunch.notebook.pool_detached`; ``idle_limit=`` seconds, default 24 h).

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
    return Pool(num_processes, detach=detach, **options).start()


def attach_pool(run_id: str | None = None, take_over: bool = False) -> Pool:
    """Connect this kernel to a detached pool (default: the newest one running); its ranks keep
    the names earlier cells defined, and ``%%distributed`` cells run on it again. While another
    kernel drives it, this is refused unless ``take_over=True`` (that kernel is then told).

    Raises
    ------
    LaunchError
        No detached pool is running (the message lists the detached runs), or this kernel
        runs a pool of its own.
    """
    current = current_pool()
    if current is not None:
        if current.transport.detached and current.state is not Lifecycle.CLOSED:
            return current
        raise LaunchError(f"a pool is already running here: {current.describe()}")
    pool = Pool(transport=HostPool.attach(run_id, take_over))
    pool.make_current()
    return pool
