"""Heartbeats, hang diagnosis and stragglers: unit tests, then real 2-rank CPU/gloo runs."""

from __future__ import annotations

import inspect
import re
import threading
import time
from types import SimpleNamespace

import pytest
from scripted import heartbeat as beat

from nblaunch import DistributedHangError, notebook_launcher
from nblaunch.engine.monitors.hang import HangMonitor
from nblaunch.engine.monitors.source_lines import cell_names
from nblaunch.engine.monitors.stragglers import find_straggler
from nblaunch.events import RunState
from nblaunch.ranks.checks import process_groups
from nblaunch.ranks.heartbeat import HeartbeatThread
from nblaunch.ranks.stacks import read_position


def line_of(function, marker: str) -> int:
    """Line number of the source line of ``function`` that contains ``marker``."""
    lines, start = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if marker in line:
            return start + offset
    raise AssertionError(f"{marker!r} not in {function.__name__}")


def shown(text: str) -> str:
    """``text`` with this file's path, however the rank wrote it, shortened to its name."""
    return re.sub(r"[^\s\"]*test_watchdog\.py", "test_watchdog.py", text)


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    kwargs.setdefault("num_processes", 2)
    return notebook_launcher(function, args, device_type="cpu", **kwargs)


# --- a stand-in for torch.distributed, found by file name like the real one ---------------------

_FAKE_C10D = compile(
    "def all_reduce(done):\n    done.wait()\n\ndef get_rank(done):\n    done.wait()\n",
    "/fake/site-packages/torch/distributed/distributed_c10d.py",
    "exec",
)
fake_c10d: dict = {}
exec(_FAKE_C10D, fake_c10d)


def train_step(done):
    fake_c10d["all_reduce"](done)  # waits here


def blocked_in_query(done):
    fake_c10d["get_rank"](done)  # a query, not a collective


def start_thread(target, done) -> threading.Thread:
    thread = threading.Thread(target=target, args=(done,), name="worker", daemon=True)
    thread.start()
    time.sleep(0.1)
    return thread


def test_read_position_finds_the_collective_and_the_users_line():
    done = threading.Event()
    thread = start_thread(train_step, done)
    try:
        import sys

        position = read_position(sys._current_frames()[thread.ident])
    finally:
        done.set()
        thread.join(2)
    assert position.collective == "all_reduce"
    assert position.where.endswith(
        f"test_watchdog.py:{line_of(train_step, 'waits here')} in train_step"
    )


def test_a_query_like_get_rank_is_not_a_collective():
    done = threading.Event()
    thread = start_thread(blocked_in_query, done)
    try:
        import sys

        position = read_position(sys._current_frames()[thread.ident])
    finally:
        done.set()
        thread.join(2)
    assert position.collective is None
    assert "in blocked_in_query" in position.where


def test_a_blocking_call_waits_in_the_last_collective_it_issued():
    # Gloo's completed count can stay one behind while the next collective waits (seen 2 in 14
    # launches under load): rank 0 in its 3rd all_reduce with #2 counted as not done.
    status = {"0": (3, 1)}
    assert process_groups.pending(status, calling=True) == ("0", 3)
    # Without a torch.distributed call on the stack (DDP's backward, work.wait()) the oldest
    # collective not completed is the one waited for.
    assert process_groups.pending(status) == ("0", 2)
    assert process_groups.pending({"0": (3, 3)}, calling=True) is None


def test_heartbeats_count_time_waiting_in_collectives():
    done = threading.Event()
    sent = []
    thread = start_thread(train_step, done)
    beat = HeartbeatThread(3, sent.append, target=thread.ident, interval=0.2)
    beat.start()
    time.sleep(0.8)
    done.set()
    thread.join(2)
    time.sleep(0.3)
    beat.stop()
    live, final = sent[:-1], sent[-1]
    assert live and all(event["rank"] == 3 for event in sent)
    waiting = [event for event in live if event["collective"] == "all_reduce"]
    assert waiting, live
    assert "train_step" in waiting[0]["where"] and 'thread "worker"' in waiting[0]["stack"]
    assert "fake_c10d" in waiting[0]["stack"] or "all_reduce" in waiting[0]["stack"]
    # ~0.8 s in the collective, then ~0.3 s outside it (generous bounds: the machine is shared)
    assert 0.5 < final["wait_s"] < 1.0, final
    assert final["busy_s"] >= final["wait_s"] + 0.2
    assert final["collective"] is None and final["still_s"] == 0.0


