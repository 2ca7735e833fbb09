"""The environment doctor: kernel parsing, GPU mix warnings, the report."""

from __future__ import annotations

import os
import platform

import pytest

from nblaunch.engine.plan import doctor, gpus
from nblaunch.engine.plan.doctor import Accelerator
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.options import LaunchOptions

GIB = 1 << 30


# --- kernel --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ("4.4.0", (4, 4)),
        ("5.15", (5, 15)),
        ("6.18.44-fc-v236-gpu", (6, 18)),
        ("5.4.0-150-generic", (5, 4)),
        ("3", (3, 0)),
        ("garbage", None),
        ("", None),
        ("-1.2", None),
        (None, None),
    ],
)
def test_parse_kernel_release(release, expected):
    assert doctor.parse_kernel_release(release) == expected


@pytest.mark.parametrize(
    ("system", "release", "warns"),
    [
        ("Linux", "4.4.0", True),
        ("Linux", "5.4.0-150-generic", True),
        ("Linux", "5.5.0", False),
        ("Linux", "6.18.44-fc-v236-gpu", False),
        ("Linux", "garbage", False),
        ("Darwin", "4.0.0", False),
    ],
)
def test_kernel_warning(system, release, warns):
    warning = doctor.kernel_warning(system, release)
    assert bool(warning) is warns
    if warns:
        assert f"Linux kernel {release} is older than 5.5" in warning


def test_plan_launch_carries_the_kernel_warning(monkeypatch):
    monkeypatch.setattr(platform, "release", lambda: "4.4.0")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    plan = plan_launch(print, 2, LaunchOptions(device_type="cpu"))
    assert any("Linux kernel 4.4.0 is older than 5.5" in w for w in plan.warnings)


# --- GPUs ----------------------------------------------------------------------------------------


def _gpus(*specs):
    return [Accelerator(i, name, gib * GIB, "nvml") for i, (name, gib) in enumerate(specs)]


def test_gpu_mix_warning():
    same = _gpus(("NVIDIA H100", 80), ("NVIDIA H100", 80))
    assert doctor.gpu_mix_warning(same) is None
    models = doctor.gpu_mix_warning(_gpus(("NVIDIA A100", 40), ("NVIDIA V100", 32)))
    assert "1 x NVIDIA A100 (40 GiB), 1 x NVIDIA V100 (32 GiB)" in models
    assert "the smallest sets the batch size" in models
    sizes = doctor.gpu_mix_warning(_gpus(("NVIDIA A100", 80), ("NVIDIA A100", 40)))
    assert "80 GiB" in sizes and "40 GiB" in sizes


def test_launch_warnings_compare_only_the_gpus_used():
    gpus = _gpus(("NVIDIA A100", 80), ("NVIDIA A100", 80), ("NVIDIA T4", 16))
    both = doctor.launch_warnings("cuda", 3, gpus=gpus, system="Linux", release="4.4.0")
    assert len(both) == 2 and "T4" in both[1]
    assert doctor.launch_warnings("cuda", 2, gpus=gpus, system="Linux", release="6.1") == []


def test_a_small_dev_shm_is_named_with_the_fix(monkeypatch):
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    warning = doctor.shm_warning(64 << 20)
    assert warning.startswith("/dev/shm holds only 64 MB (containers get 64 MB by default)")
    assert "--shm-size=1g" in warning and "NCCL_SHM_DISABLE=1" in warning
    assert doctor.shm_warning(1 << 30) is None
    gpus = _gpus(("NVIDIA H200", 141), ("NVIDIA H200", 141))
    warnings = doctor.launch_warnings("cuda", 2, gpus=gpus, system="Linux", release="6.1")
    assert warnings == [] or "--shm-size" in warnings[0]  # this machine's own /dev/shm
    small = doctor.launch_warnings("cuda", 2, gpus=gpus, shm_size=64 << 20, release="6.1")
    assert small == [warning]
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    assert doctor.shm_warning(64 << 20) is None  # the fix, taken


def test_visible_devices_select_and_order_gpus(monkeypatch):
    listed = [
        {"index": 0, "name": "A", "memory": GIB, "uuid": "GPU-aaa", "source": "nvml"},
        {"index": 1, "name": "B", "memory": 2 * GIB, "uuid": "GPU-bbb", "source": "nvml"},
    ]
    monkeypatch.setattr(gpus, "_nvml_gpus", lambda: listed)
    try:
        for visible, names in [("1,0", ["B", "A"]), ("GPU-bb", ["B"]), ("0,7,1", ["A"]), ("", [])]:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
            gpus.visible_gpus.cache_clear()
            assert [g.name for g in doctor.accelerators()] == names, visible
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        gpus.visible_gpus.cache_clear()
        found = doctor.accelerators()
        assert [g.describe() for g in found] == ["cuda:0 A, 1.0 GiB", "cuda:1 B, 2.0 GiB"]
    finally:
        gpus.visible_gpus.cache_clear()


# --- the report ----------------------------------------------------------------------------------


def test_the_report_says_which_build_of_torch_this_is():
    assert doctor.torch_build({"CUDA": None, "ROCm": None}) == "CPU build"
    assert doctor.torch_build({"CUDA": "13.0", "ROCm": None}) == "CUDA build (CUDA 13.0)"
    assert doctor.torch_build({"CUDA": None, "ROCm": "6.2.4"}) == "ROCm build (ROCm 6.2.4)"


def test_report_names_versions_machine_and_start_methods():
    import torch

    text = doctor.report()
    for needle in (
        f"torch        {torch.__version__}",  # the build's own, 2.13.0+cu130 or 2.13.0+cpu
        "torch build  "
        + (f"CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "CPU build"),
        "Python",
        "ipykernel",
        "ipywidgets",
        "cloudpickle",
        "accelerate",
        f"OS          {platform.system()} {platform.release()}",
        f"CPUs        {os.cpu_count()}",
        "RAM",
        "CUDA initialised in this process: no",
        "backend per device type: cpu gloo, cuda nccl",
        "safe start methods: forkserver, spawn, fork",
        "mpirun",
    ):
        assert needle in text, needle
