"""Which GPUs this machine has, without initialising CUDA: the one place that asks the driver.

NVML (the driver's management library, which ``torch.cuda.device_count()`` reads too), else
``nvidia-smi``, restricted to ``CUDA_VISIBLE_DEVICES`` as CUDA would. The doctor lists them with
their memory; a launch names its devices by them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import subprocess
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device as the report lists it."""

    index: int
    name: str
    memory_bytes: int | None
    source: str  # "torch", "nvml", "nvidia-smi"

    def describe(self) -> str:
        memory = f", {self.memory_bytes / GIB:.1f} GiB" if self.memory_bytes else ""
        return f"cuda:{self.index} {self.name}{memory}"


@functools.lru_cache(maxsize=1)
def visible_gpus() -> tuple[Accelerator, ...]:
    """GPUs the driver lists, restricted to CUDA_VISIBLE_DEVICES; cached (they do not change)."""
    listed = _nvml_gpus()
    if listed is None:
        listed = _nvidia_smi_gpus()
    if not listed:
        return ()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = []
        for item in (part.strip() for part in visible.split(",")):
            if not item:
                break
            if item.isdigit():
                match = [g for g in listed if g["index"] == int(item)]
            else:
                match = [g for g in listed if g["uuid"].startswith(item)]
            if not match:
                break  # CUDA also ignores everything after an invalid entry
            chosen.append(match[0])
        listed = chosen
    source = listed[0]["source"] if listed else ""
    return tuple(Accelerator(i, gpu["name"], gpu["memory"], source) for i, gpu in enumerate(listed))


def _nvml_gpus() -> list[dict[str, Any]] | None:
    """Name, total memory and UUID of every GPU, through the driver's NVML library."""

    class _Memory(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        gpus = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            name = ctypes.create_string_buffer(96)
            uuid = ctypes.create_string_buffer(96)
            memory = _Memory()
            nvml.nvmlDeviceGetName(handle, name, 96)
            nvml.nvmlDeviceGetUUID(handle, uuid, 96)
            has_memory = nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0
            gpus.append(
                {
                    "index": index,
                    "name": name.value.decode(errors="replace") or "GPU",
                    "uuid": uuid.value.decode(errors="replace"),
                    "memory": int(memory.total) if has_memory else None,
                    "source": "nvml",
                }
            )
        return gpus
    finally:
        nvml.nvmlShutdown()


def _nvidia_smi_gpus() -> list[dict[str, Any]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        memory = int(fields[2]) * (1 << 20) if fields[2].isdigit() else None
        gpus.append(
            {
                "index": int(fields[0]),
                "name": fields[1],
                "memory": memory,
                "uuid": fields[3],
                "source": "nvidia-smi",
            }
        )
    return gpus
