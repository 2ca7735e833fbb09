"""Detached runs and pools under faults (issue 40): a full disk, two kernels on one pool, two runs
whose directories share a name, a run host that was killed. Real processes and real kernels.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until
from test_detached import processes_of

import nblaunch
from nblaunch.engine import detached
from nblaunch.notebook.views import RecordingView


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A registry of detached runs of this test's own (kernels started after it inherit it)."""
    path = tmp_path / "detached"
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(path))
    return path


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB tmpfs of our own (as the issue's), unmounted afterwards; needs root."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "nblaunch-test", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nblaunch", "runs", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def spam(lines, pause_s=2.0):
    """Wait for the views to attach, then print ``lines`` lines of 65 bytes."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    time.sleep(pause_s)
    for i in range(lines):
        print(f"rank {rank} line {i:08d} " + "x" * 42)
    return rank + 100


class SlowView(RecordingView):
    """A notebook that takes the run's lines slower than the ranks print them."""

    def handle_many(self, events):
        time.sleep(len(events) * 40e-6)
        self.events.extend(events)


def lines_of(view: RecordingView, rank: int) -> list[str]:
    return [e["text"] for e in view.of("stream") if e["rank"] == rank]


# --- 1. a full disk ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_loses_neither_the_values_nor_a_line_of_a_detached_run(registry, full_disk):
    seen = SlowView()
    handle = nblaunch.notebook_launcher(
        spam, (50_000,), 2, detach=True, display="none", run_dir=full_disk / "out"
    )
    handle.watch(seen)
    assert handle.result(timeout=180) == [100, 101]
    assert handle.state == "done"
    assert wait_until(lambda: seen.of("run_ended"), 60)
    for rank in (0, 1):
        got = lines_of(seen, rank)
        assert len(got) == 50_000, (rank, len(got))
        assert got[-1].startswith(f"rank {rank} line 00049999")
    # The one warning says what is lost: the rank logs on disk, nothing more.
    warnings = [e["title"] for e in seen.of("diagnosis")]
    assert len(warnings) == 1 and "rank logs are no longer written" in warnings[0], warnings
    assert not (handle.run_dir / detached.RESULT_FILE).exists()  # the disk refused it
    # The host keeps the outcome for another kernel's attach() ...
    entry = detached.find(handle.id)
    assert detached.host_alive(entry.pid) and entry.state == "done"
    later = detached.AttachedRun(entry)
    assert later.wait(30) and later.values() == [100, 101]
    # ... until it is let go; the terminal says what that was.
    stopped = cli("stop", handle.id)
    assert "had ended (done)" in stopped.stdout, stopped
    assert wait_until(lambda: not processes_of(entry.pid), 15)


@pytest.mark.slow
def test_a_held_outcome_is_written_once_the_disk_has_room_and_the_host_ends(
    registry, full_disk, monkeypatch
):
    handle = nblaunch.notebook_launcher(
        spam, (50_000, 0.5), 2, detach=True, display="none", run_dir=full_disk / "out"
    )
    assert handle.result(timeout=180) == [100, 101]
    entry = detached.find(handle.id)
    assert detached.host_alive(entry.pid)
    (handle.run_dir / "rank0.log").unlink()  # room again: the host's next try writes the file
    assert wait_until(lambda: not processes_of(entry.pid), 30)
    assert nblaunch.attach(handle.id).state == "done"
    assert detached.AttachedRun(entry).values() == [100, 101]  # from result.pkl now
