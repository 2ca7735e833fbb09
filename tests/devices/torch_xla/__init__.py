"""A stand-in for torch_xla in the test suite: just enough of its surface for an nblaunch rank,
recording what the rank set up (its PJRT environment, device, process group).

It starts no runtime: ``device()`` marks the runtime started, as the real one would be, and
returns ``xla:0``; the ``"xla"`` process-group backend is gloo underneath, so collectives work.
Only tests put it on ``sys.path``.
"""

from __future__ import annotations

import os

import torch

# The variables torch_xla's runtime reads when it starts in a process.
RUNTIME_ENV = (
    "PJRT_DEVICE",
    "PJRT_LOCAL_PROCESS_RANK",
    "PJRT_LOCAL_PROCESS_COUNT",
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
    "CLOUD_TPU_TASK_ID",
    "CPU_NUM_DEVICES",
)
RECORD: dict = {"runtime_env": None, "rendezvous": [], "groups": [], "default_device": []}


class _XLAC:
    """The C extension's few functions nblaunch calls."""

    initialized = False

    @staticmethod
    def _xla_runtime_is_initialized() -> bool:
        return _XLAC.initialized

    @staticmethod
    def _xla_set_default_device(device) -> None:
        RECORD["default_device"].append(str(device))


def _start_runtime() -> None:
    if not _XLAC.initialized:
        _XLAC.initialized = True
        RECORD["runtime_env"] = {name: os.environ.get(name) for name in RUNTIME_ENV}


def device(index: int | None = None) -> torch.device:
    _start_runtime()
    return torch.device("xla", 0 if index is None else index)
