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
)

from nblaunch.engine.monitors.hang import FINISHED_GRACE_S
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.pool.task_end import INTERRUPT_WAIT_S, AfterTask, TaskEnd, decide_task_end
from nblaunch.engine.run.run import Run
from nblaunch.engine.verdict import SECONDARY_GRACE_S, Cause, RootCause
from nblaunch.errors import (
    DistributedHangError,
    LaunchError,
    LaunchTimeoutError,
    PoolRestartedError,
)
from nblaunch.events import Lifecycle, RunState
from nblaunch.notebook.pool import Pool
from nblaunch.notebook.views import RecordingView
from nblaunch.notebook.views.model import RunModel
from nblaunch.notebook.views.summary import summary_bundle
from nblaunch.options import LaunchOptions
from nblaunch.ranks.memory.batch_size import RESTART_OPTION


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
        return None

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
            return None
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
            return None
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
            return None
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
            return None
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
        if message["kind"] != "task":
            return None
        return [(0.1, e) for e in returns(0, 0)] if rank == 0 else []  # rank 1 goes on

    run, script = run_script(behaviour, timeout=5.0)
    t0 = script.clock.now()
    with pytest.raises(LaunchTimeoutError, match=r"rank\(s\) 1 of 2 still running"):
        run.execute(payload())
    assert 5.0 <= script.backends[0].stop_time - t0 < 5.2


def test_an_interrupt_stops_every_rank_and_is_raised_again():
    def behaviour(rank, message):
        if message["kind"] == "task":
            return [(2.0, Interrupt())] if rank == 0 else []
        return None

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
        if message["kind"] != "task":
            return None
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
        return None

    run, _ = run_script(behaviour)
    with pytest.raises(Exception, match="rank 1") as caught:
        run.execute(payload())
    assert "SIGKILL" in str(caught.value)
    assert run.outcome.root.rank == 1


# --- a persistent pool on the scripted backend ---------------------------------------------------


def task_number(message: dict[str, Any]) -> int:
    return message["task_id"]


def start_scripted_pool(behaviour: Any) -> tuple[Pool, Script]:
    script = Script(behaviour)
    pool = Pool(2, device_type="cpu", display="none", backend=script, clock=script.clock)
    return pool.start(), script


def test_a_pool_task_that_fails_leaves_the_pool_ready_for_the_next_one():
    def behaviour(rank, message):
        if message["kind"] != "task":
            return None
        if task_number(message) == 1:  # rank 1 fails; rank 0 waits for it in a collective
            return [(0.2, e) for e in raises(1, ValueError("boom"))] if rank == 1 else []
        return [(0.1, e) for e in returns(rank, rank * 10)]

    pool, script = start_scripted_pool(behaviour)
    try:
        with pytest.raises(ValueError, match="boom"):
            pool.run(train)
        assert pool.state is Lifecycle.IDLE
        assert script.backends[0].interrupted == [0]  # the pool stopped rank 0's task
        assert pool.run(train) == [0, 10]  # the same ranks take the next task
        assert len(script.backends) == 1 and pool.restarts == 0
        assert pool.last_failed_rank == 1
    finally:
        pool.close()
    assert script.backends[0].stopped or all(not r.process.alive for r in script.backends[0].ranks)


def test_a_pool_rank_that_ignores_the_interrupt_gets_fresh_ranks_and_says_so():
    def behaviour(rank, message):
        if message["kind"] == "sigint" and rank == 0:
            return []  # stuck in C: the interrupt never reaches Python
        if message["kind"] != "task":
            return None
        if task_number(message) == 1:
            return [(0.2, e) for e in raises(1, ValueError("boom"))] if rank == 1 else []
        return [(0.1, e) for e in returns(rank, rank)]

    pool, script = start_scripted_pool(behaviour)
    try:
        t0 = script.clock.now()
        with pytest.raises(PoolRestartedError) as caught:
            pool.run(train)
        first, *rest = str(caught.value).splitlines()
        assert first.startswith("The pool was restarted, so the names from earlier cells are gone")
        assert f"rank(s) 0 did not stop within {INTERRUPT_WAIT_S:g} s" in first
        assert "no collective call the checks recorded holds rank(s) 0" in first  # no records
        assert rest == ["The cell's own error is above: ValueError: boom"]
        assert isinstance(caught.value.__cause__, ValueError)
        assert script.clock.now() - t0 >= INTERRUPT_WAIT_S
        assert len(script.backends) == 2 and pool.restarts == 1
        assert pool.state is Lifecycle.IDLE
        assert pool.run(train) == [0, 1]  # on the fresh ranks
    finally:
        pool.close()


def test_a_pool_that_lost_a_rank_refuses_the_next_cell_at_once():
    def behaviour(rank, message):
        if message["kind"] != "task":
            return None
        return [(0.3, Exit(-9))] if rank == 1 else []

    pool, _ = start_scripted_pool(behaviour)
    try:
        view = RecordingView()
        with pytest.raises(Exception, match="rank 1") as caught:
            pool.run_payload(serialize_payload(train, ()), view=view)
        assert "The pool lost rank 1" in "\n".join(getattr(caught.value, "__notes__", []))
        # Fault sweep case 11: the rank the pool stopped read "RUNNING · stopped".
        model = RunModel()
        for event in view.events:
            model.handle(event)
        assert model.state(0) is RunState.STOPPED
        assert summary_bundle(model)["text/plain"].splitlines()[1] == "  rank 0: STOPPED · stopped"
        assert pool.state is Lifecycle.BROKEN
        with pytest.raises(LaunchError, match="the pool cannot run cells"):
            pool.run(train)
    finally:
        pool.close()


def test_the_pools_end_of_task_decision():
    death = RootCause(Cause.DEATH, 1, "was killed by SIGKILL")
    assert decide_task_end([], []) == TaskEnd(AfterTask.READY)
    broken = decide_task_end([death], [0])
    assert broken.after is AfterTask.BROKEN and broken.problem == "rank 1 was killed by SIGKILL"
    assert broken.note.startswith("The pool lost rank 1: run %dist restart")
    stuck = decide_task_end([], [0, 1], " (rank 0 at t.py:3)")
    assert stuck.after is AfterTask.RESTART
    assert stuck.note == (
        "The pool was restarted, so the names from earlier cells are gone: rank(s) 0, 1 did "
        "not stop within 3 s (rank 0 at t.py:3)."
    )
    why = decide_task_end([], [1], " (rank 1 at t.py:4)", why="they wait in a recv")
    assert why.note.endswith("(rank 1 at t.py:4), and could not be released (they wait in a recv).")
    node = RootCause(Cause.NODE, 2, "node 1 sent nothing for 30 s")
    lost = decide_task_end([node], [], describe_node=lambda rank: f"node {rank // 2} (vm)")
    assert lost.after is AfterTask.BROKEN and "The pool lost node 1 (vm)" in lost.note
