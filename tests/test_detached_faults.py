"""Detached runs and pools under faults (issue 40): a full disk, two kernels on one pool, two runs
whose directories share a name, a run host that was killed. Real processes and real kernels.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import Kernel, wait_until
from test_detached import processes_of
from test_disk import failing_disk, tmpfs  # noqa: F401  (failing_disk: a fixture)

import nblaunch
from nblaunch.engine.detached import attached, host_files
from nblaunch.engine.detached import registry as detached
from nblaunch.notebook.views import RecordingView


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A registry of detached runs of this test's own (kernels started after it inherit it)."""
    path = tmp_path / "detached"
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(path))
    yield path
    for file in path.glob("*.json"):  # a failed test's hosts, and those holding an outcome
        entry = detached.Entry.read(file)
        if entry is not None and detached.host_alive(entry.pid):
            with contextlib.suppress(OSError):
                os.killpg(entry.pid, signal.SIGKILL)


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB tmpfs of our own (as the issue's), unmounted afterwards; needs root."""
    with tmpfs(tmp_path / "disk", "1m") as mount:
        yield mount


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
    assert not (handle.run_dir / host_files.RESULT_FILE).exists()  # the disk refused it
    # The host keeps the outcome for another kernel's attach() ...
    entry = detached.find(handle.id)
    assert detached.host_alive(entry.pid) and entry.state == "done"
    later = attached.AttachedRun(entry)
    assert later.wait(30) and later.values() == [100, 101]
    # ... until it is let go; the terminal says what that was.
    stopped = cli("stop", handle.id)
    assert "had ended (done)" in stopped.stdout, stopped
    assert wait_until(lambda: not processes_of(entry.pid), 15)


@pytest.mark.slow
def test_in_a_kernel_the_launch_cells_view_of_a_full_disk_run_gets_every_line(
    registry, full_disk, tmp_path
):
    kernel = Kernel(tmp_path)
    try:
        kernel.run(
            "import nblaunch, time\n"
            "import nblaunch.notebook.views.choose as choose\n"
            "made = []\nmake_view = choose.make_view\n"
            "choose.make_view = lambda display: made.append(make_view(display)) or made[-1]\n"
            "def spam(lines):\n"
            "    import time, torch.distributed as dist\n"
            "    rank = dist.get_rank()\n"
            "    time.sleep(2)\n"
            "    for i in range(lines):\n"
            "        print(f'rank {rank} line {i:08d} ' + 'x' * 42)\n"
            "    return rank + 100\n"
        )
        cell = kernel.run(
            f"h = nblaunch.notebook_launcher(spam, (50_000,), 2, detach=True, "
            f"run_dir={str(full_disk / 'out')!r})"
        )
        assert cell["error"] is None, cell
        got = kernel.run(
            "print(h.result(timeout=180))\n"
            "deadline = time.monotonic() + 120\n"
            "while made[0].model.lines_received < 100_000 and time.monotonic() < deadline:\n"
            "    time.sleep(0.1)\n"
            "print(made[0].model.lines_received)",
            timeout=320,
        )
        assert got["out"].split()[-3:] == ["[100,", "101]", "100000"], got
    finally:
        kernel.close()


@pytest.mark.slow
def test_an_outcome_file_is_whole_or_not_there(tmp_path, monkeypatch):
    """The host writes its outcome beside the file and renames it over: a notebook that attaches
    while the host writes it (or retries it on a full disk) never reads a part of it, which it
    would take for a lost run; a write the disk cuts short leaves what was there."""
    import errno
    import stat

    from nblaunch.host import outcome

    path = tmp_path / host_files.RESULT_FILE
    outcome.write_private(path, b"old")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    class CutShort:  # a disk that fills up half-way through the write
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: CutShort(fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space left"):
        outcome.write_private(path, b"the new outcome")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [host_files.RESULT_FILE]  # nothing left over


def test_a_held_outcome_is_written_once_the_disk_has_room_and_the_host_ends(
    registry, full_disk, monkeypatch
):
    handle = nblaunch.notebook_launcher(
        spam, (50_000, 0.5), 2, detach=True, display="none", run_dir=full_disk / "out"
    )
    assert handle.result(timeout=180) == [100, 101]
    entry = detached.find(handle.id)
    assert detached.host_alive(entry.pid)
    # Room again: the host's next try writes the file. Both logs go, as which rank filled the
    # disk is a race (under load rank 0's log may hold nothing to free).
    for rank in (0, 1):
        (handle.run_dir / f"rank{rank}.log").unlink()
    host_log = handle.run_dir / "host.log"
    assert wait_until(lambda: not processes_of(entry.pid), 30), host_log.read_text()
    assert nblaunch.attach(handle.id).state == "done"
    assert attached.AttachedRun(entry).values() == [100, 101]  # from result.pkl now


# --- 2. two kernels and one detached pool -------------------------------------------------------

RAW_SOCKET_ERRORS = ("ConnectionResetError", "BrokenPipeError", "Errno")


def said(cell: dict) -> str:
    """All a cell showed: its printed text, its result and its error."""
    return f"{cell['out']}\n{cell['result']}\n{cell['error']}: {cell['message']}"


@pytest.mark.slow
def test_two_kernels_one_detached_pool_each_is_told_in_words(registry, tmp_path):
    first, second = Kernel(tmp_path), Kernel(tmp_path)
    try:
        for kernel in (first, second):
            kernel.run("%load_ext nblaunch")
        started = first.run("%dist start -n 2 --detach", timeout=120)
        assert "ready" in started["out"], started
        entry = detached.find(None, kind="pool")
        assert first.run("%%distributed\nx = rank + 7\nx")["result"] == "7"
        # The second kernel is refused at once, told who drives the pool and how to take it.
        refused = second.run("%dist attach")
        assert refused["seconds"] < 5, refused
        assert "is driven by kernel" in said(refused) and "--take-over" in said(refused), refused
        # It takes over while the first runs a cell: it waits for that cell, and says so.
        first.client.execute("%%distributed\nimport time\ntime.sleep(3)\nx")
        time.sleep(1.0)
        taken = second.run("%dist attach --take-over", timeout=60)
        assert "taking it over when that cell ends" in taken["out"], taken
        assert "attached to detached" in taken["out"], taken
        assert second.run("%%distributed\nx")["result"] == "7"  # the same ranks, same names
        # The first kernel's next command says who took the pool; stop stops nothing.
        stop = first.run("%dist stop", timeout=30)
        assert "nothing stopped here" in stop["out"] and "took over" in stop["out"], stop
        assert not any(word in said(stop) for word in RAW_SOCKET_ERRORS), stop
        assert detached.host_alive(entry.pid)
        assert second.run("%%distributed\nx + 1")["result"] == "8"
        # Stopped from a terminal: the second kernel's next cell says so.
        assert "stopped" in cli("stop", entry.run_id).stdout
        cell = second.run("%%distributed\nx")
        assert "UsageError: the detached pool" in said(cell), cell
        assert "was stopped from outside" in said(cell), cell
        assert not any(word in said(cell) for word in RAW_SOCKET_ERRORS), cell
        status = second.run("%dist status")
        assert "none is running" in status["out"], status
    finally:
        first.close()
        second.close()


@pytest.mark.slow
def test_a_killed_pool_host_is_told_in_words_by_the_next_cell(registry, tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext nblaunch")
        assert "ready" in kernel.run("%dist start -n 2 --detach", timeout=120)["out"]
        entry = detached.find(None, kind="pool")
        os.kill(entry.pid, signal.SIGKILL)
        assert wait_until(lambda: not detached.host_alive(entry.pid), 10)
        status = kernel.run("%dist status")
        assert "ended without a word (killed?)" in status["out"], status
        assert not any(word in said(status) for word in RAW_SOCKET_ERRORS), status
        stop = kernel.run("%dist stop")
        assert "stopped 2 rank" not in stop["out"], stop
    finally:
        kernel.close()


# --- 4. run ids ---------------------------------------------------------------------------------


def tagged(tag, seconds):
    import time

    import torch.distributed as dist

    time.sleep(seconds)
    return f"{tag}{dist.get_rank()}"


@pytest.mark.slow
def test_two_run_dirs_of_one_name_get_two_ids_each_listed_attached_and_stopped(registry, tmp_path):
    a = nblaunch.notebook_launcher(
        tagged, ("a", 3), 2, detach=True, display="none", run_dir=tmp_path / "expA" / "out"
    )
    b = nblaunch.notebook_launcher(
        tagged, ("b", 600), 2, detach=True, display="none", run_dir=tmp_path / "expB" / "out"
    )
    assert a.id == "out" and b.id == "out-2", (a.id, b.id)
    listed = cli().stdout
    assert "expA" in listed and "expB" in listed, listed
    assert nblaunch.attach("out").run_dir == tmp_path / "expA" / "out"
    assert nblaunch.attach("out-2").run_dir == tmp_path / "expB" / "out"
    stopped = cli("stop", "out-2")
    assert "out-2 stopped" in stopped.stdout, stopped
    assert b.state == "stopped" or wait_until(lambda: b.state == "stopped", 30)
    assert a.result(timeout=60) == ["a0", "a1"]
    assert detached.find("out").state == "done" and detached.find("out-2").state == "stopped"
    # A later run in the same directory keeps that directory's id.
    again = nblaunch.notebook_launcher(
        tagged, ("c", 0), 2, detach=True, display="none", run_dir=tmp_path / "expA" / "out"
    )
    assert again.id == "out" and again.result(timeout=60) == ["c0", "c1"]


# --- 5. the view of a lost run ------------------------------------------------------------------


def ticking(count):
    import time

    for i in range(count):
        print(f"tick {i}", flush=True)
        time.sleep(0.05)


@pytest.mark.slow
def test_the_view_of_a_lost_run_shows_the_rank_logs_tails_and_why_it_is_lost(registry, capsys):
    handle = nblaunch.notebook_launcher(ticking, (100_000,), 2, detach=True, display="none")
    entry = detached.find(handle.id)
    log = handle.run_dir / "rank1.log"
    assert wait_until(lambda: log.exists() and "tick 20" in log.read_text(), 60)
    os.kill(entry.pid, signal.SIGKILL)  # the host dies; its ranks follow it
    assert wait_until(lambda: not processes_of(entry.pid), 15)
    with pytest.raises(nblaunch.RankFailedError, match="killed"):
        handle.result(timeout=30)
    last = log.read_text().splitlines()[-1]
    later = nblaunch.attach(handle.id)
    assert later.state == "lost"
    seen = RecordingView()
    later.watch(seen)
    assert seen.of("run_info") and last in lines_of(seen, 1), last
    (why,) = seen.of("diagnosis")
    assert "the run is lost" in why["title"] and "killed" in why["body"], why
    assert str(handle.run_dir) in why["body"] and seen.of("run_ended")
    capsys.readouterr()
    later.view("text")
    shown = capsys.readouterr()
    assert last in shown.out and "the run is lost" in shown.err, shown


# --- the sweep ----------------------------------------------------------------------------------


def fail_the_disk_midway(trigger):
    """Print; halfway, rank 0 makes the run directory's disk fail (it turns read-only)."""
    import time
    from pathlib import Path

    import nblaunch

    for step in range(400):
        print(f"step {step}", flush=True)
        time.sleep(0.005)
        if step == 200 and nblaunch.rank() == 0:
            Path(trigger).write_text("1")
    return nblaunch.rank()


@pytest.mark.slow
def test_a_disk_turned_read_only_mid_run_keeps_a_detached_runs_lines_and_values(
    registry,
    failing_disk,  # noqa: F811
):
    mount, trigger = failing_disk
    seen = RecordingView()
    handle = nblaunch.notebook_launcher(
        fail_the_disk_midway, (str(trigger),), 2, detach=True, display="none", run_dir=mount / "out"
    )
    handle.watch(seen)
    assert handle.result(timeout=120) == [0, 1]
    assert wait_until(lambda: seen.of("run_ended"), 30)
    assert "step 399" in lines_of(seen, 1)
    entry = detached.find(handle.id)
    assert detached.host_alive(entry.pid)  # it holds the outcome the disk refused
    assert "had ended (done)" in cli("stop", handle.id).stdout
    assert wait_until(lambda: not processes_of(entry.pid), 15)


def test_a_full_disk_at_the_start_is_a_clear_error_and_leaves_no_entry(registry, full_disk):
    (full_disk / "out").mkdir()
    with open(full_disk / "fill", "wb") as fill:  # fill the disk up
        with contextlib.suppress(OSError):
            while True:
                fill.write(b"x" * 65536)
    with pytest.raises(nblaunch.LaunchError, match="writing its launch file failed .No space"):
        nblaunch.notebook_launcher(
            spam, (1,), 2, detach=True, display="none", run_dir=full_disk / "out"
        )
    assert list(registry.glob("*.json")) == []  # the id it claimed is free again


def test_a_host_killed_as_it_starts_is_said_with_its_signal(registry, monkeypatch):
    real_popen = subprocess.Popen

    def popen_then_kill(*args, **kwargs):
        process = real_popen(*args, **kwargs)
        process.kill()
        return process

    monkeypatch.setattr(detached.subprocess, "Popen", popen_then_kill)
    with pytest.raises(nblaunch.LaunchError, match="did not start .killed by signal 9"):
        nblaunch.notebook_launcher(spam, (1,), 2, detach=True, display="none")
    assert list(registry.glob("*.json")) == []


def test_rank_logs_that_fail_at_a_flush_stop_once_without_a_closed_file_error(
    failing_disk,  # noqa: F811
):
    from nblaunch.engine.output.log_files import RunFiles

    mount, trigger = failing_disk
    troubles = []
    files = RunFiles(mount / "out", lambda what, path, exc: troubles.append((what, path)))
    for rank in (0, 1):
        files.open_rank(rank)
        files.log_text(rank, "buffered, not yet written\n")
    trigger.write_text("1")  # the disk turns read-only under the open files
    files.flush()  # rank 0's flush fails and closes every log: rank 1's is not flushed then
    files.close()
    assert [what for what, _ in troubles] == ["rank logs"], troubles


def sleep_then(seconds, value):
    import time

    time.sleep(seconds)
    return value


def test_a_pool_host_sees_a_killed_holder_before_its_reading_thread_does():
    """A kernel killed while idle, and the next one attaching at once: the host must not refuse
    it for a holder whose hang-up its reading thread has not yet seen (CI hit that race)."""
    import socket
    import types

    from nblaunch.host.pool import PoolServer

    ours, theirs = socket.socketpair()
    host = types.SimpleNamespace(client=ours, client_alive=True)
    try:
        assert PoolServer._holder_alive(host)  # connected, nothing sent
        theirs.sendall(b"x")
        assert PoolServer._holder_alive(host)  # a message waits to be read: still there
        theirs.close()
        assert not PoolServer._holder_alive(host)  # hung up, the unread byte notwithstanding
    finally:
        ours.close()


@pytest.mark.slow
def test_a_kernel_killed_in_a_pool_cell_does_not_keep_the_next_kernel_out(registry, capfd):
    pool = nblaunch.start_pool(2, detach=True, display="none")
    entry = pool.entry
    pool.detach()
    # A "kernel" (a process of its own) that uses the pool and exits says nothing at exit.
    script = "import nblaunch\np = nblaunch.attach_pool()\nprint(p.run(abs, -4), flush=True)\n"
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert ended.stdout.strip() == "[4, 4]" and "Exception ignored" not in ended.stderr, ended
    # One killed in the middle of a cell: the next one is not refused; it waits for that cell.
    script = (
        "import nblaunch, time\np = nblaunch.attach_pool()\n"
        "def nap():\n    print('napping', flush=True)\n    time.sleep(4)\n"
        "p.run(nap)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    log = entry.run_dir / "rank0.log"
    try:  # killed once its cell runs on the ranks
        assert wait_until(lambda: log.exists() and "napping" in log.read_text(), 60)
    finally:
        child.kill()
        child.wait()
    capfd.readouterr()
    began = time.monotonic()
    again = nblaunch.attach_pool(entry.run_id)
    assert "taking it over when that cell ends" in capfd.readouterr().out
    assert time.monotonic() - began < 10
    assert again.run(sleep_then, 0, 3) == [3, 3]
    again.close()
    assert wait_until(lambda: not processes_of(entry.pid), 15)


def test_a_rank_killed_in_a_detached_run_is_its_failure_and_the_host_ends(registry):
    handle = nblaunch.notebook_launcher(ticking, (100_000,), 2, detach=True, display="none")
    entry = detached.find(handle.id)
    log = handle.run_dir / "rank1.log"
    assert wait_until(lambda: log.exists() and "tick 5" in log.read_text(), 60)
    forkserver = next(
        p for p in psutil.Process(entry.pid).children() if "forkserver" in " ".join(p.cmdline())
    )
    ranks = forkserver.children()
    assert len(ranks) == 2
    ranks[-1].kill()
    with pytest.raises(nblaunch.RankFailedError, match="killed by SIGKILL"):
        handle.result(timeout=60)
    assert handle.state == "failed"
    assert wait_until(lambda: not processes_of(entry.pid), 15)
