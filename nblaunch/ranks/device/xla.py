"""An XLA rank: its PJRT runtime, its device, and the function on each of its cores.

The notebook put the runtime's layout in the rank's environment (:mod:`nblaunch.engine.plan.xla`):
which chip is this rank's, where the other ranks' runtimes listen. Here the runtime starts on it
(:func:`set_up`), before user code runs, so ``nblaunch.device()`` and ``torch_xla.device()`` are
this rank's chip. On TPUs the default group is torch_xla's: ``init_method="xla://"``, backend
``"xla"``, meeting on nblaunch's store as under torchrun's agent (:func:`use_launcher_store`).

A v2 or v3 chip has two cores, each an XLA device: like torch_xla, the rank runs the function on
each core in a thread of its own (:func:`call_on_each_core`), and its value is the list of the
cores' values.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any


def set_up() -> tuple[Any, str]:
    """Start this process's XLA runtime; return its device and what the view's badge says.

    Raises
    ------
    ImportError
        torch_xla is not installed in the rank's Python.
    """
    import torch_xla  # type: ignore[import-not-found]
    import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

    # Registers the "xla" backend and the xla:// rendezvous with torch.distributed.
    import torch_xla.distributed.xla_backend  # type: ignore[import-not-found]

    device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
    if os.environ.get("PJRT_DEVICE", "").upper() != "TPU":
        return device, f"{device} · XLA {os.environ.get('PJRT_DEVICE', 'CPU').upper()}"
    badge = f"{device} · TPU chip {os.environ.get('TPU_VISIBLE_CHIPS', '?')}"
    cores = len(local_devices())
    if cores > 1:
        badge += f" ({cores} cores)"
    return device, badge


def local_devices() -> list[Any]:
    """The XLA devices this process owns (two per chip on v2/v3, else one)."""
    import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

    return list(xm.get_xla_supported_devices())


def use_launcher_store() -> None:
    """Let torch_xla's ``xla://`` rendezvous meet on nblaunch's store.

    Rank 0 already listens on ``MASTER_PORT``; told that an agent hosts the store (as torchrun's
    does), torch_xla connects to it as a client instead of starting a second server there.
    """
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"


def call_on_each_core(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``function(*args, **kwargs)`` on each of this process's XLA devices, as torch_xla runs
    a process's cores: one thread each, that thread's default device set to its core. Returns
    the value alone on a one-core chip, else the list of the cores' values in core order.

    The first exception a core raises is raised here.
    """
    devices = local_devices()
    if len(devices) < 2:
        return function(*args, **kwargs)
    import torch_xla  # type: ignore[import-not-found]
    import torch_xla.runtime as xr  # type: ignore[import-not-found]

    def on_core(device: Any) -> Any:
        torch_xla._XLAC._xla_set_default_device(device)
        init = getattr(xr, "_init_world_size_ordinal", None)
        if init is not None:  # world size and ordinal are per thread (torch_xla's note)
            init()
        return function(*args, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(devices)) as pool:
        return list(pool.map(on_core, devices))
