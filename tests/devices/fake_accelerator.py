"""A test accelerator, ``fakeacc``, registered the way an out-of-tree plug-in registers one.

torch's PrivateUse1 device type is renamed ``fakeacc``; a device module (``torch.fakeacc``)
counts two devices (``FAKEACC_DEVICES``) and records which one is current; a process-group
backend ``fakeccl`` is registered for the device type, made of gloo underneath, and records each
group it made. A rank imports this module when ``NBLAUNCH_DEVICE_MODULES=fake_accelerator``:
what nblaunch does with it is the generic path every real accelerator takes.

Like CUDA with ``CUDA_VISIBLE_DEVICES``, ``FAKEACC_VISIBLE_DEVICES`` ("1,0") maps the indices a
process uses to physical devices, read once, when the process first pins a device: a process
that pinned one under another value stays on that mapping. Each pin is recorded (the index, the
physical device, the thread) and, when ``FAKEACC_LOG`` names a file, appended to it with the
process id and the time, so a test can see what a waiting spare rank did.
"""

from __future__ import annotations

import os
import threading
import time
import types

import torch
import torch.distributed as dist

NAME = "fakeacc"
BACKEND = "fakeccl"
# What happened in this process, for the test's function to return.
RECORD: dict[str, list] = {
    "set_device": [],
    "physical": [],
    "set_device_by": [],
    "groups": [],
    "empty_cache": [],
}
_current = [0]
_visible: list[list[int]] = []  # FAKEACC_VISIBLE_DEVICES, as read at the first pin

module = types.ModuleType(f"torch.{NAME}")
module.device_count = lambda: int(os.environ.get("FAKEACC_DEVICES", "2"))
module.is_available = lambda: True
module.current_device = lambda: _current[0]
module.get_device_name = lambda index=0: "Fake Accelerator"
module.max_memory_allocated = lambda device=None: 3 * 2**20
module.memory_allocated = lambda device=None: 2**20


def _set_device(index: int) -> None:
    if not _visible:
        visible = os.environ.get("FAKEACC_VISIBLE_DEVICES")
        _visible.append([int(i) for i in visible.split(",")] if visible else [0, 1, 2, 3])
    physical = _visible[0][int(index)]
    thread = threading.current_thread().name
    _current[0] = int(index)
    RECORD["set_device"].append(int(index))
    RECORD["physical"].append(physical)
    RECORD["set_device_by"].append(thread)
    log = os.environ.get("FAKEACC_LOG")
    if log:
        with open(log, "a") as file:
            file.write(f"{os.getpid()} {index} {physical} {thread} {time.time()}\n")


def _empty_cache() -> None:
    RECORD["empty_cache"].append(_current[0])


module.set_device = _set_device
module.empty_cache = _empty_cache


def _make_group(store, rank, size, timeout):
    RECORD["groups"].append({"rank": rank, "size": size})
    return dist.ProcessGroupGloo(store, rank, size, timeout)


torch.utils.rename_privateuse1_backend(NAME)
torch._register_device_module(NAME, module)
dist.Backend.register_backend(BACKEND, _make_group, devices=[NAME])
