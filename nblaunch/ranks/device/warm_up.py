"""A spare rank's device, made ready before its task: the accelerator's context, ahead.

A spare rank (:mod:`nblaunch.engine.processes.spares`) is forked while the notebook is idle and
waits on its pipe for the set-up. On a GPU the first thing the set-up then does, creating the CUDA
context on the rank's device, takes about 0.3 s (an H200, CUDA 13): a warm launch would pay it
every time. So a spare forked after a launch on an accelerator is told, at fork time, which
device it would get (``LOCAL_RANK``'s) and the device-relevant environment as the notebook has
it then (:func:`device_env`), and makes its context on that device in a thread of its own while
its main thread waits on the pipe. The set-up first waits for that thread (:func:`wait`), then
checks that it is set up for exactly what was warmed (:func:`check`): the launcher lets a spare
go, and forks a fresh rank, when the device or its environment changed since the fork, and a
spare set up for anything else would be a rank on a wrong device, so it refuses to run.

Nothing of this runs for CPU ranks (no plan, no thread) or on XLA devices (their runtime is set
up per launch, :mod:`nblaunch.ranks.device.xla`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

# Variables that decide which device an index names, or how its context and memory are made:
# read once, when the accelerator's runtime starts (CUDA_VISIBLE_DEVICES at cuInit,
# PYTORCH_CUDA_ALLOC_CONF at the allocator's first use), so they must be the notebook's before
# a spare touches the device. Too many is safe (a spare let go costs a fork); too few is not.
DEVICE_ENV_PREFIXES = (
    "CUDA_",  # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, CUDA_MODULE_LOADING, ...
    "NVIDIA_",
    "HIP_",  # ROCm
    "ROCR_",
    "HSA_",
    "GPU_DEVICE_ORDINAL",
    "PYTORCH_",  # PYTORCH_CUDA_ALLOC_CONF, PYTORCH_NO_CUDA_MEMORY_CACHING, ...
    "ZE_",  # Intel XPU: ZE_AFFINITY_MASK
    "ONEAPI_DEVICE_SELECTOR",
    "SYCL_",
    "ASCEND_",  # Ascend NPU: ASCEND_RT_VISIBLE_DEVICES
    "HABANA_",  # Gaudi: HABANA_VISIBLE_DEVICES
    "NBLAUNCH_DEVICE_MODULES",  # the plug-ins a rank imports first
)
# Device types whose ranks are not warmed: CPU has no context, XLA's runtime is per launch.
NOT_WARMED = ("cpu", "xla")
THREAD_NAME = "nblaunch-warm-up"

_thread: threading.Thread | None = None
_report: dict[str, Any] | None = None  # what the warm-up did; None in a rank that was not warmed


def device_env(device_type: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that decide ``device_type``'s devices (:data:`DEVICE_ENV_PREFIXES`,
    and any named after the device type, such as ``XPU_...`` or a plug-in's ``FAKEACC_...``)."""
    prefixes = (*DEVICE_ENV_PREFIXES, device_type.upper() + "_")
    return {name: value for name, value in env.items() if name.startswith(prefixes)}


def plan(device_type: str, env: Mapping[str, str]) -> dict[str, Any] | None:
    """What spares forked now for a launch on ``device_type`` warm up with (each adds its
    ``index``); None for devices that are not warmed (CPU)."""
    if device_type in NOT_WARMED:
        return None
    return {"device_type": device_type, "env": device_env(device_type, env)}


def start(warm: dict[str, Any]) -> None:
    """Take the notebook's device environment, then make the context of device ``index`` in a
    thread (the caller goes on to wait on its pipe).

    The variables are set here, before the thread starts, and nothing changes ``os.environ``
    until :func:`wait` has joined it: C code reading the environment while Python clears it is
    a race.
    """
    global _thread, _report
    for name in device_env(warm["device_type"], os.environ):
        del os.environ[name]  # the forkserver's, from when it started
    os.environ.update(warm["env"])
    _report = {
        "device": f"{warm['device_type']}:{warm['index']}",
        "started_at": time.time(),
        "seconds": None,
        "error": None,
    }
    _thread = threading.Thread(
        target=_make_context, args=(warm["device_type"], warm["index"]), name=THREAD_NAME
    )
    _thread.daemon = True  # a spare let go exits without waiting for its device
    _thread.start()


def _make_context(device_type: str, index: int) -> None:
    """Import the plug-ins, pin the device, allocate on it: CUDA creates its context on the
    first allocation (pinning device 0, already current, creates none). A failure is only
    noted: the set-up does each step again and reports the rank's own error."""
    assert _report is not None
    began = time.perf_counter()
    try:
        from nblaunch.ranks.device import devices

        devices.import_device_modules()
        import torch

        device = devices.pin(device_type, index)
        with contextlib.suppress(Exception):  # a device registered from Python has no allocator
            torch.empty(1, device=device)
    except BaseException as exc:
        _report["error"] = f"{type(exc).__name__}: {exc}"
    _report["seconds"] = time.perf_counter() - began


def wait() -> None:
    """Wait for the warm-up (when this rank is a warmed spare): its context is the set-up's."""
    if _thread is not None:
        _thread.join()


def check(setup: Mapping[str, Any]) -> None:
    """Refuse a set-up for another device, or device environment, than this spare warmed up for.

    The launcher lets such spares go before it sends a set-up
    (:mod:`nblaunch.engine.processes.spares`); this is the rank's own guard that it never runs on a
    wrong device.

    Raises
    ------
    RuntimeError
        Naming what was warmed and what the set-up asks for.
    """
    if _report is None:
        return
    device_type = setup["device_type"]
    wanted = f"{device_type}:{setup['env'].get('LOCAL_RANK')}"
    warmed_env = {k: os.environ.get(k) for k in device_env(device_type, os.environ)}
    if wanted == _report["device"] and warmed_env == device_env(device_type, setup["env"]):
        return
    raise RuntimeError(
        f"nblaunch: this spare rank made its context on {_report['device']}, but was set up for "
        f"{wanted} or another device environment; that is a bug in nblaunch (the launcher lets "
        "such spares go). Set NBLAUNCH_SPARE_RANKS=0 to start fresh ranks, and report it."
    )


def forget() -> None:
    """Treat this rank as not warmed (its warm-up could not start); the set-up replaces the
    environment anyway."""
    global _thread, _report
    wait()
    _thread, _report = None, None


def report() -> dict[str, Any] | None:
    """What this rank's warm-up did (``device``, ``started_at``, ``seconds``, ``error``), or None
    when it was not a warmed spare."""
    return None if _report is None else dict(_report)
