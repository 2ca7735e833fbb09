"""The persistent rank pool: real rank processes kept across tasks (CPU, gloo, 2 ranks).

The notebook-level behaviour (``%dist start``, ``%%distributed`` on the pool, the kernel's
interrupt button, kernel death) is tested through a real kernel in ``test_pool_kernel.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import ClassVar

import psutil
import pytest
from conftest import kernel_pool_pids, rank_children, wait_until

import nblaunch
from nblaunch import LaunchError, RankFailedError, notebook_launcher
from nblaunch.engine.pool.task_end import INTERRUPT_WAIT_S
from nblaunch.events import Lifecycle
from nblaunch.notebook import views
from nblaunch.notebook.pool import Pool, parse_ranks
from nblaunch.notebook.pool_start import start_pool
from nblaunch.notebook.views import RecordingView
from nblaunch.ranks.namespace import rank_namespace


class Recorder(RecordingView):
    """A view that keeps every event, one list per task that showed something, so tests can
    see where output went (a task's view that is never shown is never given an event)."""

    tasks: ClassVar[list[list[dict]]] = []

    def handle(self, event) -> None:
        if not self.events:
            Recorder.tasks.append(self.events)
        super().handle(event)


def lines(events, rank=None):
    return [
        e["text"] for e in events if e["kind"] == "stream" and (rank is None or e["rank"] == rank)
    ]


@pytest.fixture
def pool():
    pool = start_pool(2, device_type="cpu", display="none")
    yield pool
    pool.close()


@pytest.fixture
def recorded(pool, monkeypatch):
    pool.display = "text"  # any view but "none"; make_view below hands out recorders
    Recorder.tasks = []
    monkeypatch.setattr("nblaunch.notebook.views.choose.make_view", lambda display: Recorder())
    return Recorder.tasks


def interrupt_after(seconds: float) -> threading.Timer:
    """Press the notebook's interrupt button: SIGINT to this process, from a helper thread."""
    timer = threading.Timer(seconds, signal.raise_signal, args=(signal.SIGINT,))
    timer.start()
    return timer


# --- functions the ranks run ------------------------------------------------------------------


def remember(value):
    import torch.distributed as dist

    rank_namespace()["value"] = value * (dist.get_rank() + 1)
    return os.getpid()


def recall():
    return rank_namespace().get("value")


def all_reduce_sum():
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return total.item()


def sleep_and_count(seconds):
    namespace = rank_namespace()
    namespace["entered"] = namespace.get("entered", 0) + 1
    print("sleeping", flush=True)
    time.sleep(seconds)
    return "woke"


def entered():
    return rank_namespace().get("entered")


def rank_one_stuck_in_all_reduce():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


# --- running tasks ----------------------------------------------------------------------------


def test_state_and_process_group_persist_across_tasks(pool):
    pids = pool.run(remember, 10)
    assert pids == pool.pids  # the same processes ran the task
    assert pool.run(recall) == [10, 20]
    assert pool.run(all_reduce_sum) == [3.0, 3.0]
    assert pool.run(recall) == [10, 20]
    assert pool.state is Lifecycle.IDLE
    assert pool.run(os.getpid) == pids


def tutorial_ddp(leave_at: int | None = None) -> str:
    """The PyTorch DDP tutorial's shape: its own set-up and clean-up of the process group in
    every run; with ``leave_at``, rank 1 leaves the loop at that step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 5))
    for step in range(6):
        if dist.get_rank() == 1 and step == leave_at:
            return "left"
        model(torch.randn(2, 4)).sum().backward()  # rank 0 waits here
    dist.destroy_process_group()
    return "done"


def test_a_hang_in_a_group_the_last_task_destroyed_and_this_one_made_again(pool):
    """Each task after the first runs on a default group made again: the flight recorder
    numbers it apart from its name, and the hang was reported in "subgroup 2", unnamed."""
    assert pool.run(tutorial_ddp) == ["done", "done"]
    assert pool.run(tutorial_ddp) == ["done", "done"]
    with pytest.raises(nblaunch.DistributedHangError) as info:
        pool.run(tutorial_ddp, 3)
    text = str(info.value)
    assert "rank 1 returned after 8 collectives" in text, text
    assert "rank 0 waits in DDP gradient all-reduce (collective #9, shapes [[25]])" in text, text


def test_run_on_some_ranks(pool):
    pool.run(remember, 1)
    assert pool.run_on(1, recall) == [2]
    assert pool.run_on("0-1", recall) == [1, 2]
    assert pool.run_on([1, 0], recall) == [1, 2]  # rank order, whatever order was asked
    with pytest.raises(LaunchError, match="ranks 0-1"):
        pool.run_on(2, recall)


def test_parse_ranks():
    assert parse_ranks(0, 4) == [0]
    assert parse_ranks("0,2", 4) == [0, 2]
    assert parse_ranks("1-3", 4) == [1, 2, 3]
    assert parse_ranks(" 3, 0-1 ", 4) == [0, 1, 3]
    for bad in ("4", "x", "1-", -1, True, [5]):
        with pytest.raises(LaunchError):
            parse_ranks(bad, 4)


def test_a_rank_exception_fails_the_task_and_the_pool_stays_usable(pool):
    def boom():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("boom on one rank")
        return "fine"

    pool.run(remember, 3)
    with pytest.raises(ValueError, match="boom on one rank") as info:
        pool.run(boom)
    assert "raised on rank 1 of 2" in "\n".join(info.value.__notes__)
    assert pool.state is Lifecycle.IDLE
    assert pool.run(recall) == [3, 6]


def test_output_shows_under_its_own_task(pool, recorded):
    def chatty(word):
        import sys
        import threading
        import time

        print(f"{word} line")
        sys.stdout.write(f"{word} without newline")  # still belongs to this task

        def later():
            time.sleep(0.3)
            print(f"{word} from a thread after the task")

        threading.Thread(target=later).start()

    pool.run(chatty, "first")
    time.sleep(0.6)  # the thread prints between the tasks
    pool.run(chatty, "second")
    first, second = recorded
    assert lines(first, 0) == ["first line", "first without newline"]
    assert lines(second, 0) == ["second line", "second without newline"]
    # What a thread printed between tasks is in the rank's log file, not under a task.
    pool.close()
    log = (pool.engine.plan.run_dir / "rank0.log").read_text()
    assert "first from a thread after the task" in log


def test_the_view_is_built_only_when_a_task_has_something_to_show(pool, recorded):
    pool.run(recall)  # the ranks import this test module: slow enough for a live view
    recorded.clear()
    pool.run(recall)  # quick, silent, successful: like a plain cell, nothing to show
    assert recorded == []
    pool.run(print, "hello")
    assert len(recorded) == 1 and lines(recorded[0]) == ["hello", "hello"]
    assert recorded[0][0]["kind"] == "run_info"  # the late view still gets every event
    pool.run(time.sleep, views.LIVE_VIEW_AFTER_S + 0.3)  # long enough for a live view
    assert len(recorded) == 2 and recorded[1][-1]["kind"] == "run_ended"
    with pytest.raises(ZeroDivisionError):
        pool.run(divmod, 1, 0)
    assert len(recorded) == 3 and any(e["kind"] == "diagnosis" for e in recorded[2])


def test_trivial_task_round_trip_is_fast(pool):
    pool.run(recall)
    rounds = 30
    began = time.perf_counter()
    for _ in range(rounds):
        pool.run(recall)
    per_task = (time.perf_counter() - began) / rounds
    assert per_task < 0.05, f"{per_task * 1000:.1f} ms per trivial task"  # target: < 5 ms


# --- interrupts -------------------------------------------------------------------------------


def test_interrupt_stops_the_task_on_every_rank_and_keeps_the_pool(pool):
    pool.run(remember, 5)
    pids = pool.pids
    interrupt_after(1.0)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        pool.run(sleep_and_count, 30)
    assert time.monotonic() - began < 5.0
    assert "the pool is ready for the next cell" in "\n".join(info.value.__notes__)
    assert pool.state is Lifecycle.IDLE
    assert pool.pids == pids
    assert pool.run_on(0, entered) == [1]
    assert pool.run(recall) == [5, 10]  # state survived the interrupt


def test_a_task_timeout_stops_the_task_and_keeps_the_pool(pool):
    from nblaunch import LaunchTimeoutError
    from nblaunch.engine.plan.launch_plan import serialize_payload

    pool.run(remember, 4)
    began = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match="timeout=0.5 s ran out"):
        pool.run_payload(serialize_payload(time.sleep, (30,)), timeout=0.5)
    assert time.monotonic() - began < 5.0
    assert pool.state is Lifecycle.IDLE
    assert pool.run(recall) == [4, 8]


def test_sigint_between_tasks_does_not_end_a_rank(pool):
    for pid in pool.pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    assert pool.run(os.getpid) == pool.pids


def slow_set_up_on_rank_0():
    """From now on rank 0 takes a second to set up each task (its hooks), as a loaded machine
    can make it."""
    from nblaunch.ranks import this_rank

    if nblaunch.rank() == 0:
        this_rank.add_task_hook(lambda context: _sleeping(1.0))


def _sleeping(seconds: float):
    import contextlib

    time.sleep(seconds)
    return contextlib.nullcontext()


def fail_on_rank_1_while_rank_0_waits():
    if nblaunch.rank() == 1:
        raise ValueError("rank 1 fails at once")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # for rank 1, which never comes: only an interrupt ends it
        time.sleep(0.01)


def test_a_peer_stopped_while_it_still_sets_its_task_up_stops_as_its_code_starts(pool):
    # Rank 1 fails before rank 0's task code starts: the pool's interrupt reached rank 0 in its
    # set-up, and was ignored there (the pool restarted after 3 s, "did not stop" on 3.10).
    pool.run(slow_set_up_on_rank_0)
    old_pids = pool.pids
    began = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 fails at once"):
        pool.run(fail_on_rank_1_while_rank_0_waits)
    assert time.monotonic() - began < 1.0 + INTERRUPT_WAIT_S
    assert pool.state is Lifecycle.IDLE and pool.restarts == 0 and pool.pids == old_pids


def test_an_interrupt_while_a_peer_waits_in_a_collective_keeps_the_names(pool):
    # Rank 0 sleeps (the interrupt stops it); rank 1 waits in all_reduce, where no signal
    # reaches it: rank 0 issues the all_reduce it owes, and rank 1 stops there too.
    pool.run(remember, 7)
    old_pids = pool.pids
    interrupt_after(1.0)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        pool.run(rank_one_stuck_in_all_reduce)
    elapsed = time.monotonic() - began
    notes = "\n".join(info.value.__notes__)
    assert "interrupted on rank(s) 0, 1" in notes
    assert "rank 0 issued torch.distributed.all_reduce" in notes and "names kept" in notes
    assert elapsed < 1.0 + INTERRUPT_WAIT_S, elapsed  # no wait for the pool's restart
    assert pool.state is Lifecycle.IDLE and pool.restarts == 0 and pool.pids == old_pids
    assert pool.run(recall) == [7, 14]
    assert pool.run(all_reduce_sum) == [3.0, 3.0]


# --- dead ranks -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_dead_rank_fails_the_task_and_the_next_one_fast(pool, how):
    def die(how):
        import os
        import signal
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            print("going down", flush=True)
            if how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    with pytest.raises(RankFailedError) as info:
        pool.run(die, how)
    error = info.value
    assert error.rank == 1
    assert (error.exitcode, error.signal) == ((3, None) if how == "exit" else (-9, 9))
    assert "going down" in str(error)
    assert "%dist restart" in "\n".join(error.__notes__)
    assert pool.state is Lifecycle.BROKEN
    assert wait_until(lambda: not any(_alive(p) for p in pool.pids), timeout=5)
    began = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 .*%dist restart"):
        pool.run(recall)
    assert time.monotonic() - began < 1.0
    pool.restart()
    assert pool.run(all_reduce_sum) == [3.0, 3.0]


def test_a_rank_killed_between_tasks_is_reported_on_the_next_task(pool):
    os.kill(pool.pids[0], signal.SIGKILL)
    assert wait_until(lambda: not _alive(pool.pids[0]), timeout=5)
    # Depending on when the forkserver reports the exit, the check before the task or the task
    # itself sees the death; either way the cause is named and nothing hangs.
    with pytest.raises((LaunchError, RankFailedError), match="rank 0 .*SIGKILL"):
        pool.run(recall)
    assert pool.state is Lifecycle.BROKEN
    with pytest.raises(LaunchError, match="rank 0 .*SIGKILL.*%dist restart"):
        pool.run(recall)


# --- lifecycle --------------------------------------------------------------------------------


def test_close_stops_every_rank_and_a_closed_pool_says_how_to_start():
    pool = start_pool(2, device_type="cpu", display="none")
    pids = pool.pids
    assert {p.pid for p in rank_children()} >= set(pids)
    pool.close()
    assert not any(_alive(pid) for pid in pids)
    assert nblaunch.notebook.pool.current_pool() is None
    with pytest.raises(LaunchError, match="start_pool"):
        pool.run(recall)
    pool.close()  # twice is fine


def test_context_manager_and_restart_keep_the_options():
    with Pool(2, device_type="cpu", display="none", debug=True) as pool:
        assert pool.run(lambda: nblaunch.ranks.this_rank.current().debug) == [True, True]
        first = pool.pids
        pool.restart()
        assert set(pool.pids).isdisjoint(first)
        assert pool.run(lambda: nblaunch.ranks.this_rank.current().debug) == [True, True]
    assert pool.state is Lifecycle.CLOSED
    assert not any(_alive(pid) for pid in pool.pids)


def test_second_pool_and_one_shot_launch_are_refused_while_a_pool_runs(pool):
    with pytest.raises(LaunchError, match="a pool is already running.*%dist stop"):
        start_pool(2, device_type="cpu", display="none")
    with pytest.raises(LaunchError, match="notebook_launcher cannot start while a pool"):
        notebook_launcher(recall, (), 2, device_type="cpu", display="none")
    pool.close()
    assert notebook_launcher(recall, (), 2, device_type="cpu", display="none") == [None, None]


def test_status_reports_ranks_memory_and_names(pool):
    pool.run(remember, 2)
    text = pool.status_text()
    assert "2 CPU rank(s)" in text and "idle" in text
    for pid in pool.pids:
        assert f"pid {pid}, idle" in text
    rows = pool.status()
    assert [row["rank"] for row in rows] == [0, 1]
    assert all(row["alive"] and row["rss_mb"] > 10 and row["names"] == ["value"] for row in rows)


def _alive(pid: int | None) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, TypeError, ValueError):
        return False


# --- in a real kernel: the magics, the interrupt button, kernel death --------------------------


@pytest.mark.slow
def test_kernel_cells_keep_state_and_survive_interrupts_and_dead_ranks(kernel):
    assert kernel.run("%load_ext nblaunch")["error"] is None
    started = kernel.run("%dist start -n 2", timeout=120)
    assert "2 rank(s) ready" in started["out"], started
    assert (
        kernel.run("%%distributed\nimport torch\nx = torch.ones(1) * (rank + 1)")["error"] is None
    )
    cell = kernel.run(
        "%%distributed\nimport torch.distributed as dist\ndist.all_reduce(x)\nx.item()"
    )
    assert cell["result"] == "3.0", cell  # the tensor from the previous cell, on both ranks
    assert kernel.run("%%distributed --ranks 1\nrank, x.item()")["result"] == "(1, 3.0)"
    status = kernel.run("%dist status")["out"]
    assert "idle" in status and "x" in status, status

    # The interrupt button: KeyboardInterrupt in the cell, the ranks keep their state.
    pids = kernel_pool_pids(kernel)
    cell = kernel.run(
        "%%distributed\nimport time\nfor _ in range(600):\n    time.sleep(0.05)",
        interrupt_after=2.0,
    )
    assert cell["error"] == "KeyboardInterrupt", cell
    assert cell["seconds"] < 2.0 + 4.0
    assert kernel_pool_pids(kernel) == pids
    assert kernel.run("%%distributed\nx.item()")["result"] == "3.0"

    # A dead rank fails its cell with the cause; the next cell says what to do, at once.
    cell = kernel.run(
        "%%distributed\nimport os, time\nif rank == 1:\n    os._exit(7)\ntime.sleep(30)"
    )
    assert (
        cell["error"] == "RankFailedError" and "rank 1 of 2 exited with code 7" in cell["message"]
    )
    assert cell["seconds"] < 10
    cell = kernel.run("%%distributed\nx.item()")
    assert "%dist restart" in cell["out"] + cell["message"] and cell["seconds"] < 2, cell
    assert "fresh rank(s)" in kernel.run("%dist restart", timeout=120)["out"]
    assert kernel.run("%%distributed\n'x' in dir()")["result"] == "False"
    new_pids = kernel_pool_pids(kernel)
    assert "stopped 2 rank(s)" in kernel.run("%dist stop")["out"]
    assert wait_until(lambda: not any(_alive(pid) for pid in new_pids), timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("end", ["kill", "shutdown"])
def test_no_rank_survives_its_kernel(kernel, end):
    kernel.run("import nblaunch\npool = nblaunch.start_pool(2, device_type='cpu')", timeout=120)
    pids = kernel_pool_pids(kernel)
    assert all(_alive(pid) for pid in pids)
    if end == "kill":
        os.kill(kernel.pid(), signal.SIGKILL)
    else:
        kernel.manager.shutdown_kernel(now=False)
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10), [
        pid for pid in pids if _alive(pid)
    ]
