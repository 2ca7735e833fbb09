"""Nothing outlives a run, and every way a rank can end is named (real processes, 2 CPU ranks).

A rank's children (a subprocess, a daemon that called setsid, a multiprocessing child) end with
the run; ``sys.exit`` in a rank is reported, never re-raised in the caller; bad launch options are
refused before any process starts; a known root cause stops blocked ranks at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import psutil
import pytest
from conftest import assert_no_ranks_left, rank_children, wait_until

import nblaunch
from nblaunch import LaunchError, RankFailedError, notebook_launcher
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.options import LaunchOptions


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_children(pids_file: str, fail: bool) -> None:
    """Start the children real code starts (a tool, a daemon, a worker), note them, end."""
    import multiprocessing
    import subprocess
    import time

    import torch.distributed

    tool = subprocess.Popen(["sleep", "120"])
    daemon = subprocess.Popen(["sleep", "121"], start_new_session=True)  # as setsid does
    worker = multiprocessing.Process(target=time.sleep, args=(122,))
    worker.start()
    pids = [tool.pid, daemon.pid, worker.pid]
    with open(f"{pids_file}.{nblaunch.rank()}", "w") as out:
        json.dump(pids, out)
    torch.distributed.barrier()  # every rank has started its children
    if fail and nblaunch.rank() == 1:
        raise ValueError("boom after starting children")


def noted_pids(pids_file: Path) -> list[int]:
    return [pid for rank in (0, 1) for pid in json.loads(Path(f"{pids_file}.{rank}").read_text())]


@pytest.mark.parametrize("fail", [False, True], ids=["returned", "raised"])
def test_the_children_of_ranks_end_with_the_run(tmp_path, fail):
    pids_file = tmp_path / "pids"
    if fail:
        with pytest.raises(ValueError, match="boom after starting children"):
            launch(start_children, (str(pids_file), fail))
    else:
        launch(start_children, (str(pids_file), fail))
    ended = time.monotonic()
    pids = noted_pids(pids_file)
    assert wait_until(lambda: not any(map(alive, pids)), timeout=5), [
        pid for pid in pids if alive(pid)
    ]
    assert time.monotonic() - ended < 5
    assert_no_ranks_left(5)


SCRIPT_WITH_CHILDREN = """
    import sys
    import nblaunch
    sys.path.insert(0, {tests!r})
    from test_containment import start_children

    nblaunch.notebook_launcher(
        start_children, ({pids!r}, False), num_processes=2, device_type="cpu", display="none"
    )
    print("launch returned")
