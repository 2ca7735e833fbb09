"""The PJRT runtime's layout for XLA ranks, as torch_xla lays out its own processes.

torch_xla's ``xmp.spawn`` starts one process per TPU chip on a host and, before the runtime
starts in it, tells each process which chip it owns and where the others are: its local rank and
count (``PJRT_LOCAL_PROCESS_RANK``/``COUNT``), its chip (``TPU_VISIBLE_CHIPS``), one chip per
process (``TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1``) in a grid of processes (``TPU_PROCESS_BOUNDS``),
every process's address (``TPU_PROCESS_ADDRESSES``) and its own port (``TPU_PROCESS_PORT``), and
its task number (``CLOUD_TPU_TASK_ID``). nblaunch's ranks are those processes: the same variables,
set in each rank's environment by the notebook (:meth:`LaunchPlan.rank_env`). On v2 and v3 a
chip has two cores; its process has two XLA devices (torch_xla runs a thread on each).

On XLA's CPU runtime (``PJRT_DEVICE=CPU``) each rank gets one CPU device (``CPU_NUM_DEVICES=1``)
and nothing else: that runtime does not span processes.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nblaunch.engine.plan.devices import Devices

# The grid of one-chip processes on one host, for the numbers of chips a TPU VM has; torch_xla
# reads it from the VM's metadata (host bounds x chips per host) for the whole host.
PROCESS_BOUNDS = {1: "1,1,1", 2: "2,1,1", 4: "2,2,1", 8: "2,4,1"}


def runtime_ports(devices: Devices, num_processes: int, address: str) -> list[int]:
    """A free port for each rank's TPU runtime on this host (torch_xla: 8476 and up, fixed;
    free ones let a second run, or a stale process, not collide). Empty off TPUs."""
    if devices.type != "xla" or devices.one_rank_default:  # XLA's CPU runtime has none
        return []
    probes = []
    try:
        for _ in range(num_processes):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind((address, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def runtime_env(
    env: dict[str, str], rank: int, world_size: int, ports: list[int]
) -> dict[str, str]:
    """The variables rank ``rank`` of ``world_size`` sets up its PJRT runtime with.

    ``env`` is the rank's environment so far: a layout the notebook set itself
    (``TPU_PROCESS_BOUNDS``, ``TPU_PROCESS_ADDRESSES``) is kept, as torch_xla keeps it; what
    differs per rank is always nblaunch's, since a value copied from the notebook would give
    every rank the same chip.
    """
    if env.get("PJRT_DEVICE", "").upper() == "CPU" or not ports:
        return {"CPU_NUM_DEVICES": "1"}  # one XLA device per rank
    layout = {
        "PJRT_DEVICE": "TPU",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": PROCESS_BOUNDS.get(world_size, f"{world_size},1,1"),
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{port}" for port in ports),
    }
    out = {name: env.get(name) or value for name, value in layout.items()}
    out.update(
        PJRT_LOCAL_PROCESS_RANK=str(rank),
        PJRT_LOCAL_PROCESS_COUNT=str(world_size),
        TPU_VISIBLE_CHIPS=str(rank),
        TPU_PROCESS_PORT=str(ports[rank]),
        CLOUD_TPU_TASK_ID=str(rank),  # one host: worker 0
    )
    return out
