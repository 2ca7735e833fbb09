"""The environment doctor: a report to paste into a bug report, and warnings before a launch.

:func:`report` is what ``nblaunch env`` and ``%dist env`` print: versions, OS and kernel, CPUs and
RAM, each accelerator with its name and memory, TPU chips, torch.distributed's backend for each
device type, whether CUDA or the XLA runtime is already initialised in this process and which
start methods are therefore safe, and what it sees of Slurm (its allocation, or the partitions
it can submit to: :mod:`~nblaunch.engine.plan.slurm_env`). :func:`launch_warnings` is what a
launch adds to its header: a Linux kernel older than 5.5, GPUs of different models or memory sizes.
The check of a hostfile's hosts over ssh is :mod:`nblaunch.cluster.hosts`; the front ends print
its report after this one.

Nothing here initialises CUDA: GPUs are listed by :mod:`nblaunch.engine.plan.gpus`, through
NVML (the driver's management library), which is what ``torch.cuda.device_count()`` uses too.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

from nblaunch.engine.plan import devices, gpus, slurm_env
from nblaunch.engine.plan.gpus import GIB, Accelerator
from nblaunch.errors import LaunchError

# Kernels before this have been reported to hang distributed runs (Accelerate warns as well).
MIN_KERNEL = (5, 5)
PACKAGES = ("torch", "torch_xla", "ipykernel", "ipywidgets", "cloudpickle", "accelerate")


# --- kernel --------------------------------------------------------------------------------------


def parse_kernel_release(release: str) -> tuple[int, int] | None:
    """``(major, minor)`` from a kernel release string, or None when it has no version.

    >>> parse_kernel_release("6.18.44-fc-v236-gpu")
    (6, 18)
    >>> parse_kernel_release("5.15") , parse_kernel_release("4.4.0"), parse_kernel_release("x")
    ((5, 15), (4, 4), None)
    """
    if not isinstance(release, str):
        return None
    match = re.match(r"\s*(\d+)(?:\.(\d+))?", release)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def kernel_warning(system: str | None = None, release: str | None = None) -> str | None:
    """The old-kernel warning for this machine (or the given ``system``/``release``)."""
    system = platform.system() if system is None else system
    release = platform.release() if release is None else release
    if system != "Linux":
        return None
    version = parse_kernel_release(release)
    if version is None or version >= MIN_KERNEL:
        return None
    return (
        f"Linux kernel {release} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}: distributed runs "
        "have been reported to hang on such kernels; if ranks stall for no reason, run on a "
        "machine with a newer kernel"
    )


# --- accelerators --------------------------------------------------------------------------------


def accelerators() -> list[Accelerator]:
    """The visible GPUs with names and memory, without initialising CUDA.

    From torch when CUDA is already initialised here (exact, in CUDA's order); otherwise from
    NVML, then ``nvidia-smi``, filtered by ``CUDA_VISIBLE_DEVICES``.
    """
    torch = _torch()
    if torch is not None and _cuda_initialized():
        found = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            found.append(Accelerator(index, props.name, int(props.total_memory), "torch"))
        return found
    return list(gpus.visible_gpus())


def gpu_mix_warning(gpus: list[Accelerator]) -> str | None:
    """A warning when the GPUs differ in model or memory size, else None."""
    kinds: dict[tuple[str, int | None], int] = {}
    for gpu in gpus:
        # Round memory to 1 GiB: identical boards report a few MiB apart under some drivers.
        size = round(gpu.memory_bytes / GIB) if gpu.memory_bytes else None
        kinds[(gpu.name, size)] = kinds.get((gpu.name, size), 0) + 1
    if len(kinds) < 2:
        return None
    mix = ", ".join(
        f"{count} x {name}" + (f" ({size} GiB)" if size else "")
        for (name, size), count in kinds.items()
    )
    return (
        f"the GPUs differ: {mix}. The slowest sets the pace of every step and the smallest "
        "sets the batch size; pick matching GPUs with CUDA_VISIBLE_DEVICES"
    )


# NCCL's shared-memory transport between the GPUs of one machine needs room in /dev/shm (a few
# MB per pair of ranks and channel); containers get 64 MB unless told otherwise.
SHM_MIN_BYTES = 512 << 20


def shm_warning(size: int | None = None, path: str = "/dev/shm") -> str | None:
    """A warning when ``path`` (its ``size`` in bytes, for tests) is smaller than
    ``SHM_MIN_BYTES`` and NCCL's shared memory is not turned off, else None."""
    if os.environ.get("NCCL_SHM_DISABLE") == "1":
        return None
    if size is None:
        try:
            stat = os.statvfs(path)
        except OSError:
            return None  # no /dev/shm (not Linux): NCCL does not use it there
        size = stat.f_blocks * stat.f_frsize
    if size >= SHM_MIN_BYTES:
        return None
    return (
        f"{path} holds only {size / (1 << 20):.0f} MB (containers get 64 MB by default); NCCL "
        "between GPUs of this machine needs more and fails there ('unhandled system error', "
        "'Bus error') or falls back to slower paths. Start the container with a larger one "
        "(docker run --shm-size=1g, or in Kubernetes an emptyDir with medium: Memory on "
        "/dev/shm), or set NCCL_SHM_DISABLE=1 (NCCL then goes through the network stack)"
    )


def launch_warnings(
    device_type: str | None = None,
    num_processes: int | None = None,
    *,
    gpus: list[Accelerator] | None = None,
    system: str | None = None,
    release: str | None = None,
    shm_size: int | None = None,
) -> list[str]:
    """Warnings for a launch's header: an old Linux kernel, GPUs of different kinds.

    Cheap, and never raises: a launch must not fail because a check could not run.

    Parameters
    ----------
    device_type
        The launch's device type; GPUs are compared only for ``"cuda"``.
    num_processes
        Ranks use the first ``num_processes`` GPUs; only those are compared.
    gpus, system, release, shm_size
        Stand-ins for this machine's, for tests.
    """
    warnings: list[str] = []
    with contextlib.suppress(Exception):
        warning = kernel_warning(system, release)
        if warning:
            warnings.append(warning)
    if (device_type == "cuda" and (num_processes or 2) > 1) or shm_size is not None:
        with contextlib.suppress(Exception):
            warning = shm_warning(shm_size)
            if warning:
                warnings.append(warning)
    if device_type == "cuda" or gpus is not None:
        with contextlib.suppress(Exception):
            used = accelerators() if gpus is None else gpus
            warning = gpu_mix_warning(used[:num_processes] if num_processes else used)
            if warning:
                warnings.append(warning)
    return warnings


# --- the report ----------------------------------------------------------------------------------


def safe_start_methods() -> list[str]:
    """Start methods that work from this process now (``fork`` not once CUDA is initialised)."""
    methods = ["forkserver", "spawn"]
    if not _cuda_initialized():
        methods.append("fork")
    return methods


def collect() -> dict[str, Any]:
    """Everything the report shows, as data."""
    import psutil

    # The installed distribution's version: the engine does not import the package above it.
    versions = {"nblaunch": _package_version("nblaunch"), "Python": _python_version()}
    for package in PACKAGES:
        versions[package] = _package_version(package)
    torch = _torch(import_it=True)
    builds = {}
    backends = []
    per_device: dict[str, str] = {}
    if torch is not None:
        # The build's own version: the CUDA wheels on PyPI say "2.13.0" in their metadata and
        # "2.13.0+cu130" here, the CPU wheels "2.13.0+cpu" in both.
        versions["torch"] = torch.__version__
        builds["CUDA"] = torch.version.cuda
        builds["ROCm"] = getattr(torch.version, "hip", None)
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available():
                names = ("gloo", "nccl", "mpi", "ucc")
                backends = [n for n in names if getattr(dist, f"is_{n}_available", lambda: 0)()]
                per_device = dict(dist.Backend.default_device_backend_map)
    memory = psutil.virtual_memory()
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = os.cpu_count() or 1
    gpus = accelerators()
    return {
        "versions": versions,
        "builds": builds,
        "backends": backends,
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "os_detail": platform.platform(),
        "cpus": os.cpu_count() or 1,
        "usable_cpus": usable_cpus,
        "ram_total": memory.total,
        "ram_available": memory.available,
        "accelerators": gpus,
        "tpu_chips": devices.tpu_chips(),
        "backend_per_device": per_device,
        "device_modules": os.environ.get(devices.MODULES_ENV),
        "xla_initialized": _xla_initialized(),
        "mps": _mps_available(torch),
        "cuda_initialized": _cuda_initialized(),
        "start_methods": safe_start_methods(),
        "warnings": (launch_warnings(gpus=gpus) if gpus else launch_warnings())
        + ([w] if (w := shm_warning()) and gpus else []),
        "mpirun": mpirun_version(),
        "slurm": slurm_env.report_lines(),
    }


def report() -> str:
    """The environment report (what ``nblaunch env`` and ``%dist env`` print).

    With a hostfile, those print :func:`nblaunch.cluster.hosts.check_hosts`'s report after it.
    """
    facts = collect()
    lines = ["nblaunch environment", ""]
    width = max(len(name) for name in facts["versions"]) + 2
    for name, version in facts["versions"].items():
        lines.append(f"  {name:<{width}}{version or 'not installed'}")
    lines.append(f"  {'torch build':<{width}}{torch_build(facts['builds'])}")
    lines.append(f"  {'backends':<{width}}{', '.join(facts['backends']) or 'none'}")
    lines.append("")
    lines.append(f"  OS          {facts['os']}")
    lines.append(f"  CPUs        {facts['cpus']} ({facts['usable_cpus']} usable by this process)")
    lines.append(
        f"  RAM         {facts['ram_total'] / GIB:.1f} GiB "
        f"({facts['ram_available'] / GIB:.1f} GiB available)"
    )
    gpus = facts["accelerators"]
    if gpus:
        lines.append(f"  GPUs        {len(gpus)} (from {gpus[0].source})")
        lines += [f"    {gpu.describe()}" for gpu in gpus]
    elif facts["mps"]:
        lines.append("  GPUs        Apple MPS")
    else:
        lines.append("  GPUs        none (ranks run on CPU with gloo)")
    chips = facts["tpu_chips"]
    if chips:
        generations = sorted({devices.TPU_DEVICE_IDS[chip][0] for chip in chips})
        lines.append(f"  TPU chips   {len(chips)} ({', '.join(generations)}, on the PCI bus)")
    if facts["backend_per_device"]:
        pairs = ", ".join(f"{k} {v}" for k, v in facts["backend_per_device"].items())
        lines.append(f"  backend per device type: {pairs}")
    if facts["device_modules"]:
        lines.append(f"  {devices.MODULES_ENV}={facts['device_modules']} (imported by every rank)")
    initialized = "yes" if facts["cuda_initialized"] else "no"
    lines.append(f"  CUDA initialised in this process: {initialized}")
    if facts["xla_initialized"] is not None:
        xla = "yes: restart before launching on XLA" if facts["xla_initialized"] else "no"
        lines.append(f"  XLA runtime initialised in this process: {xla}")
    lines.append(f"  safe start methods: {', '.join(facts['start_methods'])}")
    lines.append(f"  mpirun      {facts['mpirun'] or 'not found on PATH'}")
    lines += facts["slurm"]
    if facts["warnings"]:
        lines.append("")
        lines += [f"  warning: {w}" for w in facts["warnings"]]
    return "\n".join(lines) + "\n"


def torch_build(builds: dict[str, str | None]) -> str:
    """Which build of torch this is, from ``collect()["builds"]`` (the toolkit versions it was
    built with): ``"CPU build"``, ``"CUDA build (CUDA 13.0)"``, ``"ROCm build (ROCm 6.2)"``.

    ``pip install torch`` on Linux gives the CUDA build, with or without GPUs; only the CPU
    build lacks NCCL.
    """
    toolkits = [f"{name} {version}" for name, version in builds.items() if version]
    if not toolkits:
        return "CPU build"
    return f"{toolkits[0].split()[0]} build ({', '.join(toolkits)})"


def _python_version() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch(import_it: bool = False) -> Any:
    torch = sys.modules.get("torch")
    if torch is None and import_it:
        with contextlib.suppress(ImportError):
            import torch
    return torch


def _cuda_initialized() -> bool:
    from nblaunch.engine.processes.supervisor import cuda_initialized

    return cuda_initialized()


def _xla_initialized() -> bool | None:
    """Whether this process started the XLA runtime; None when torch_xla is not imported."""
    if "torch_xla" not in sys.modules:
        return None
    try:
        devices.refuse_initialised_xla_runtime()
    except LaunchError:
        return True
    return False


def _mps_available(torch: Any) -> bool:
    with contextlib.suppress(Exception):
        return bool(torch is not None and torch.backends.mps.is_available())
    return False


# --- MPI -----------------------------------------------------------------------------------------


def mpirun_version() -> str | None:
    """``mpirun``'s path and first version line, or None when it is not on PATH."""
    path = shutil.which("mpirun")
    if path is None:
        return None
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
        first = next((line for line in (out.stdout + out.stderr).splitlines() if line.strip()), "")
    except (OSError, subprocess.SubprocessError):
        first = ""
    return f"{path} ({first.strip()})" if first else path
