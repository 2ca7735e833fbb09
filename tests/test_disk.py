"""Disk trouble under the run directory: said once, naming the path; the ranks train on.

The fault sweep found a full disk under the run directory ending a printing run with a bare
``OSError: [Errno 28] No space left on device`` that named no path, a rank logging metrics that
never finished, and a directory turned read-only mid-run losing later lines and metrics with no
word. These run on a small tmpfs (mounting needs root, as CI is; elsewhere they skip).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.notebook.views import RecordingView
from nblaunch.options import LaunchOptions


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` of our own at ``mount`` (made), unmounted afterwards; needs root."""
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "nblaunch-test", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs of our own, unmounted afterwards."""
    with tmpfs(tmp_path / "disk", "256k") as mount:
        yield mount


@pytest.fixture
def failing_disk(tmp_path):
    """An ext4 file system on a loop device, mounted errors=remount-ro, and the sysfs file that
    makes it fail: then it turns read-only under open files, as a failing disk does."""
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode == 0:
        made = subprocess.run(
            ["mount", "-o", "loop,errors=remount-ro", str(image), str(mount)],
            capture_output=True,
            text=True,
        )
    if made.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image here (needs root, loop devices): {made.stderr}")
    try:
        device = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE", str(mount)], capture_output=True, text=True
        ).stdout.strip()
        trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"{trigger} is missing: this kernel cannot make the disk fail")
        yield mount, trigger
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def write_a_lot(steps, trigger=None):
    """Print and log metrics for ``steps`` steps; halfway, rank 0 makes the disk fail.

    The first step waits a second, so the relay has written it to disk (it flushes every half
    second) before the disk fills or fails: what could be written, is.
    """
    import time
    from pathlib import Path

    import nblaunch

    for step in range(steps):
        print(f"step {step} " + "x" * 60, flush=step % 100 == 0)
        nblaunch.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        if step == 0:
            time.sleep(1.0)
        if trigger and step == steps // 2 and nblaunch.rank() == 0:
            print("the disk fails now", flush=True)
            Path(trigger).write_text("1")
    return nblaunch.rank()


def run(function, args, run_dir: Path) -> tuple[list, list[dict], float]:
    plan = plan_launch(function, 2, LaunchOptions(device_type="cpu", run_dir=run_dir, timeout=120))
    view = RecordingView()
    began = time.monotonic()
    values = Run(plan, view).execute(serialize_payload(function, args))
    warnings = [e for e in view.events if e["kind"] == "diagnosis"]
    return values, warnings, time.monotonic() - began


def test_a_full_disk_is_said_once_with_its_path_and_the_ranks_finish(small_disk):
    values, warnings, took = run(write_a_lot, (20_000,), small_disk / "run")
    assert values == [0, 1]
    assert took < 60
    titles = [w["title"] for w in warnings]
    logs = [t for t in titles if t.startswith("the run's rank logs are no longer written")]
    assert len(logs) == 1, titles
    assert "No space left on device" in logs[0] and str(small_disk / "run") in logs[0]
    assert all(w["severity"] == "warning" for w in warnings)
    assert "step 0 " in (small_disk / "run" / "rank0.log").read_text()  # written until full


def test_a_run_directory_turned_read_only_is_said_and_the_ranks_finish(failing_disk):
    mount, trigger = failing_disk
    values, warnings, took = run(write_a_lot, (4_000, str(trigger)), mount / "run")
    assert values == [0, 1]
    assert took < 60
    titles = [w["title"] for w in warnings]
    for what in ("rank logs", "metrics"):
        said = [t for t in titles if t.startswith(f"the run's {what} are no longer written")]
        assert len(said) == 1 and "Read-only file system" in said[0], titles
    log = (mount / "run" / "rank0.log").read_text()  # rank 0 failed the disk at step 2000
    assert "step 0 " in log and "step 3999" not in log  # what came before, nothing after
