"""A rank's accelerator: the plug-in modules it imports, its one device, pinned, and the
process-group backend for it.

Every accelerator torch knows goes the same way. The device type is what the launch names
(``"cuda"``, ``"xpu"``, ``"npu"``, ``"hpu"``, ``"mps"``, or a PrivateUse1 name a plug-in
registered); each rank owns the device of its ``LOCAL_RANK``, pinned with
``torch.accelerator.set_device_index`` (or, for a device that only Python registered, its device
module's ``set_device``) before user code runs; the backend is torch.distributed's default for
the device type (``Backend.default_device_backend_map``: NCCL, XCCL, HCCL, ...), with gloo for
CPU tensors. XLA devices set up their runtime first (:mod:`nblaunch.ranks.device.xla`).

Plug-ins that are not loaded by torch on their own (``torch_npu``, ``habana_frameworks.torch``, a
test accelerator) are named in ``NBLAUNCH_DEVICE_MODULES``: every rank, and the probe that counts
devices for the notebook (:func:`probe`), imports them before anything else touches torch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any

from nblaunch.errors import add_note

# Comma-separated modules each rank imports before it picks its device (accelerator plug-ins).
MODULES_ENV = "NBLAUNCH_DEVICE_MODULES"


def import_device_modules() -> list[str]:
    """Import the modules ``NBLAUNCH_DEVICE_MODULES`` names; return their names.

    Raises
    ------
    ImportError
        A named module cannot be imported; the note names the variable.
    """
    names = [n.strip() for n in os.environ.get(MODULES_ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            add_note(
                exc,
                f"nblaunch: {MODULES_ENV}={os.environ[MODULES_ENV]!r} names {name!r}, which this "
                "rank cannot import; install it, or take it out of the variable.",
            )
            raise
    return names


def device_module(device_type: str) -> Any:
    """torch's module for ``device_type`` (``torch.cuda``, ``torch.xpu``, a plug-in's), or None."""
    import torch

    return getattr(torch, device_type, None)


def _current_accelerator(device_type: str) -> bool:
    """Whether ``torch.accelerator`` speaks for ``device_type`` in this process."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return False
    try:
        current = accelerator.current_accelerator()
    except RuntimeError:
        return False
    return current is not None and current.type == device_type


def device_count(device_type: str) -> int:
    """How many ``device_type`` devices this process sees (0 when torch knows none)."""
    import torch

    if _current_accelerator(device_type):
        return int(torch.accelerator.device_count())
    module = device_module(device_type)
    count = getattr(module, "device_count", None)
    return int(count()) if callable(count) else 0


def pin(device_type: str, local_rank: int) -> Any:
    """Make device ``local_rank`` of ``device_type`` this process's current device; return it.

    Raises
    ------
    RuntimeError
        There is no such device here, naming how many there are.
    """
    import torch

    count = device_count(device_type)
    if local_rank >= count:
        raise RuntimeError(
            f"rank with LOCAL_RANK={local_rank} needs {device_type}:{local_rank}, but this "
            f"process sees {count} {device_type} device(s); launch at most {count} ranks"
        )
    pinned = False
    if _current_accelerator(device_type):
        try:
            torch.accelerator.set_device_index(local_rank)
            pinned = True
        except RuntimeError:
            pass  # a device registered from Python only: torch's C++ side does not know it
    if not pinned:
        set_device = getattr(device_module(device_type), "set_device", None)
        if set_device is None:
            raise RuntimeError(
                f"cannot pin {device_type}:{local_rank}: torch.accelerator does not know "
                f"{device_type!r} and torch.{device_type} has no set_device"
            )
        set_device(local_rank)
    return torch.device(device_type, local_rank)


def default_backend(device_type: str) -> str:
    """The process-group backend for ranks on ``device_type``: torch.distributed's default for
    the device, with gloo for CPU tensors (``"cpu:gloo,xpu:xccl"``); gloo alone when torch has
    none for the device (MPS: a single device)."""
    from torch.distributed.distributed_c10d import Backend

    if device_type == "cuda":
        return "nccl"  # as nblaunch always did: NCCL's own default map covers CUDA only
    backend = Backend.default_device_backend_map.get(device_type)
    if backend is None or backend == "gloo":
        return "gloo"
    return f"cpu:gloo,{device_type}:{backend}"


def peak_memory_bytes(device: Any) -> int | None:
    """The most memory tensors held on ``device`` so far, where its module tells."""
    module = device_module(device.type)
    peak = getattr(module, "max_memory_allocated", None)
    if peak is None:
        return None
    try:
        return int(peak(device))
    except Exception:  # a plug-in that does not count, or takes no device argument
        return None


def allocated_bytes(device: Any) -> int | None:
    """Memory tensors hold on ``device`` now, where its module tells."""
    module = device_module(device.type)
    allocated = getattr(module, "memory_allocated", None)
    if allocated is None:
        return None
    try:
        return int(allocated(device))
    except Exception:
        return None


def probe(device_type: str | None, env: dict[str, str], sys_path: list[str], conn: Any) -> None:
    """Count devices for the notebook, in a child of the forkserver (the notebook does not
    import torch to launch): take the notebook's ``env`` and ``sys_path`` (the forkserver's
    are from when it started), import the plug-ins, then send ``(type, count, name, backend)``
    or ``("error", 0, message, "")`` down ``conn``. ``device_type=None`` asks for the current
    accelerator, if any."""
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = sys_path
        import_device_modules()
        import torch

        if device_type is None:
            accelerator = getattr(torch, "accelerator", None)
            current = accelerator.current_accelerator() if accelerator is not None else None
            device_type = current.type if current is not None else "cpu"
        count = device_count(device_type) if device_type != "cpu" else 0
        name = device_type.upper()
        get_name = getattr(device_module(device_type), "get_device_name", None)
        if count and get_name is not None:
            with contextlib.suppress(Exception):
                name = str(get_name(0))
        conn.send((device_type, count, name, default_backend(device_type)))
    except BaseException as exc:  # reported to the notebook as a LaunchError
        conn.send(("error", 0, f"{type(exc).__name__}: {exc}", ""))
    finally:
        conn.close()
