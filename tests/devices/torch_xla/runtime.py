"""The stand-in's ``torch_xla.runtime``: ordinal and world size from the PJRT environment."""

from __future__ import annotations

import os


def device_type() -> str:
    return os.environ.get("PJRT_DEVICE", "CPU").upper()


def global_ordinal() -> int:
    return int(os.environ.get("CLOUD_TPU_TASK_ID", "0"))


def world_size() -> int:
    addresses = os.environ.get("TPU_PROCESS_ADDRESSES")
    return len(addresses.split(",")) if addresses else 1


process_index = global_ordinal
process_count = world_size


def is_spmd() -> bool:
    return False


def _init_world_size_ordinal() -> None:
    pass
