"""The environment doctor: kernel parsing, GPU mix warnings, the report, the hostfile check."""

from __future__ import annotations

import os
import platform
import stat
import time

import pytest

from nblaunch.engine import doctor
from nblaunch.engine.doctor import Accelerator
from nblaunch.engine.plan import plan_launch
from nblaunch.options import LaunchOptions

GIB = 1 << 30

# A stand-in ssh: answers by host name the way the real one does, and logs its arguments.
FAKE_SSH = """#!/bin/sh
echo "$@" >> "$SSH_LOG"
for last; do :; done          # the command ("hostname")
host=""
for arg; do
  case "$arg" in -o) skip=1; continue;; esac
  if [ -n "$skip" ]; then skip=""; continue; fi
  if [ -z "$host" ]; then host="$arg"; fi
done
case "$host" in
  alpha) echo alpha ;;
  beta) echo beta-7.cluster.local ;;
  locked) echo "alice@locked: Permission denied (publickey,password)." >&2; exit 255 ;;
  newkey) echo "Host key verification failed." >&2; exit 255 ;;
  nowhere) echo "ssh: Could not resolve hostname nowhere: Name or service not known" >&2
           exit 255 ;;
  slow) exec sleep 30 ;;
  *) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
esac
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """A directory first on PATH holding a stand-in ``ssh``; returns (bin dir, ssh log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "ssh", FAKE_SSH)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(log))
    return bin_dir, log


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


def test_visible_devices_select_and_order_gpus(monkeypatch):
    listed = [
        {"index": 0, "name": "A", "memory": GIB, "uuid": "GPU-aaa", "source": "nvml"},
        {"index": 1, "name": "B", "memory": 2 * GIB, "uuid": "GPU-bbb", "source": "nvml"},
    ]
    monkeypatch.setattr(doctor, "_nvml_gpus", lambda: listed)
    try:
        for visible, names in [("1,0", ["B", "A"]), ("GPU-bb", ["B"]), ("0,7,1", ["A"]), ("", [])]:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
            doctor._driver_gpus.cache_clear()
            assert [g.name for g in doctor.accelerators()] == names, visible
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        doctor._driver_gpus.cache_clear()
        found = doctor.accelerators()
        assert [g.describe() for g in found] == ["cuda:0 A, 1.0 GiB", "cuda:1 B, 2.0 GiB"]
    finally:
        doctor._driver_gpus.cache_clear()


# --- the report ----------------------------------------------------------------------------------


def test_report_names_versions_machine_and_start_methods():
    import torch

    text = doctor.report()
    for needle in (
        f"torch        {torch.__version__}",
        "Python",
        "ipykernel",
        "ipywidgets",
        "cloudpickle",
        "accelerate",
        f"OS          {platform.system()} {platform.release()}",
        f"CPUs        {os.cpu_count()}",
        "RAM",
        "CUDA initialised in this process: no",
        "safe start methods: forkserver, spawn, fork",
        "mpirun",
    ):
        assert needle in text, needle


# --- hosts ---------------------------------------------------------------------------------------


def test_read_hostfile_formats(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nalpha slots=4\nbeta:8  # MPICH style\n\nalpha\n  gamma\n")
    assert doctor.read_hostfile(hostfile) == ["alpha", "beta", "gamma"]


def test_check_hosts_with_a_stand_in_ssh(tmp_path, fake_bin):
    bin_dir, log = fake_bin
    _executable(bin_dir / "mpirun", "#!/bin/sh\necho 'mpirun (Open MPI) 4.1.2'\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alpha slots=2\nbeta slots=2\nlocked\nnewkey\nnowhere\nslow\nrefuser\n")
    started = time.monotonic()
    result = doctor.check_hosts(hostfile, timeout=1.0)
    elapsed = time.monotonic() - started
    by_host = {check.host: check for check in result.hosts}
    assert by_host["alpha"].ok and by_host["alpha"].answered == "alpha"
    assert by_host["beta"].ok and by_host["beta"].answered == "beta-7.cluster.local"
    assert "ssh-copy-id locked" in by_host["locked"].fix
    assert "known_hosts" in by_host["newkey"].fix
    assert "does not resolve" in by_host["nowhere"].problem
    assert "no answer within 3 s" in by_host["slow"].problem
    assert "nothing listens" in by_host["refuser"].problem
    assert not result.ok
    assert elapsed < 15  # hosts are checked side by side, each with its own timeout
    calls = log.read_text().splitlines()
    assert len(calls) == 7
    assert all("-o BatchMode=yes -o ConnectTimeout=1" in call for call in calls)
    text = result.text()
    assert "ok    alpha: passwordless SSH works\n" in text
    assert "beta: passwordless SSH works (it calls itself 'beta-7.cluster.local')" in text
    assert "FAIL  locked:" in text and "fix: set up key login" in text
    assert "mpirun (Open MPI) 4.1.2" in text
    assert "2 of 7 host(s) reachable" in text


def test_check_hosts_reports_a_missing_hostfile_and_missing_mpirun(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ssh nor mpirun
    result = doctor.check_hosts(tmp_path / "nope")
    assert not result.ok and "cannot read the hostfile" in result.text()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alpha\n")
    text = doctor.check_hosts(hostfile).text()
    assert "ssh is not on PATH" in text
    assert "mpirun: not found on PATH" in text
