"""Recognising out-of-memory errors, freeing memory, and the reproducibility helpers.

:func:`is_out_of_memory` recognises an out-of-memory error from any device; :func:`free_memory`
drops references and empties the device caches; :func:`set_seed` seeds every generator;
:func:`per_device_batch_size` divides a global batch size over the ranks. The search for a batch
size that fits (:func:`~nblaunch.ranks.memory.batch_size.find_executable_batch_size`) is in
:mod:`nblaunch.ranks.memory.batch_size`.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
from typing import Any

from nblaunch.ranks import this_rank

# Text of out-of-memory errors that do not come as torch.OutOfMemoryError.
OOM_MESSAGES = (
    "CUDA out of memory",  # the CUDA caching allocator (older torch: plain RuntimeError)
    "CUDA error: out of memory",  # a CUDA call outside the caching allocator
    "HIP out of memory",  # ROCm
    "XPU out of memory",  # Intel GPUs
    "NPU out of memory",  # Ascend (torch_npu)
    "MPS backend out of memory",  # Apple GPUs
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN fails this way when its workspace does not fit
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  # CPU tensors, Linux/macOS
    "DefaultCPUAllocator: not enough memory",  # CPU tensors, Windows
    "can NOT allocate memory block with size larger than",  # Intel GPUs, per-block limit
    "HPU out of memory",  # Habana Gaudi
    "RESOURCE_EXHAUSTED: Out of memory",  # XLA (TPU HBM)
)


# --- recognising out-of-memory -------------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` (or the exception it was raised ``from``) means memory ran out.

    Recognises ``torch.OutOfMemoryError``, Python's ``MemoryError``, and the messages of CUDA,
    ROCm, cuDNN/cuBLAS allocation failures, the CPU allocator, XPU, NPU and MPS.
    """
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if _is_out_of_memory_one(current):
            return True
        current = current.__cause__  # a library may wrap the OOM: `raise X from oom`
        seen += 1
    return False


def _is_out_of_memory_one(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if not isinstance(exc, Exception):
        return False
    text = str(exc)
    context = this_rank.current()
    # A plug-in's allocator says so in torch's words: "<TYPE> out of memory".
    kind = context.device.type if context is not None else "cpu"
    if kind not in ("cpu", "cuda") and f"{kind.upper()} out of memory" in text:
        return True
    return any(message in text for message in OOM_MESSAGES)


# --- memory and reproducibility helpers ----------------------------------------------------------


def free_memory(*objects: Any) -> list[None]:
    """Drop references, collect garbage and empty the device caches.

    Use it as ``model, optimizer = free_memory(model, optimizer)``: the returned ``None``\\ s
    replace your names, so nothing keeps the objects alive once the caches are emptied.

    Returns
    -------
    list
        One ``None`` per object passed.
    """
    count = len(objects)
    del objects
    gc.collect()
    empty_device_caches()
    return [None] * count


def empty_device_caches() -> None:
    """Give cached, unused device memory back to the device (CUDA, XPU, NPU, MPS, this rank's
    accelerator when its device module can)."""
    torch = sys.modules.get("torch")
    if torch is None:  # nothing was ever allocated through torch
        return
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    context = this_rank.current()
    names = ["xpu", "npu", "mps"]
    if context is not None and context.device.type not in ("cpu", "cuda", "xla", *names):
        names.append(context.device.type)  # a plug-in's (hpu, a PrivateUse1 name)
    for name in names:
        backend = getattr(torch, name, None)
        with contextlib.suppress(Exception):
            if backend is not None and backend.is_available():
                backend.empty_cache()


def set_seed(seed: int, device_specific: bool = False) -> int:
    """Seed Python's, NumPy's and torch's generators (CPU and every device).

    Parameters
    ----------
    seed
        The seed.
    device_specific
        Add the rank to the seed, so ranks draw different numbers (data augmentation) while
        the run stays reproducible.

    Returns
    -------
    int
        The seed used on this rank.
    """
    if device_specific:
        seed += this_rank.rank()
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)
    import torch

    torch.manual_seed(seed)  # seeds CUDA and the other devices torch knows too
    return seed


def per_device_batch_size(global_batch_size: int) -> int:
    """The per-rank batch size that keeps ``global_batch_size`` whatever the number of ranks.

    Results change with the number of devices when the effective batch size does; dividing one
    global size keeps it.

    Raises
    ------
    ValueError
        When ``global_batch_size`` does not divide evenly over the ranks.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise TypeError(f"global_batch_size must be an int, got {global_batch_size!r}")
    size = this_rank.world_size()
    if global_batch_size < size or global_batch_size % size:
        lower = global_batch_size // size * size
        upper = lower + size
        choices = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"global batch size {global_batch_size} does not divide over {size} ranks; "
            f"use a multiple of {size} ({choices}), or another number of processes"
        )
    per_rank = global_batch_size // size
    if this_rank.rank() == 0:  # one line for all ranks
        this_rank.emit(effective_batch_size_event(per_rank, size))
    return per_rank


def effective_batch_size_event(
    per_rank: int, world_size: int, ranks: list[int] | None = None
) -> dict[str, Any]:
    """The ``batch 32 per rank x 2 ranks = 64 effective`` event (a search's last one too)."""
    # Its own ``what``, so a view that keeps one line per (rank, what) shows both lines.
    return {
        "kind": "progress",
        "rank": this_rank.rank(),
        "what": "effective_batch_size",
        "text": (
            f"batch {per_rank} per rank x {world_size} rank{'s' if world_size != 1 else ''} "
            f"= {per_rank * world_size} effective"
        ),
        "data": {
            "status": "final",
            "per_rank": per_rank,
            "world_size": world_size,
            "effective": per_rank * world_size,
            "ranks": ranks if ranks is not None else list(range(world_size)),
            "done": True,
        },
    }
