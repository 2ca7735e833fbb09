"""Background runs (``block=False``): the history a late view is given, the engine on a thread,
and real ranks going on while the caller does other things."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from conftest import ROOT, assert_no_ranks_left, rank_children, wait_until
from scripted import Print, Script, raises, returns

import nblaunch
from nblaunch.engine.background.background_run import BackgroundRun
from nblaunch.engine.background.event_hub import MAX_METRIC_EVENTS, EventHub, RunHistory
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.errors import LaunchError, RunStoppedError
from nblaunch.events import RunState
from nblaunch.notebook.views import RecordingView
from nblaunch.options import LaunchOptions


def line(rank: int, text: str) -> dict[str, Any]:
    return {"kind": "stream", "rank": rank, "fd": 1, "text": text, "carriage": False}


def state(rank: int, value: RunState) -> dict[str, Any]:
    return {"kind": "state", "rank": rank, "state": value, "detail": ""}


# --- the history ---------------------------------------------------------------------------------


def test_history_keeps_the_last_lines_of_each_rank_and_the_latest_state_in_order():
    history = RunHistory(max_lines=3)
    history.add({"kind": "run_info", "world_size": 2})
    history.add(state(0, RunState.STARTING))
    for i in range(100_000):
        history.add(line(i % 2, f"line {i}"))
    history.add(state(0, RunState.RUNNING))
    history.add(line(1, "last"))

    events = history.events()
    texts = [e["text"] for e in events if e["kind"] == "stream"]
    assert texts == ["line 99994", "line 99996", "line 99997", "line 99998", "line 99999", "last"]
    assert [e["state"] for e in events if e["kind"] == "state"] == [RunState.RUNNING]
    assert events[0]["kind"] == "run_info"
    assert history.events_seen == 100_004


def test_history_thins_metrics_evenly_and_keeps_a_long_runs_first_and_last_points():
    history = RunHistory()
    for step in range(3 * MAX_METRIC_EVENTS):
        history.add({"kind": "metrics", "rank": 0, "step": step, "values": {"loss": 1.0}})
    steps = [e["step"] for e in history.events()]
    assert len(steps) <= MAX_METRIC_EVENTS
    assert steps[0] == 0 and steps[-1] > 2.9 * MAX_METRIC_EVENTS
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert len(gaps) == 1  # evenly spaced


def test_a_late_view_gets_the_history_then_the_live_events_and_a_broken_view_is_dropped():
    hub = EventHub(RunHistory(max_lines=10))
    early = RecordingView()
    hub.watch(early)
    hub.handle(line(0, "before"))

    class Broken(RecordingView):
        def handle(self, event):
            if event["kind"] == "stream" and event["text"] == "after":
                raise ConnectionError("the page went away")
            super().handle(event)

    late, broken = RecordingView(), Broken()
    hub.watch(late)
    hub.watch(broken)
    hub.handle(line(1, "after"))
    hub.handle(line(1, "later"))
    hub.close()

    for view in (early, late):
        assert [e["text"] for e in view.of("stream")] == ["before", "after", "later"]
    assert [e["text"] for e in broken.of("stream")] == ["before"]
    assert isinstance(hub.errors[0], ConnectionError)
    ended = RecordingView()
    hub.watch(ended)  # the run is over: history, then closed
    assert [e["text"] for e in ended.of("stream")] == ["before", "after", "later"]


# --- the engine on a thread, scripted ------------------------------------------------------------


def train() -> None:
    """The function the plans name; the script decides what the ranks do."""


def scripted_background(behaviour: Any, **options: Any) -> BackgroundRun:
    plan = plan_launch(train, 2, LaunchOptions(device_type="cpu", **options))
    script = Script(behaviour)
    run = Run(plan, EventHub(), backend=script, clock=script.clock)
    background = BackgroundRun(run, serialize_payload(train, ()))
    background.start()
    return background


def test_a_background_run_raises_the_failing_ranks_own_exception_from_values():
    def behaviour(rank, message):
        if message["kind"] != "task":
            return None
        if rank == 1:
            return [(0.2, e) for e in raises(1, ValueError("bad batch on rank 1"))]
        return [(0.0, Print("rank 0 works")), *((5.0, e) for e in returns(0, 0))]

    background = scripted_background(behaviour)
    assert background.wait(30)
    assert background.state == "failed"
    with pytest.raises(ValueError, match="bad batch on rank 1"):
        background.values()
    lines = [e["text"] for e in background.hub.history.events() if e["kind"] == "stream"]
    assert "rank 0 works" in lines


def test_stopping_a_background_run_that_would_never_end_raises_run_stopped():
    def behaviour(rank, message):  # the ranks start and then say nothing, ever
        return None

    background = scripted_background(behaviour, hang_timeout=None)
    assert not background.wait(0.3)
    background.stop()
    assert background.wait(30)
    assert background.state == "stopped"
    with pytest.raises(RunStoppedError, match="stopped before every rank returned"):
        background.values()


# --- real ranks ----------------------------------------------------------------------------------


def steps(count: int, pause_s: float, fail_rank: int | None = None) -> int:
    import torch.distributed as dist

    for i in range(count):
        print(f"step {i}", flush=True)
        time.sleep(pause_s)
    if dist.get_rank() == fail_rank:
        raise KeyError(f"no column {count} on rank {fail_rank}")
    return dist.get_rank() + 100


def test_block_false_returns_while_the_ranks_run_and_result_waits_for_their_values():
    began = time.monotonic()
    handle = nblaunch.notebook_launcher(steps, (40, 0.1), 2, block=False, display="none")
    returned_s = time.monotonic() - began
    assert handle.state == "running" and not handle.done()
    # The run takes over 4 s; starting it took 2.4 s once at load average 30 (1.5 s allowed).
    assert returned_s < 3.0
    # The ranks go on meanwhile: their logs grow while this thread does something else.
    log = handle.run_dir / "rank1.log"
    assert wait_until(lambda: log.exists() and "step 3" in log.read_text(), 30)
    assert handle in nblaunch.runs()
    assert handle.result(timeout=60) == [100, 101]
    assert handle.state == "done" and handle.done()
    assert_no_ranks_left(10)


def test_result_raises_rank_ones_exception_and_a_timeout_leaves_the_run_going():
    handle = nblaunch.notebook_launcher(steps, (15, 0.1, 1), 2, block=False, display="none")
    with pytest.raises(TimeoutError, match="still going"):
        handle.result(timeout=0.2)
    assert handle.state == "running"
    with pytest.raises(KeyError, match="no column 15 on rank 1") as raised:
        handle.result(timeout=60)
    assert any("rank 1" in note for note in getattr(raised.value, "__notes__", []))
    assert handle.state == "failed"


def test_stop_ends_every_rank_and_a_second_run_may_start_while_one_goes_on():
    slow = nblaunch.notebook_launcher(steps, (600, 0.1), 2, block=False, display="none")
    quick = nblaunch.notebook_launcher(steps, (1, 0.0), 2, block=False, display="none")
    assert quick.result(timeout=60) == [100, 101]
    assert slow.state == "running"
    stopper = threading.Thread(target=slow.stop)
    stopper.start()  # from another thread, as the view's Stop button does
    with pytest.raises(RunStoppedError):
        slow.result(timeout=30)
    stopper.join()
    assert slow.state == "stopped"
    assert_no_ranks_left(10)


def test_what_a_background_run_cannot_do_is_refused_before_anything_starts():
    with pytest.raises(LaunchError, match="debug_on_error=True needs the cell"):
        nblaunch.notebook_launcher(steps, (1, 0.0), 2, block=False, debug_on_error=True)
    with pytest.raises(LaunchError, match="debug_on_error=True needs the cell"):
        nblaunch.notebook_launcher(steps, (1, 0.0), 2, detach=True, debug_on_error=True)
    assert not rank_children()


# --- a script that ends while its background run goes on (issue 44, 1) ---------------------------

SCRIPT = """
import sys, time
from nblaunch import notebook_launcher