def test_heartbeats_report_how_long_the_thread_has_been_still():
    done = threading.Event()
    sent = []
    thread = start_thread(train_step, done)
    beat = HeartbeatThread(0, sent.append, target=thread.ident, interval=0.2)
    beat.start()
    time.sleep(1.0)
    beat.stop()
    done.set()
    thread.join(2)
    still = [event["still_s"] for event in sent[:-1]]
    assert still == sorted(still) and still[-1] > 0.5, still


def hash_for(seconds: float) -> None:
    """One C call that releases the GIL and keeps a core busy for about ``seconds``."""
    import hashlib

    started = time.perf_counter()
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 200_000)
    per_iteration = (time.perf_counter() - started) / 200_000
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", int(seconds / per_iteration))


def test_a_thread_computing_in_one_long_c_call_is_not_still():
    sent = []
    thread = threading.Thread(target=hash_for, args=(1.5,), daemon=True)
    thread.start()
    beat = HeartbeatThread(0, sent.append, target=thread.ident, interval=0.25)
    beat.start()
    thread.join(20)
    beat.stop()
    # The stack does not change during the call; the thread's CPU time shows it is working.
    live = [event["still_s"] for event in sent[:-1]]
    assert len(live) >= 3 and max(live[1:]) < 0.6, live


def test_notebook_cell_files_are_shown_as_cells_with_their_source():
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_cell("def cell_function():\n    return 42\n", store_history=True)
    filename = shell.user_ns["cell_function"].__code__.co_filename
    number = shell.compile._filename_map[filename]
    # A rank's stack has no source line for a cell (it has no copy of the cell's text).
    text = f'  File "{filename}", line 2, in cell_function\nrank 0 at {filename}:2 in cell_function'
    assert cell_names(text) == (
        f'  File "Cell In[{number}]", line 2, in cell_function\n'
        "    return 42\n"
        f"rank 0 at Cell In[{number}]:2 in cell_function"
    )


def test_find_straggler():
    assert find_straggler({0: (6.0, 10.0), 1: (0.5, 10.0)}) == (1, pytest.approx(0.55))
    assert find_straggler({0: (1.0, 10.0), 1: (0.9, 10.0)}) is None  # balanced
    assert find_straggler({0: (1.0, 1.0), 1: (0.0, 1.0)}) is None  # too short to tell
    assert find_straggler({0: (6.0, 10.0)}) is None
    rank, excess = find_straggler({0: (5.0, 10.0), 1: (5.0, 10.0), 2: (1.0, 10.0)})
    assert rank == 2 and excess == pytest.approx(0.4)


# --- the monitor on made-up heartbeats ------------------------------------------------------------


class FakeRun:
    def __init__(self, world_size=2):
        self.outcome = SimpleNamespace(finished=set(), results={})
        self.states = dict.fromkeys(range(world_size), RunState.RUNNING)
        self.last_output = {}  # rank -> clock time of its last output
        self.published = []
        self.clock = 100.0

    def now(self):
        return self.clock

    def seconds_since_output(self, rank):
        last = self.last_output.get(rank)
        return None if last is None else self.now() - last

    def set_state(self, rank, state, detail=""):
        self.states[rank] = state
        self.published.append({"kind": "state", "rank": rank, "state": state, "detail": detail})

    def publish(self, event):
        self.published.append(event)


def monitor(hang_timeout=None, world_size=2, debug=False):
    plan = SimpleNamespace(world_size=world_size, hang_timeout=hang_timeout, debug=debug)
    return HangMonitor(plan)


def returns(hang, run, rank, seq):
    hang.on_event(run, beat(rank, seq=seq))
    hang.on_event(run, {"kind": "result", "rank": rank, "value_bytes": b""})
    run.outcome.finished.add(rank)


def test_monitor_reports_a_rank_that_returned_while_another_waits():
    hang, run = monitor(), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    returns(hang, run, 1, seq=4)
    clock[0] += 0.5
    hang.on_event(run, beat(0, collective="all_reduce", seq=5, still=0.5))
    assert hang.check(run) is None  # within the grace period
    clock[0] += 0.6
    root = hang.check(run)
    assert root.rank == 1 and isinstance(root.exception, DistributedHangError)
    text = str(root.exception)
    assert "rank 1 returned after 4 collectives" in text
    assert "rank 0 waits in all_reduce (collective #5) at train.py:10 in train" in text
    assert "set_trigger" in text and "stack of rank 0" in text
    assert root.exception.stacks[0] == "stack of rank 0"
    assert run.states[0] == RunState.STALLED


def test_monitor_does_not_blame_a_returned_rank_for_a_collective_it_took_part_in():
    # seq 4 <= 4: the returned rank issued that collective (the waiting rank is only slow to
    # leave it, or it is a subgroup collective): not a certain hang.
    hang, run = monitor(), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    returns(hang, run, 1, seq=4)
    clock[0] += 3.0
    hang.on_event(run, beat(0, collective="all_reduce", seq=4, still=3.0))
    assert hang.check(run) is None