"""


def leave_a_thread_running() -> int:
    import threading

    threading.Thread(target=time.sleep, args=(120,), name="left-running").start()  # no daemon
    return os.getpid()


def note_pid_then_sleep(folder: str) -> None:
    Path(folder, str(os.getpid())).touch()
    time.sleep(60)


def test_a_killed_forkserver_is_named_and_its_orphaned_ranks_end_with_the_run(tmp_path):
    """The forkserver reports each rank it started as exited with 255 once it dies, while the
    ranks run on: the run says so, ends them, and the next launch gets a new forkserver."""
    from multiprocessing import forkserver

    notebook_launcher(lambda: None, (), 2, display="none")  # the forkserver is up
    server_pid = forkserver._forkserver._forkserver_pid
    pids = tmp_path / "pids"
    pids.mkdir()

    def kill_the_forkserver_once_ranks_run() -> None:
        if wait_until(lambda: len(list(pids.iterdir())) == 2, 30):
            os.kill(server_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_forkserver_once_ranks_run)
    killer.start()
    began = time.monotonic()
    with pytest.raises(RankFailedError, match="the forkserver that started it died"):
        notebook_launcher(note_pid_then_sleep, (str(pids),), 2, display="none")
    killer.join()
    assert time.monotonic() - began < 20  # not the 60 s the ranks would sleep
    ranks = [int(path.name) for path in pids.iterdir()]
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in ranks), 5), ranks
    assert notebook_launcher(os.getpid, (), 2, display="none")[0] not in ranks


def test_a_forkserver_that_dies_as_a_launch_reaches_it_is_replaced(monkeypatch):
    """An interrupt of a kernel reaches its process group, the forkserver too while it still
    imports torch (it ignores SIGINT only after): the launch that finds it alive and then
    cannot connect (refused, or the connection closed) starts a new one."""
    from multiprocessing import forkserver

    notebook_launcher(lambda: None, (), 2, display="none")  # the forkserver is up
    server_pid = forkserver._forkserver._forkserver_pid
    os.kill(server_pid, signal.SIGKILL)
    assert wait_until(lambda: psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE, 5)
    waitpid = os.waitpid
    looked = []

    def still_alive_once(pid, options):  # the launch looks before the end is known
        if pid == server_pid and not looked:
            looked.append(pid)
            return 0, 0
        return waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", still_alive_once)
    assert notebook_launcher(os.getpid, (), 2, display="none")[0] != server_pid
    assert looked and forkserver._forkserver._forkserver_pid != server_pid


def test_a_thread_left_running_does_not_keep_a_finished_rank_alive():
    pids = notebook_launcher(leave_a_thread_running, (), 2, device_type="cpu", display="none")
    # The launch returned; Python's exit would wait 120 s for the thread: the rank goes anyway.
    # Not through rank_children(), which would give the ranks their time to exit itself.
    gone = wait_until(lambda: not [p for p in pids if alive(p)], timeout=3)
    assert gone, [p for p in pids if alive(p)]


def test_a_script_whose_ranks_started_children_ends_and_closes_its_output(tmp_path):
    """A harness that waits for the end of the script's output (CI, capture_output) is not
    held by a child that inherited it."""
    script = tmp_path / "train.py"
    pids_file = tmp_path / "pids"
    script.write_text(
        textwrap.dedent(SCRIPT_WITH_CHILDREN).format(
            tests=str(Path(__file__).parent), pids=str(pids_file)
        )
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "launch returned" in done.stdout
    assert time.monotonic() - started < 60  # the children sleep 120 s
    assert not any(map(alive, noted_pids(pids_file)))


def test_in_a_kernel_sys_exit_fails_the_cell_and_a_killed_kernel_leaves_nothing(kernel, tmp_path):
    pids_file = tmp_path / "pids"
    kernel.run(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})")
    exited = kernel.run(
        "import nblaunch\n"
        "from test_containment import exit_on_rank_1\n"
        "nblaunch.notebook_launcher(exit_on_rank_1, (0,), 2, device_type='cpu', display='text')",
        timeout=120,
    )
    assert exited["error"] == "RankFailedError", exited  # not SystemExit and "To exit: ..."
    assert exited["message"].startswith("rank 1 of 2 called sys.exit(0) while rank 0 waits")
    kernel_pid = kernel.pid()
    kernel.client.execute(
        "import nblaunch, time\n"
        "from test_containment import start_children\n"
        "def train(path):\n"
        "    start_children(path, False)\n"
        "    time.sleep(120)\n"
        f"nblaunch.notebook_launcher(train, ({str(pids_file)!r},), num_processes=2, "
        "device_type='cpu', display='none')\n"
    )
    assert wait_until(lambda: Path(f"{pids_file}.1").exists(), timeout=60)
    assert wait_until(lambda: Path(f"{pids_file}.0").exists(), timeout=10)
    family = [p.pid for p in psutil.Process(kernel_pid).children(recursive=True)]
    children = noted_pids(pids_file)
    os.kill(kernel_pid, signal.SIGKILL)
    everything = set(family) | set(children)  # ranks, forkserver, resource tracker, children
    assert wait_until(lambda: not any(map(alive, everything)), timeout=10), [
        psutil.Process(pid).cmdline() for pid in everything if alive(pid)
    ]


# --- sys.exit in a rank --------------------------------------------------------------------------


def exit_on_rank_1(code):
    import sys

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        sys.exit(code)
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that left


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_on_one_rank_is_a_rank_failure_and_the_caller_goes_on(code):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(exit_on_rank_1, (code,))
    assert time.monotonic() - started < 30
    assert info.value.rank == 1
    assert info.value.exitcode == code
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"rank 1 of 2 called sys.exit({code})"), first_line
    if code == 0:
        assert "rank 1 exited after 0 collectives; rank 0 waits in all_reduce" in first_line
    assert_no_ranks_left(5)


def exit_everywhere():
    import sys

    sys.exit(0)  # the end of a script written as sys.exit(main())


def test_sys_exit_0_on_every_rank_is_a_normal_end():
    assert launch(exit_everywhere) == [None, None]


SCRIPT_WITH_EXIT = """
    import sys
    import nblaunch
    sys.path.insert(0, {tests!r})
    from test_containment import exit_on_rank_1

    try:
        nblaunch.notebook_launcher(
            exit_on_rank_1, (0,), num_processes=2, device_type="cpu", display="none"
        )
    except nblaunch.RankFailedError as exc:
        print("caught:", str(exc).splitlines()[0])
    print("the script went on")
