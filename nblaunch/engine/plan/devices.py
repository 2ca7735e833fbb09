"""Which devices a launch runs on, decided in the notebook without importing torch.

Importing torch in a notebook costs a second, and an interrupt in the middle of it leaves the
kernel's torch half imported, so devices are counted from what the drivers leave in the file
system: NVIDIA's and ROCm's driver files (then torch counts GPUs through NVML, which does not
initialise CUDA), TPU chips on the PCI bus (Google's vendor id, as torch_xla counts them), and,
for every other accelerator torch knows, a probe: a process forked from the forkserver, which
has torch imported already, imports the plug-ins (``NBLAUNCH_DEVICE_MODULES``) and asks
``torch.accelerator`` and torch.distributed (:func:`nblaunch.ranks.device.devices.probe`).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import sys
from dataclasses import dataclass

from nblaunch.engine.plan import gpus
from nblaunch.errors import LaunchError
from nblaunch.options import check_device_type
from nblaunch.ranks.device.devices import MODULES_ENV

# Where torch_xla looks for TPU chips: PCI devices of Google's vendor id with a TPU device id.
PCI_DEVICES = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR = "0x1ae0"
# TPU device id -> (generation, XLA devices per chip). v2 and v3 chips have two cores, each an
# XLA device: torch_xla runs two threads in each chip's process there.
TPU_DEVICE_IDS = {
    "0x0027": ("v2/v3", 2),
    "0x005e": ("v4", 1),
    "0x0063": ("v5e", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("7x", 1),
    "0x0056": ("test", 1),
    "0x0062": ("test", 1),
}
# Files an accelerator's driver leaves: worth a probe when no device type is named.
ACCELERATOR_FILES = ("/dev/davinci0", "/dev/accel/accel0")  # Ascend NPU, Habana Gaudi
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Devices:
    """The devices a launch runs on, as the plan needs them."""

    type: str  # "cpu", "cuda", "xla", "xpu", a PrivateUse1 name, ...
    count: int  # how many ranks may run on them (CPU: cores)
    kind: str  # what the header calls them: "CPU", "NVIDIA H200", "TPU v5e"
    backend: str  # the default process group's backend
    init_method: str | None = None  # "xla://" on TPUs; else nblaunch's own store
    cores_per_chip: int = 1  # XLA devices per TPU chip (2 on v2/v3)
    one_rank_default: bool = False  # not real devices (CPU, XLA's CPU runtime): 1 rank unless told


CPU = Devices("cpu", os.cpu_count() or 1, "CPU", "gloo", one_rank_default=True)


def detect_devices(device_type: str | None) -> Devices:
    """The devices for ``device_type`` (None: the best this machine has).

    Raises
    ------
    LaunchError
        The named device type is not here, or the XLA runtime is already initialised.
    """
    if device_type is not None:
        check_device_type(device_type)
    if device_type == "cpu":
        return CPU
    if device_type == "xla" or (device_type is None and tpu_chips() and _xla_installed()):
        return _xla()
    if device_type in (None, "cuda") and ("torch" in sys.modules or _gpu_driver_present()):
        found = _cuda()
        if found is not None:
            return found
    if device_type == "cuda":
        raise LaunchError("device_type='cuda' but no CUDA device is visible to torch")
    if device_type is None:
        if not (os.environ.get(MODULES_ENV) or any(map(os.path.exists, ACCELERATOR_FILES))):
            return CPU
        found = probe(None)
        return found if found.count else CPU
    found = probe(device_type)
    if not found.count:
        raise LaunchError(
            f"device_type={device_type!r} but torch sees no {device_type} device"
            + _plugin_hint(device_type)
        )
    return found


def _plugin_hint(device_type: str) -> str:
    if os.environ.get(MODULES_ENV):
        return f" (after importing {MODULES_ENV}={os.environ[MODULES_ENV]})"
    return (
        f"; if a plug-in provides {device_type!r} (torch_npu, habana_frameworks.torch, ...), "
        f"name it in {MODULES_ENV} so that every rank imports it first"
    )


def _cuda() -> Devices | None:
    import torch

    # device_count() asks NVML and does not initialise CUDA, so fork stays possible.
    count = torch.cuda.device_count()
    if not count:
        return None
    if torch.cuda.is_initialized():
        name = torch.cuda.get_device_name(0)
    else:  # the driver's name for it, without initialising CUDA (fork stays possible)
        listed = gpus.visible_gpus()
        name = listed[0].name if listed else "GPU"
    return Devices("cuda", count, name, "nccl")


def _gpu_driver_present() -> bool:
    """Whether a GPU driver torch could use is loaded (NVIDIA's or ROCm's), read from the
    system without importing torch."""
    return any(
        os.path.exists(path) for path in ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/kfd")
    )


# --- XLA -----------------------------------------------------------------------------------------


def tpu_chips(root: str | None = None) -> list[str]:
    """The TPU generation of each TPU chip on this machine's PCI bus (torch_xla's count)."""
    chips = []
    for vendor_path in sorted(glob.glob(os.path.join(root or PCI_DEVICES, "*", "vendor"))):
        try:
            with open(vendor_path) as vendor:
                if vendor.read().strip() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as device:
                device_id = device.read().strip()
        except OSError:
            continue
        if device_id in TPU_DEVICE_IDS:
            chips.append(device_id)
    return chips


def _xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def refuse_initialised_xla_runtime() -> None:
    """Raise when this process already started the XLA runtime: it holds the TPU then, and
    ranks started now could not have it (torch_xla's "Runtime is already initialized")."""
    torch_xla = sys.modules.get("torch_xla")
    initialised = getattr(getattr(torch_xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    if initialised is not None and initialised():
        raise LaunchError(
            "the XLA runtime is already initialised in this notebook's kernel (something used "
            "an XLA device here: torch_xla.device(), xm.xla_device(), a tensor on 'xla', "
            "xr.global_runtime_device_count()), so it holds the devices the ranks need. "
            "Restart the kernel, and launch before anything in the notebook touches an XLA "
            "device: create models and tensors on it inside the launched function."
        )


def _xla() -> Devices:
    refuse_initialised_xla_runtime()
    if not _xla_installed():
        raise LaunchError("device_type='xla' but torch_xla cannot be imported; install torch_xla")
    runtime = os.environ.get("PJRT_DEVICE", "").upper()
    chips = tpu_chips()
    if chips and runtime in ("", "TPU"):
        generation, cores = TPU_DEVICE_IDS[chips[0]]
        if cores > 1:
            # v2/v3: torch_xla's xla:// makes each core a rank of the group, but an nblaunch
            # rank is a chip's process with a thread per core; the chips' processes meet in a
            # gloo group, and the cores reduce with torch_xla's own collectives (xm.all_reduce).
            return Devices("xla", len(chips), f"TPU {generation}", "gloo", cores_per_chip=cores)
        return Devices("xla", len(chips), f"TPU {generation}", "xla", init_method="xla://")
    if runtime == "CPU":
        # XLA's CPU client runs one process alone (no runtime across processes): each rank
        # computes on its own XLA device, and the ranks meet in a gloo group.
        return Devices("xla", os.cpu_count() or 1, "XLA (CPU)", "gloo", one_rank_default=True)
    if runtime in ("", "TPU"):
        raise LaunchError(
            "device_type='xla' but no TPU chip is on this machine's PCI bus; set "
            "PJRT_DEVICE=CPU to run XLA on the CPU (each rank one XLA CPU device)"
        )
    raise LaunchError(
        f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}: nblaunch runs XLA on TPUs and on the CPU; "
        "for GPUs use device_type='cuda'"
    )


# --- every other accelerator: ask a probe ---------------------------------------------------------


def probe(device_type: str | None) -> Devices:
    """Ask a child of the forkserver what torch knows of ``device_type`` (None: the current
    accelerator). Cached per device type, ``NBLAUNCH_DEVICE_MODULES``, ``sys.path`` and the
    ``*_VISIBLE_DEVICES`` variables.

    Raises
    ------
    LaunchError
        The probe failed (a plug-in that does not import), naming what it said.
    """
    visible = tuple(sorted((k, v) for k, v in os.environ.items() if k.endswith("VISIBLE_DEVICES")))
    return _probe(device_type, os.environ.get(MODULES_ENV, ""), tuple(sys.path), visible)


@functools.lru_cache(maxsize=8)
def _probe(device_type: str | None, *cache_key: object) -> Devices:
    import multiprocessing

    from nblaunch.engine.processes.supervisor import FORKSERVER_PRELOAD, main_module_hidden
    from nblaunch.ranks.device import devices

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(
        target=devices.probe,
        args=(device_type, dict(os.environ), list(sys.path), theirs),
        daemon=True,
    )
    with main_module_hidden():
        process.start()
    theirs.close()
    try:
        if not ours.poll(PROBE_TIMEOUT_S):
            raise LaunchError(
                f"counting {device_type or 'accelerator'} devices took more than "
                f"{PROBE_TIMEOUT_S:.0f} s; pass device_type='cpu', or check the device's driver"
            )
        found_type, count, name, backend = ours.recv()
    except EOFError:
        raise LaunchError(
            f"the process counting {device_type or 'accelerator'} devices died (exit code "
            f"{process.exitcode}); run `python -m nblaunch env` to see what torch finds"
        ) from None
    finally:
        ours.close()
        process.join(5)
    if found_type == "error":
        raise LaunchError(f"counting {device_type or 'accelerator'} devices failed: {name}")
    return Devices(found_type, count, name, backend)
