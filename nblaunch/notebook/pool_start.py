"""``start_pool``: which pool a person gets, one of this kernel's or a detached one.

Above both kinds (:mod:`nblaunch.notebook.pool`, :mod:`nblaunch.notebook.pool_detached`), so
that neither imports the other's module to choose.
"""

from __future__ import annotations

from typing import Any

from nblaunch.errors import LaunchError
from nblaunch.notebook.pool import Pool
from nblaunch.notebook.pool_detached import DetachedPool


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
    if detach:
        return DetachedPool(num_processes, **options).start()
    if "idle_limit" in options:
        raise LaunchError("idle_limit= is for detached pools: add detach=True")
    return Pool(num_processes, **options).start()