def train(lines, sleep_s):
    import time
    from nblaunch import rank
    for i in range(lines):
        print(f"rank {rank()} line {i}")
    time.sleep(sleep_s)  # still going when the script's last line has run
    print(f"rank {rank()} last line", flush=True)
    return rank()

h = notebook_launcher(train, args=(int(sys.argv[1]), float(sys.argv[2])), num_processes=2,
                      block=False, display="text")
print("script ends", flush=True)
"""


def _script(tmp_path, *args: str) -> subprocess.Popen:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NBLAUNCH_RUN_DIR": str(tmp_path / "runs")}
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_a_scripts_exit_waits_for_its_background_run_and_shows_every_line(tmp_path):
    script = _script(tmp_path, "2000", "1.5")
    out, _ = script.communicate(timeout=120)
    assert script.returncode == 0, out
    lines = out.splitlines()
    note = next(i for i, text in enumerate(lines) if "waiting for background run" in text)
    assert "Ctrl-C stops it" in lines[note]
    assert lines.index("script ends") < note
    for rank in (0, 1):
        printed = [text for text in lines if text.startswith(f"[rank {rank}] rank {rank} line ")]
        assert len(printed) == 2000
        assert f"[rank {rank}] rank {rank} last line" in lines
    end = lines.index(next(text for text in lines if text.startswith("nblaunch: finished in")))
    assert lines[end + 1 :] == ["  rank 0: returned", "  rank 1: returned"]


@pytest.mark.slow
def test_ctrl_c_while_a_script_waits_for_its_run_stops_it_and_says_so(tmp_path):
    script = _script(tmp_path, "1", "600")
    try:

        def printed() -> bool:
            logs = list((tmp_path / "runs").glob("*/rank1.log"))
            return bool(logs) and "line 0" in logs[0].read_text()

        assert wait_until(printed, 60)
    except BaseException:
        script.kill()
        raise
    time.sleep(0.5)  # in the exit's wait by now
    began = time.monotonic()
    script.send_signal(signal.SIGINT)
    out, _ = script.communicate(timeout=60)
    assert time.monotonic() - began < 30
    assert "waiting for background run" in out
    assert "Python exits: stopping background run" in out
    assert out.splitlines()[-1].startswith("nblaunch: background run "), out
    assert " stopped; what the ranks wrote is in " in out.splitlines()[-1]
    assert "last line" not in out
