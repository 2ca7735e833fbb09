"""The engine's decisions, played back through a scripted rank backend: no process starts.

Each test scripts what every rank sends and when (``tests/scripted.py``), on a clock that jumps
instead of sleeping, and checks what the engine decides and at which time on that clock. The
same decisions are checked with real processes elsewhere (test_launcher, test_watchdog,
test_memory, test_pool): those are the contract tests of the real backend.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from scripted import (
    Exit,
    Interrupt,
    Print,
    Script,
    heartbeat,
    raises,
    returns,
    started,
)

from nblaunch.engine.hang import FINISHED_GRACE_S
from nblaunch.engine.plan import plan_launch, serialize_payload
from nblaunch.engine.run import Run
from nblaunch.engine.verdict import SECONDARY_GRACE_S
from nblaunch.errors import DistributedHangError, LaunchTimeoutError
from nblaunch.events import RunState
from nblaunch.notebook.widgets import RecordingView
from nblaunch.options import LaunchOptions
from nblaunch.ranks.memory import RESTART_OPTION


def train() -> None:
    """The function the plans name; the script decides what the ranks do."""


def run_script(behaviour: Any, world_size: int = 2, **options: Any) -> tuple[Run, Script]:
    plan = plan_launch(train, world_size, LaunchOptions(device_type="cpu", **options))
    script = Script(behaviour)
    return Run(plan, RecordingView(), backend=script, clock=script.clock), script


def payload() -> bytes:
    return serialize_payload(train, ())


def test_a_scripted_run_returns_every_value_without_a_process():
    def behaviour(rank, message):
        if message["kind"] == "task":
            return [(0.0, Print(f"hello from {rank}")), *((0.1, e) for e in returns(rank, rank))]
        return []

    run, script = run_script(behaviour)
    began = time.monotonic()
    assert run.execute(payload()) == [0, 1]
    assert time.monotonic() - began < 2.0
    assert [m["kind"] for r, m in script.backends[0].sent if r == 0] == ["setup", "task", "stop"]
    lines = [e["text"] for e in run.view.events if e["kind"] == "stream"]
    assert sorted(lines) == ["hello from 0", "hello from 1"]


def test_a_primary_failure_wins_over_an_earlier_secondary_one_without_the_grace():
    # Rank 0 sees its peer's connection close first; rank 1's own error comes 1 s later.
    echo = RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    def behaviour(rank, message):
        if message["kind"] != "task":
            return []
        if rank == 0:
            return [(0.2, e) for e in raises(0, echo)]
        return [(1.0, e) for e in raises(1, ValueError("boom on rank 1"))]

    run, script = run_script(behaviour)
    t0 = script.clock.now()
    with pytest.raises(ValueError, match="boom on rank 1") as caught:
        run.execute(payload())
    # Decided as soon as the primary arrived, not after the secondary's grace.
    assert 1.0 <= run.outcome.root.received_at - t0 < 1.2
    assert run.outcome.root.rank == 1
    assert "rank 1 of 2" in "\n".join(getattr(caught.value, "__notes__", []))


def test_a_secondary_failure_alone_is_the_cause_once_its_grace_ran_out():
    echo = RuntimeError("Connection reset by peer")

    def behaviour(rank, message):
        if message["kind"] != "task":
            return []
        return [(0.2, e) for e in raises(0, echo)] if rank == 0 else []  # rank 1: silent

    run, script = run_script(behaviour)
    t0 = script.clock.now()
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        run.execute(payload())
    decided = script.backends[0].stop_time - t0
    assert 0.2 + SECONDARY_GRACE_S <= decided < 0.2 + SECONDARY_GRACE_S + 0.3
    assert run.states[1] is RunState.STOPPED


def test_a_rank_that_returned_while_its_peer_waits_is_a_hang_within_a_second():
    def behaviour(rank, message):
        if message["kind"] != "task":
            return []
        if rank == 1:  # four collectives, then it leaves the loop early
            return [(0.5, heartbeat(1, seq=4)), *((0.6, e) for e in returns(1, "done"))]
        # rank 0 waits in its fifth collective, reporting every second
        return [(t, heartbeat(0, collective="all_reduce", seq=5, still=t)) for t in range(1, 30)]

    run, script = run_script(behaviour)
    t0 = script.clock.now()
    with pytest.raises(DistributedHangError, match="rank 1 returned after 4 collectives"):
        run.execute(payload())
    decided = script.backends[0].stop_time - t0
    assert 0.6 + FINISHED_GRACE_S <= decided < 0.6 + FINISHED_GRACE_S + 1.2


def test_no_progress_is_a_hang_after_hang_timeout_on_the_runs_clock():
    def behaviour(rank, message):
        if message["kind"] != "task":
            return []
        return [
            (t, heartbeat(rank, collective="barrier" if rank == 0 else None, seq=1, still=t))
            for t in range(1, 400)
        ]

    run, script = run_script(behaviour, hang_timeout=300.0)
    t0 = script.clock.now()
    began = time.monotonic()
    with pytest.raises(DistributedHangError, match="rank 1 of 2 is stuck"):
        run.execute(payload())
    assert 300.0 <= script.backends[0].stop_time - t0 < 302.0
    assert time.monotonic() - began < 10.0  # five minutes of scripted time


def test_the_timeout_names_the_ranks_still_running():
    def behaviour(rank, message):
        if message["kind"] == "task" and rank == 0:
            return [(0.1, e) for e in returns(0, 0)]
        return []

    run, script = run_script(behaviour, timeout=5.0)
    t0 = script.clock.now()
    with pytest.raises(LaunchTimeoutError, match=r"rank\(s\) 1 of 2 still running"):
        run.execute(payload())
    assert 5.0 <= script.backends[0].stop_time - t0 < 5.2


def test_an_interrupt_stops_every_rank_and_is_raised_again():
    def behaviour(rank, message):
        if message["kind"] == "task":
            return [(2.0, Interrupt())] if rank == 0 else []
        return []

    run, script = run_script(behaviour)
    with pytest.raises(KeyboardInterrupt):
        run.execute(payload())
    backend = script.backends[0]
    assert sorted(backend.interrupted) == [0, 1]  # SIGINT reached both ranks' tasks
    assert run.states == {0: RunState.STOPPED, 1: RunState.STOPPED}
    stopped = [
        e for e in run.view.events if e["kind"] == "state" and e["state"] is RunState.STOPPED
    ]
    assert {e["detail"] for e in stopped} == {"interrupted"}
    assert all(not rank.process.alive for rank in backend.ranks)


def test_a_peers_out_of_memory_restarts_every_rank_at_the_smaller_size():
    waiting = {
        "kind": "progress",
        "rank": 1,
        "what": "batch_size",
        "text": "",
        "data": {
            "status": "waiting",
            "key": "0:train",
            "attempt": 1,
            "batch_size": 128,
            "next_batch_size": 64,
            "history": [],
            "ranks": [1],
        },
    }

    def behaviour(rank, message):
        kind = message["kind"]
        if kind == "setup":
            return [(0.0, started(rank))]
        if kind != "task":
            return []
        restarted = RESTART_OPTION in script.backends[-1].setup_options(rank)
        if restarted:
            return [(0.1, e) for e in returns(rank, 64)]
        if rank == 1:  # out of memory at 128; it waits for its peer's outcome
            return [(0.2, waiting), (30.0, Exit(1))]
        return [(0.1 * t, heartbeat(0, collective="all_reduce", seq=2)) for t in range(1, 300)]

    run, script = run_script(behaviour)
    assert run.execute(payload()) == [64, 64]
    assert len(script.backends) == 2  # every rank started again
    resume = script.backends[1].setup_options(0)[RESTART_OPTION]["0:train"]
    assert resume["batch_size"] == 64
    assert resume["history"] == [{"batch_size": 128, "oom": [1], "restarted": True}]
    assert script.backends[0].stopped


def test_a_rank_that_dies_is_the_cause_with_its_exit():
    def behaviour(rank, message):
        if message["kind"] == "task":
            return [(0.3, Exit(-9))] if rank == 1 else []
        return []

    run, _ = run_script(behaviour)
    with pytest.raises(Exception, match="rank 1") as caught:
        run.execute(payload())
    assert "SIGKILL" in str(caught.value)
    assert run.outcome.root.rank == 1
