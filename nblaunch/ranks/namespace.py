"""A pool rank's side: the namespace its cells run in, and the small tasks the pool sends it.

A persistent pool (:mod:`nblaunch.notebook.pool`) sends these functions as tasks, pickled by
reference, so they live here, in the package a rank imports, not with the pool in the notebook.
"""

from __future__ import annotations

import os
from typing import Any

from nblaunch.ranks import debugger, this_rank
from nblaunch.ranks.cell import INJECTED_NAMES, to_notebook

# Inside a rank: the namespace %%distributed cells run in; it persists between tasks.
_namespace: dict[str, Any] = {}


def rank_namespace() -> dict[str, Any]:
    """The namespace pool cells run in on this rank; it outlives each cell.

    In the notebook process this is an unused, empty dictionary.
    """
    return _namespace


def run_cell(task: Any) -> Any:
    """Run a ``%%distributed`` cell in the namespace this rank keeps between cells."""
    debugger.forget_failure()  # %dist debug opens the last cell's failure
    return task(_namespace)


def rank_info() -> dict[str, Any]:
    """For ``%dist status``: this rank's memory and the names cells defined."""
    import psutil
    import torch

    context = this_rank.current()
    device = context.device if context else torch.device("cpu")
    info: dict[str, Any] = {
        "device": str(device),
        "device_mb": None,
        "pid": os.getpid(),
        "rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    if device.type not in ("cpu", "xla"):
        from nblaunch.ranks.device import devices

        allocated = devices.allocated_bytes(device)
        info["device_mb"] = None if allocated is None else allocated / 2**20
    info["names"] = sorted(
        name for name in _namespace if not name.startswith("_") and name not in INJECTED_NAMES
    )
    return info


def pull_value(name: str) -> Any:
    """The value of ``name`` in this rank's namespace, ready for the notebook."""
    if name not in _namespace:
        defined = ", ".join(n for n in sorted(_namespace) if not n.startswith("_")) or "none"
        raise NameError(f"rank {this_rank.rank()} has no name {name!r} (its names: {defined})")
    return to_notebook(_namespace[name])


def push_value(name: str, value: Any) -> None:
    """Bind ``name`` in this rank's namespace, as a cell assigning it would."""
    _namespace[name] = value


def post_mortem() -> None:
    """Open the debugger at the last cell's failure on this rank (``%dist debug``)."""
    debugger.post_mortem_last()
