"""Rank-aware logging: get_logger, records relayed from ranks, in-order display without barriers."""

from __future__ import annotations

import logging
import re
import time

import cloudpickle
import pytest

from nblaunch import get_logger, notebook_launcher
from nblaunch.engine.output.in_order import InOrderLog
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.notebook.views import RecordingView
from nblaunch.options import LaunchOptions
from nblaunch.ranks.logging import RankLogger


class Recorder(RecordingView):
    """A view that keeps every event, in the order the relay hands them over."""

    def logs(self) -> list[str]:
        return [
            f"[rank {e['rank']}] {e['level']} {e['message']}"
            for e in self.events
            if e["kind"] == "log"
        ]


def launch(function, n=2, **kwargs):
    """Launch on CPU ranks; return (results, the Log events the view got, as text lines)."""
    kwargs.setdefault("timeout", 60)  # a deadlock fails the test instead of hanging it
    plan = plan_launch(function, n, LaunchOptions(device_type="cpu", **kwargs))
    recorder = Recorder()
    results = Run(plan, recorder).execute(serialize_payload(function))
    return results, recorder.logs()


# --- outside a launch: an ordinary logger ---------------------------------------------------------


def test_outside_a_launch_it_is_an_ordinary_logger(caplog, monkeypatch):
    monkeypatch.delenv("NBLAUNCH_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    logger = get_logger("nblaunch.test.plain", log_level="INFO")
    assert isinstance(logger, RankLogger)
    with caplog.at_level(logging.INFO, logger="nblaunch.test.plain"):
        logger.info("hello %s", "there")
        logger.debug("hidden")
        logger.warning("ordered", in_order=True, extra={"user": 1})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "hello there"),
        ("WARNING", "ordered"),
    ]
    assert not hasattr(caplog.records[0], "nblaunch_in_order")
    assert caplog.records[1].nblaunch_in_order is True and caplog.records[1].user == 1
    assert caplog.records[0].funcName == "test_outside_a_launch_it_is_an_ordinary_logger"