"""


def test_a_script_goes_on_after_a_rank_called_sys_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT_WITH_EXIT).format(tests=str(Path(__file__).parent)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "caught: rank 1 of 2 called sys.exit(0)" in done.stdout
    assert "the script went on" in done.stdout


# --- bad input, refused before any process starts ------------------------------------------------


def test_too_many_cpu_ranks_are_refused_with_the_limit_and_the_way_past_it(monkeypatch):
    monkeypatch.delenv("NBLAUNCH_MAX_PROCESSES", raising=False)
    cores = os.cpu_count() or 1
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(lambda: None, num_processes=10_000, device_type="cpu", display="none")
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert f"10000 CPU ranks on {cores} cores" in message
    assert "NBLAUNCH_MAX_PROCESSES=10000" in message
    assert not rank_children()
    monkeypatch.setenv("NBLAUNCH_MAX_PROCESSES", "10000")
    plan = plan_launch(lambda: None, 10_000, LaunchOptions(device_type="cpu"))
    assert plan.world_size == 10_000  # allowed, with the usual oversubscription warning
    assert any("share cores" in warning for warning in plan.warnings)


def test_a_run_dir_that_cannot_be_made_is_refused_before_ranks_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(LaunchError) as info:
        launch(lambda: None, run_dir=blocker / "runs")
    assert str(blocker / "runs") in str(info.value)
    assert "run_dir=" in str(info.value)
    assert not rank_children()


def test_a_deleted_working_directory_is_refused_with_the_fix(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(LaunchError) as info:
        launch(lambda: None, run_dir=tmp_path / "runs")
    assert "working directory" in str(info.value)
    assert "os.chdir" in str(info.value)


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot render")


def raise_unprintable():
    if nblaunch.rank() == 1:
        raise UnprintableError("x")


def test_an_exception_that_cannot_be_printed_still_names_its_type_and_rank():
    with pytest.raises(Exception) as info:
        launch(raise_unprintable)
    assert type(info.value).__name__ == "UnprintableError"
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 2" in notes


# --- a known root cause stops blocked ranks at once ----------------------------------------------


def fail_while_peer_ignores_sigterm(stamp):
    import signal
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as Lightning's handler effectively does
        dist.all_reduce(torch.ones(1))  # blocked: its peer is gone
    else:
        time.sleep(0.5)
        with open(stamp, "w") as out:
            out.write(repr(time.time()))
        raise ValueError("rank 1 failed")


def test_a_known_root_cause_stops_a_blocked_rank_at_once_and_quietly(tmp_path):
    stamp = tmp_path / "failed_at"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignored SIGTERM; killing it"
        with pytest.raises(ValueError, match="rank 1 failed"):
            launch(fail_while_peer_ignores_sigterm, (str(stamp),))
    delay = time.time() - float(stamp.read_text())
    assert delay < 1.0, delay  # 0.5 s of grace at most, plus reading the failure
    assert_no_ranks_left(5)