def test_monitor_without_sequence_numbers_waits_a_little_longer():
    # A backend that does not count collectives: the waiting rank must stay still for 2 s after
    # the other returned.
    hang, run = monitor(), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    hang.on_event(run, beat(0, collective="barrier", still=0.5))
    returns(hang, run, 1, seq=None)
    clock[0] += 1.5
    hang.on_event(run, beat(0, collective="barrier", still=2.0))
    assert hang.check(run) is None
    clock[0] += 1.0
    hang.on_event(run, beat(0, collective="barrier", still=3.0))
    root = hang.check(run)
    assert root is not None
    assert "rank 1 returned after its last collective" in str(root.exception)


def test_monitor_waits_for_hang_timeout_and_names_the_rank_outside_collectives():
    hang, run = monitor(hang_timeout=10.0), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]

    def beats(still):
        hang.on_event(run, beat(0, collective="barrier", seq=1, still=still))
        hang.on_event(run, beat(1, still=still, where="train.py:20 in train"))

    beats(6.0)
    assert hang.check(run) is None
    assert run.states[0] == RunState.STALLED and run.states[1] == RunState.RUNNING
    clock[0] += 3.0
    assert hang.check(run) is None  # 9 s still, as far as anyone knows
    clock[0] += 1.5
    assert hang.check(run) is None  # 10.5 s, but not seen yet: no heartbeat says so
    beats(10.5)
    root = hang.check(run)
    assert root.rank == 1
    assert root.title == (
        "rank 1 of 2 is stuck at train.py:20 in train outside any collective, while rank 0 "
        "waits for it"
    )
    assert "rank 0: in barrier (collective #1) at train.py:10 in train" in str(root.exception)


def test_monitor_treats_a_rank_without_heartbeats_as_still():
    hang, run = monitor(hang_timeout=10.0), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=1.0))
    hang.on_event(run, beat(1, still=1.0))
    clock[0] += 8.5
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=9.5))
    assert hang.check(run) is None
    clock[0] += 1.0  # rank 1 has sent nothing for 9.5 s: its task thread holds the GIL
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=10.5))
    root = hang.check(run)
    assert root is not None and root.rank == 1
    assert "no heartbeat for" in str(root.exception)


def test_monitor_waits_for_fresh_heartbeats_after_a_rank_returned():
    # Rank 0 waited long in a barrier that rank 1 has now joined and left (it returned): rank 0's
    # last heartbeat predates that, so it proves nothing; rank 0 is about to return too.
    hang, run = monitor(hang_timeout=2.0), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=3.0))
    clock[0] += 0.2
    returns(hang, run, 1, seq=1)
    clock[0] += 0.5
    assert hang.check(run) is None
    clock[0] += 5.0  # ...unless rank 0 then falls silent
    assert hang.check(run) is not None


def test_monitor_counts_output_as_progress():
    hang, run = monitor(hang_timeout=10.0), FakeRun()
    clock = [100.0]
    run.now = lambda: clock[0]
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=11.0))
    hang.on_event(run, beat(1, still=11.0))
    run.last_output[1] = clock[0] - 2.0  # rank 1 printed two seconds ago
    assert hang.check(run) is None


def test_monitor_with_hang_timeout_none_never_times_out():
    hang, run = monitor(hang_timeout=None), FakeRun()
    run.clock = 1e6
    hang.on_event(run, beat(0, collective="barrier", seq=1, still=1e5))
    hang.on_event(run, beat(1, collective="all_reduce", seq=1, still=1e5))
    assert hang.check(run) is None


def test_monitor_names_a_straggler_at_the_end():
    hang, run = monitor(), FakeRun()
    for rank, wait in ((0, 4.0), (1, 0.2)):
        event = beat(rank, seq=10)
        event.update(wait_s=wait, busy_s=10.0)
        hang.on_event(run, event)
    hang.on_event(run, {"kind": "result", "rank": 0, "value_bytes": b""})
    hang.on_event(run, {"kind": "result", "rank": 1, "value_bytes": b""})
    diagnoses = [e for e in run.published if e["kind"] == "diagnosis"]
    assert len(diagnoses) == 1 and diagnoses[0]["severity"] == "info"
    assert diagnoses[0]["title"] == "rank 1 was the slowest: the others wait 38% of the time for it"


# --- real runs: 2 ranks, CPU, gloo ----------------------------------------------------------------


def early_stop(stamp):
    import torch
    import torch.distributed as dist

    loss = torch.ones(1)
    for step in range(100):
        dist.all_reduce(loss)  # rank 0 waits here
        if dist.get_rank() == 1 and step == 3:
            with open(stamp, "w") as file:
                file.write(repr(time.time()))
            break  # rank 1 stops early on its own: the classic divergence
    return step