def test_main_process_only_follows_torchruns_rank(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger = get_logger("nblaunch.test.rank1", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="nblaunch.test.rank1"):
        logger.info("only on rank 0")
        logger.info("every rank", main_process_only=False)
        logger.info("in order", in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["every rank", "in order"]


@pytest.mark.parametrize(
    ("env", "argument", "expected"),
    [
        ({"NBLAUNCH_LOG_LEVEL": "debug"}, None, logging.DEBUG),
        ({"ACCELERATE_LOG_LEVEL": "ERROR"}, None, logging.ERROR),
        ({"NBLAUNCH_LOG_LEVEL": "INFO", "ACCELERATE_LOG_LEVEL": "ERROR"}, None, logging.INFO),
        ({"NBLAUNCH_LOG_LEVEL": "INFO"}, "WARNING", logging.WARNING),
    ],
)
def test_level_from_argument_then_environment(monkeypatch, env, argument, expected):
    monkeypatch.delenv("NBLAUNCH_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    name = f"nblaunch.test.level.{expected}.{argument}"
    assert get_logger(name, argument).logger.level == expected


def test_a_pickled_logger_gets_its_level_back():
    logger = get_logger("nblaunch.test.pickled", log_level="INFO")
    payload = cloudpickle.dumps(logger)
    logger.logger.setLevel(logging.NOTSET)  # as in a fresh rank process
    clone = cloudpickle.loads(payload)
    assert clone.logger.level == logging.INFO and clone.log_level == "INFO"


# --- the parent's orderer -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(
    rank: int, seq: int, message: str = "", in_order: bool = True, collectives: int | None = None
) -> dict:
    return {
        "kind": "log",
        "rank": rank,
        "level": "INFO",
        "name": "t",
        "message": message or f"r{rank}s{seq}",
        "in_order": in_order,
        "seq": seq if in_order else -1,
        "collectives": collectives,
        "time": 0.0,
    }


def heartbeat(rank: int, collectives: int | None) -> dict:
    return {"kind": "heartbeat", "rank": rank, "seq": collectives}


def messages(events: list[dict]) -> list[str]:
    return [e.get("message", e["kind"]) for e in events]


def test_in_order_records_are_released_by_step_then_rank():
    clock = FakeClock()
    order = InOrderLog([0, 1], clock=clock)
    assert order.feed(record(1, 0)) == []  # rank 0 has not logged step 0 yet
    assert order.feed(record(1, 1)) == []
    assert messages(order.feed(record(0, 0))) == ["r0s0", "r1s0"]
    assert messages(order.feed(record(0, 1))) == ["r0s1", "r1s1"]
    plain = record(1, 0, "plain", in_order=False)
    assert order.feed(plain) == [plain]  # not in order: shown at once


def test_a_rank_that_starts_logging_late_keeps_its_place_up_to_the_timeout():
    clock = FakeClock()
    order = InOrderLog([0, 1], clock=clock)
    assert order.wait_s == 30.0
    assert order.feed(record(1, 0)) == []
    clock.now += 29.9  # rank 0 is busy (loading data, say): no timing guess releases rank 1's
    assert order.poll() == []
    assert messages(order.feed(record(0, 0))) == ["r0s0", "r1s0"]


def test_a_rank_without_records_or_collectives_is_waited_for_once():
    clock = FakeClock()
    order = InOrderLog([0, 1], wait_s=30, clock=clock)
    assert order.feed(record(1, 0)) == []
    clock.now += 30
    assert messages(order.poll()) == ["r1s0"]  # waited its 30 s, then shown alone
    assert messages(order.feed(record(1, 1))) == ["r1s1"]  # rank 0 is not waited for again...
    assert messages(order.feed(record(0, 0))) == ["r0s0"]  # (late: its group is out already)
    assert order.feed(record(1, 2)) == []  # ...until it logs in order again
    assert messages(order.feed(record(0, 1))) == ["r0s1"]
    assert messages(order.feed(record(0, 2))) == ["r0s2", "r1s2"]


def test_a_rank_past_the_next_collective_is_accounted_for():
    order = InOrderLog([0, 1, 2], clock=FakeClock())
    assert order.feed(record(0, 0, collectives=4)) == []
    assert order.feed(record(2, 0, collectives=5)) == []  # the group waits up to collective 5
    beat = heartbeat(1, 5)
    assert order.feed(beat) == [beat]  # rank 1 is in collective 5, as the others were: waits
    assert messages(order.feed(heartbeat(1, 6))) == ["r0s0", "r2s0", "heartbeat"]  # moved on
    assert order.feed(record(0, 1, collectives=6)) == []
    assert order.feed(heartbeat(2, 7)) == [heartbeat(2, 7)]  # rank 2 moved on; rank 1 not yet
    plain = record(1, 0, "plain", in_order=False, collectives=7)  # any log record counts too
    assert messages(order.feed(plain)) == ["r0s1", "plain"]


def test_without_collective_counts_only_records_and_finishing_count():
    order = InOrderLog([0, 1], clock=FakeClock())
    assert order.feed(record(0, 0)) == []  # no process group: no count
    assert order.feed(heartbeat(1, None)) == [heartbeat(1, None)]
    assert order.feed(heartbeat(1, 9)) == [heartbeat(1, 9)]
    failure = {"kind": "failure", "rank": 1}
    assert messages(order.feed(failure)) == ["r0s0", "failure"]  # a failed rank sends no more


def test_a_slower_rank_keeps_its_place_while_it_keeps_logging():
    clock = FakeClock()
    order = InOrderLog([0, 1], wait_s=0.4, clock=clock)
    for seq in range(3):  # rank 1 logs three steps at once...
        assert order.feed(record(1, seq)) == []
    released = []
    for seq in range(3):  # ...rank 0 one every 0.3 s: 0.9 s in all, each gap under wait_s
        clock.now += 0.3
        released += order.poll()
        released += order.feed(record(0, seq))
    assert messages(released) == ["r0s0", "r1s0", "r0s1", "r1s1", "r0s2", "r1s2"]


def test_a_silent_rank_holds_a_burst_back_only_once():
    clock = FakeClock()
    order = InOrderLog([0, 1], wait_s=0.4, clock=clock)
    for seq in range(100):
        assert order.feed(record(1, seq)) == []  # rank 0 logs nothing in order
    clock.now += 0.41
    assert len(order.poll()) == 100  # all released together after one wait, not 100 waits


def test_a_finished_rank_is_not_waited_for():
    order = InOrderLog([0, 1], clock=FakeClock())
    assert order.feed(record(1, 0)) == []  # waits for rank 0's step 0...
    assert order.feed(record(1, 1)) == []
    released = order.feed({"kind": "finished", "rank": 0})  # ...which will never come
    assert messages(released) == ["r1s0", "r1s1", "finished"]
    assert messages(order.feed(record(1, 2))) == ["r1s2"]  # nothing left to wait for
    assert messages(order.feed({"kind": "finished", "rank": 1})) == ["finished"]


def test_a_pool_task_on_some_ranks_waits_for_those_only():
    order = InOrderLog([0, 1, 2], clock=FakeClock())
    order.start_task([0, 2])
    assert order.feed(record(2, 0)) == []
    assert messages(order.feed(record(0, 0))) == ["r0s0", "r2s0"]  # rank 1 runs nothing
    assert order.feed(record(0, 1)) == []  # waits for rank 2, not for rank 1
    assert messages(order.feed({"kind": "finished", "rank": 2})) == ["r0s1", "finished"]
    assert messages(order.feed({"kind": "finished", "rank": 0})) == ["finished"]  # task over
    assert order.feed(record(0, 0)) == []  # the next task: every rank again
    assert order.feed(record(2, 0)) == []
    assert messages(order.feed(record(1, 0))) == ["r0s0", "r1s0", "r2s0"]


def test_flush_releases_everything_in_order():
    order = InOrderLog([0, 1, 2], clock=FakeClock())
    for rank, seq in [(2, 0), (2, 1), (1, 0)]:
        assert order.feed(record(rank, seq)) == []  # rank 0 has not logged step 0
    assert messages(order.flush()) == ["r1s0", "r2s0", "r2s1"]
    assert order.flush() == []


# --- in ranks: records reach the notebook ---------------------------------------------------------


def test_main_process_only_and_ordinary_loggers_in_ranks():
    def work():
        import logging

        import nblaunch

        logger = nblaunch.get_logger("train", log_level="INFO")
        logger.info("only rank 0 says this")
        logger.info("rank %d says this", nblaunch.rank(), main_process_only=False)
        logging.getLogger("somelib").warning("library warning on %d", nblaunch.rank())
        logging.getLogger("somelib").info("library info is below the default level")

    _, lines = launch(work)
    assert sorted(lines) == [
        "[rank 0] INFO only rank 0 says this",
        "[rank 0] INFO rank 0 says this",
        "[rank 0] WARNING library warning on 0",
        "[rank 1] INFO rank 1 says this",
        "[rank 1] WARNING library warning on 1",
    ]


def test_log_level_of_the_launch_reaches_loggers_made_in_the_notebook():
    logger = get_logger("nblaunch.test.notebook")  # made in the parent, used in the ranks

    def work():
        logger.debug("debug from rank 0")

    _, lines = launch(work, log_level="DEBUG")
    assert lines == ["[rank 0] DEBUG debug from rank 0"]


def test_logging_configured_in_a_rank_prints_once(capsys):
    def work():
        import logging

        logging.basicConfig(level=logging.INFO, format="configured: %(message)s")
        logging.getLogger("mine").info("hello")

    _, lines = launch(work)
    assert lines == []  # the user's handler prints the record; it is not relayed a second time
    notebook_launcher(work, num_processes=2, device_type="cpu", display="text", timeout=60)
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("configured: hello") == 2  # once per rank


def test_the_text_view_shows_rank_and_level(capsys):
    def work():
        import nblaunch

        nblaunch.get_logger("shown").warning("careful on %d", nblaunch.rank(), in_order=True)

    notebook_launcher(work, num_processes=2, device_type="cpu", display="text", timeout=60)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] WARNING (shown: )?careful on {rank}$", text, re.M)


def test_in_order_with_a_rank_logging_one_more_message_does_not_deadlock():
    def work():
        import time

        import nblaunch

        logger = nblaunch.get_logger("steps", log_level="INFO")
        rank = nblaunch.rank()
        for step in range(3):
            if rank == 0:
                time.sleep(0.05)  # rank 1's records arrive first; the view still shows rank 0 first
            logger.info("step %d", step, in_order=True)
        if rank == 1:
            logger.info("one more from rank 1", in_order=True)
        nblaunch.wait_for_everyone()
        return rank

    started = time.monotonic()
    results, lines = launch(work)
    assert results == [0, 1]
    assert time.monotonic() - started < 20
    assert lines == [
        "[rank 0] INFO step 0",
        "[rank 1] INFO step 0",
        "[rank 0] INFO step 1",
        "[rank 1] INFO step 1",
        "[rank 0] INFO step 2",
        "[rank 1] INFO step 2",
        "[rank 1] INFO one more from rank 1",
    ]


def test_in_order_with_rank_1_at_warning_level_does_not_deadlock():
    def work():
        import nblaunch

        rank = nblaunch.rank()
        logger = nblaunch.get_logger(f"level{rank}", log_level="INFO" if rank == 0 else "WARNING")
        for step in range(3):
            logger.info("step %d", step, in_order=True)
        logger.warning("done", in_order=True)
        nblaunch.wait_for_everyone()
        return rank

    started = time.monotonic()
    results, lines = launch(work)
    assert results == [0, 1]
    assert time.monotonic() - started < 20
    assert [line for line in lines if "step" in line] == [
        "[rank 0] INFO step 0",
        "[rank 0] INFO step 1",
        "[rank 0] INFO step 2",
    ]
    assert "[rank 1] WARNING done" in lines


# --- in_order with ranks seconds apart (real processes) -------------------------------------------


class TimedRecorder(Recorder):
    """A recorder that also notes when each event reached the view."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[float] = []

    def handle(self, event) -> None:
        super().handle(event)
        self.arrived.append(time.monotonic())

    def shown_at(self, message: str) -> float:
        for event, at in zip(self.events, self.arrived, strict=True):
            if event["kind"] == "log" and event["message"] == message:
                return at
        raise AssertionError(f"{message!r} never reached the view")


def skewed_logging(counts: tuple[int, int], late_rank: int, skew_s: float = 3.0):
    """A task: rank ``r`` logs ``counts[r]`` in-order records, ``late_rank`` ``skew_s`` late."""

    def work():
        import time

        import nblaunch

        logger = nblaunch.get_logger("skew", log_level="INFO")
        rank = nblaunch.rank()
        if rank == late_rank:
            time.sleep(skew_s)  # the other rank, say, loaded the data first
        began = time.monotonic()
        for step in range(counts[rank]):
            logger.info("step %d", step, in_order=True)
        return time.monotonic() - began  # how long logging took this rank: it never waits

    return work


@pytest.mark.parametrize("late_rank", [1, 0])
def test_in_order_keeps_rank_order_when_a_rank_starts_logging_seconds_later(late_rank):
    results, lines = launch(skewed_logging((3, 3), late_rank))
    assert lines == [f"[rank {rank}] INFO step {step}" for step in range(3) for rank in (0, 1)]
    assert max(results) < 1.0  # ordering cost the ranks nothing


@pytest.mark.parametrize(
    ("counts", "late_rank"),
    [((4, 2), 1), ((2, 4), 0)],
    ids=["late-rank-logs-fewer", "late-rank-logs-more"],
)
def test_in_order_with_skewed_ranks_logging_different_numbers_of_records(counts, late_rank):
    results, lines = launch(skewed_logging(counts, late_rank))
    expected = [
        f"[rank {rank}] INFO step {step}"
        for step in range(max(counts))
        for rank in (0, 1)
        if step < counts[rank]
    ]
    assert lines == expected
    assert max(results) < 1.0


def test_a_rank_past_the_next_collective_is_not_waited_for():
    def work():
        import time

        import torch
        import torch.distributed as dist

        import nblaunch

        logger = nblaunch.get_logger("past", log_level="INFO")
        rank = nblaunch.rank()
        logger.info("a", in_order=True)
        if rank == 0:
            logger.info("only rank 0 logs this", in_order=True)
        dist.all_reduce(torch.ones(1))  # rank 1 moves on without a second in-order record...
        if rank == 1:
            time.sleep(4)  # ...and keeps busy: its heartbeats say it is past that point
        return rank

    plan = plan_launch(work, 2, LaunchOptions(device_type="cpu", timeout=60))
    recorder = TimedRecorder()
    assert Run(plan, recorder).execute(serialize_payload(work)) == [0, 1]
    assert recorder.logs() == [
        "[rank 0] INFO a",
        "[rank 1] INFO a",
        "[rank 0] INFO only rank 0 logs this",
    ]
    ended = recorder.arrived[-1]
    # shown about a heartbeat after the all_reduce, not when rank 1 finished 4 s later
    assert ended - recorder.shown_at("only rank 0 logs this") > 2.0
