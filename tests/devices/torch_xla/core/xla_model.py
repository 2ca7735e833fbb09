"""The stand-in's ``torch_xla.core.xla_model``."""

from __future__ import annotations

import os

import torch_xla


def xla_device():
    return torch_xla.device()


def get_xla_supported_devices() -> list[str]:
    # STANDIN_CORES_PER_CHIP=2 plays a v2/v3 chip: two XLA devices in one process.
    return [f"xla:{i}" for i in range(int(os.environ.get("STANDIN_CORES_PER_CHIP", "1")))]