def count_mismatch():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    for _ in range(3 if dist.get_rank() == 0 else 2):
        dist.all_reduce(x)  # rank 0's third all_reduce
    dist.barrier()  # rank 1's barrier


def stuck_outside():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)  # rank 1 is stuck here
    dist.barrier()  # rank 0 waits here


def straggler():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    for _ in range(30):
        if dist.get_rank() == 1:
            time.sleep(0.1)  # rank 1 is slow
        dist.all_reduce(x)
    return dist.get_rank()


def busy_then_barrier():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        a = torch.rand(200, 200)
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
    dist.barrier()
    return "ok"


def prints_then_barrier():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        for i in range(10):
            print(f"waiting {i}", flush=True)
            time.sleep(0.35)
    dist.barrier()
    return "ok"


def test_early_stop_is_reported_within_seconds_naming_both_ranks_and_lines(capfd, tmp_path):
    stamp = tmp_path / "diverged"
    with pytest.raises(DistributedHangError) as info:
        launch(early_stop, args=(str(stamp),), hang_timeout=60, display="text")
    # About a second on a quiet machine; far below hang_timeout even on a loaded one.
    assert time.time() - float(stamp.read_text()) < 15
    text = shown(str(info.value))
    line = line_of(early_stop, "rank 0 waits here")
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective")
    assert "rank 1 returned after 4 collectives" in text
    assert "rank 0 waits in all_reduce (collective #5, shapes [[1]])" in text
    assert f"at test_watchdog.py:{line} in early_stop: `dist.all_reduce(loss)" in text
    assert "set_trigger" in text and "check_trigger" in text
    assert "dist.all_reduce(loss)" in info.value.stacks[0]
    err = shown(capfd.readouterr().err)
    assert f"[rank 0] STALLED: waiting in all_reduce at test_watchdog.py:{line}" in err


def test_collective_count_mismatch_reports_every_ranks_collective_and_line():
    with pytest.raises(DistributedHangError) as info:
        # The watchdog's report; with the default checks on, test_checks.py has it at the call.
        launch(count_mismatch, hang_timeout=2, debug=False)
    text = shown(str(info.value))
    reduce_line = line_of(count_mismatch, "rank 0's third all_reduce")
    barrier_line = line_of(count_mismatch, "rank 1's barrier")
    assert text.startswith("ranks 0, 1 of 2 waited in collectives for 2 s with no progress")
    assert (
        f"rank 0: in all_reduce (collective #3, shapes [[4]]) at test_watchdog.py:{reduce_line}"
        in text
    )
    assert f"rank 1: in barrier (collective #3) at test_watchdog.py:{barrier_line}" in text
    assert "different collectives" in text
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "debug=True" in notes  # debug mode is off: the error suggests it
    assert set(info.value.stacks) == {0, 1}


def test_a_rank_stuck_outside_collectives_is_named_as_the_one_the_others_wait_for():
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        launch(stuck_outside, hang_timeout=2)
    assert time.monotonic() - started < 30
    text = shown(str(info.value))
    sleep_line = line_of(stuck_outside, "rank 1 is stuck here")
    barrier_line = line_of(stuck_outside, "rank 0 waits here")
    assert text.startswith(
        f"rank 1 of 2 is stuck at test_watchdog.py:{sleep_line} in stuck_outside outside any "
        "collective, while rank 0 waits for it"
    )
    assert f"rank 0: in barrier (collective #1) at test_watchdog.py:{barrier_line}" in text
    assert "time.sleep(120)" in info.value.stacks[1]


def test_a_straggler_is_named_in_the_end_summary(capfd):
    assert launch(straggler, display="text") == [0, 1]
    err = capfd.readouterr().err
    assert "nblaunch: rank 1 was the slowest: the others wait" in err, err
    assert "rank 0: waiting in collectives" in err


def test_a_rank_computing_or_printing_outside_collectives_is_not_a_hang():
    # Rank 0 waits in a barrier longer than hang_timeout while rank 1 works (CPU on one line,
    # then output): both count as progress, so the run finishes normally.
    assert launch(busy_then_barrier, hang_timeout=1.5) == ["ok", "ok"]
    assert launch(prints_then_barrier, hang_timeout=1.5) == ["ok", "ok"]


def test_hang_timeout_none_turns_the_timeout_off():
    def short_stall():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(2.5)
        dist.barrier()
        return "ok"

    assert launch(short_stall, hang_timeout=None) == ["ok", "ok"]
    with pytest.raises(DistributedHangError):
        launch(short_stall, hang_timeout=1)
