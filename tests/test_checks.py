"""The out-of-band collective checks, on by default: real ranks (2 CPU, gloo), and the monitor."""

from __future__ import annotations

import inspect
import os
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

from nblaunch import (
    DistributedOperationException,
    PoolRestartedError,
    notebook_launcher,
    start_pool,
)
from nblaunch.engine.monitors.collective_checks import CallReader, CollectiveChecks, compare
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.engine.verdict import Cause
from nblaunch.options import LaunchOptions
from nblaunch.ranks.checks import fingerprints
from nblaunch.ranks.checks.debug_report import digest, mismatch_message, record_of, same_facts
from nblaunch.ranks.checks.fingerprints import CALL, CALL_TAG, Outbox, Route, definition
from tests.conftest import assert_no_ranks_left, wait_until

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    kwargs.setdefault("timeout", 60)  # a missed mismatch fails the test instead of hanging it
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def reported(function, **kwargs) -> tuple[str, float]:
    """The DistributedOperationException's message, and the seconds from the launch to it."""
    started = time.monotonic()
    with pytest.raises(DistributedOperationException) as info:
        launch(function, **kwargs)
    elapsed = time.monotonic() - started
    assert_no_ranks_left(10)
    return str(info.value), elapsed


# --- the cases, with the default settings -------------------------------------------------


def count_mismatch():
    import torch
    import torch.distributed as dist

    t = torch.ones(3)
    for _ in range(3 if dist.get_rank() == 0 else 2):
        dist.all_reduce(t)
    dist.barrier()


def operation_mismatch():
    import torch
    import torch.distributed as dist

    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)


def shape_mismatch():
    import torch
    import torch.distributed as dist

    t = torch.arange(5.0).reshape(1, 5) if dist.get_rank() == 0 else torch.zeros(1, 2, 5)
    dist.broadcast(t, 0)  # gloo fills rank 1's first row and returns: no error of its own
    return t.tolist()


def test_a_rank_calling_a_collective_once_more_is_named_at_the_call():
    message, elapsed = reported(count_mismatch)
    reduce, barrier = line_of(count_mismatch, "all_reduce(t)"), line_of(count_mismatch, "barrier")
    assert message.startswith(
        "Cannot apply desired operation: processes called different collectives at the same "
        f"step (rank 0 called all_reduce at test_checks.py:{reduce} while rank 1 called barrier "
        f"at test_checks.py:{barrier})"
    ), message
    assert "comparing the calls of ranks 0, 1 at collective #3 of the default group" in message
    assert elapsed < 10, elapsed


def test_different_collectives_at_the_same_step_are_named():
    message, elapsed = reported(operation_mismatch)
    reduce = line_of(operation_mismatch, "all_reduce(t)")
    broadcast = line_of(operation_mismatch, "broadcast(t, 0)")
    assert f"rank 0 called all_reduce at test_checks.py:{reduce}" in message, message
    assert f"rank 1 called broadcast at test_checks.py:{broadcast}" in message
    assert elapsed < 10, elapsed


def test_a_shape_mismatch_gloo_lets_through_is_caught():
    message, elapsed = reported(shape_mismatch)
    assert message.startswith(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices must "
        "be valid.\n\nOperation: `torch.distributed.broadcast`\nInput shapes:\n"
        "  - Process 0: [1, 5]\n  - Process 1: [1, 2, 5]\n"
    ), message
    assert elapsed < 10, elapsed


def trainer_callback_mismatch():
    """A Transformers ``Trainer`` (one-layer GPT-2, 6 steps) whose callback all-reduces on rank 0
    only, at the end of step 2: rank 1 goes on into step 3's backward."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    os.environ["ACCELERATE_USE_CPU"] = "1"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    ids = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    class LogOnRankZero(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if dist.get_rank() == 0 and state.global_step == 2:
                dist.all_reduce(torch.ones(1))  # "log the mean loss", on one rank only

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=6,
            per_device_train_batch_size=4,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=data,
            callbacks=[LogOnRankZero()],
        )
        assert args.world_size == 2
        trainer.train()


def test_a_collective_one_rank_adds_in_a_trainer_callback_is_named():
    pytest.importorskip("transformers")
    message, elapsed = reported(trainer_callback_mismatch, timeout=120)
    line = line_of(trainer_callback_mismatch, "dist.all_reduce(torch.ones(1))")
    assert f"rank 0 called all_reduce at test_checks.py:{line} while rank 1 " in message, message
    assert elapsed < 60, elapsed  # most of it is importing transformers and building the model


def test_a_pools_every_task_is_checked_and_the_pool_goes_on():
    # A pool's tasks get fresh monitors; its ranks keep the address they were set up with.
    with start_pool(2, device_type="cpu", display="none") as pool:
        assert pool.run(count_mismatch_free) == [3.0, 3.0]
        started = time.monotonic()
        # Both ranks wait in mismatched collectives: nothing can free them but fresh ranks,
        # and the error says so first; the checks' finding is its cause.
        with pytest.raises(
            PoolRestartedError, match="could not be released .the ranks called "
        ) as caught:
            pool.run(operation_mismatch)
        cause = caught.value.__cause__
        assert isinstance(cause, DistributedOperationException)
        assert "rank 1 called broadcast" in str(cause)
        assert time.monotonic() - started < 10
        assert pool.run(count_mismatch_free) == [3.0, 3.0]


def count_mismatch_free():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.barrier()
    return t.item() * 3


@pytest.mark.parametrize("how", ["debug=False", "NBLAUNCH_CHECKS=0"])
def test_the_checks_can_be_turned_off(how, monkeypatch):
    kwargs = {}
    if how == "debug=False":
        kwargs["debug"] = False
    else:
        monkeypatch.setenv("NBLAUNCH_CHECKS", "0")
    rank0, rank1 = launch(shape_mismatch, **kwargs)  # the silent corruption the checks catch
    assert rank0 == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    assert rank1 == [[[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0, 0.0]]]


def test_the_plan_says_which_checks_run(monkeypatch):
    def mode(**kwargs):
        plan = plan_launch(print, 2, LaunchOptions(**kwargs))
        return plan.debug, plan.checks, plan.setup_message(0)["options"]["checks"]

    assert mode() == (False, True, True)
    assert mode(debug=True) == (True, False, False)
    assert mode(debug=False) == (False, False, False)
    monkeypatch.setenv("NBLAUNCH_CHECKS", "0")
    assert mode() == (False, False, False)


# --- no false reports -----------------------------------------------------------------------------


def consistent_collectives():
    import torch
    import torch.distributed as dist

    import nblaunch

    r = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": r})
    # all_to_all_single with uneven splits: every rank sends and receives different sizes
    sent = torch.arange(3.0) if r == 0 else torch.arange(5.0)
    received = torch.empty(4)
    dist.all_to_all_single(
        received, sent, [1, 3] if r == 0 else [2, 2], [1, 2] if r == 0 else [3, 2]
    )
    dist.gather(torch.ones(2), [torch.zeros(2), torch.zeros(2)] if r == 0 else None, dst=0)
    alone = dist.new_group([0])
    if r == 0:
        dist.all_reduce(torch.ones(2), group=alone)
    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(2), group=pair)
    peer = 1 - r
    ops = [
        dist.P2POp(dist.isend, torch.ones(2), peer),
        dist.P2POp(dist.irecv, torch.zeros(2), peer),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    nblaunch.gather(torch.ones(2))
    nblaunch.gather_object(r)
    nblaunch.all_reduce(torch.ones(2))
    dist.broadcast_object_list([r], src=0)
    dist.barrier()
    return objects


def test_consistent_collectives_of_every_kind_raise_nothing():
    assert launch(consistent_collectives) == [[{"rank": 0}, {"rank": 1}]] * 2


HEALTHY = (
    "ddp_uneven",
    "mismatched_collectives",
    "fsdp2_skip",
    "hf_trainer_raise",
    "lightning_raise",
)


def healthy_in_turn(names):
    """Each scenario with ``healthy=True``, one after another on the same ranks."""
    import real_scenarios

    return [real_scenarios.SCENARIOS[name].function(True) for name in names]


def test_healthy_real_training_raises_nothing():
    """bench_real's scenarios with ``healthy=True``: DDP, FSDP2, Trainer, Lightning, in one
    launch (the checks compare every collective of all five; Lightning last)."""
    import importlib.util

    needs = {"hf_trainer_raise": "transformers", "lightning_raise": "lightning"}
    names = [n for n in HEALTHY if n not in needs or importlib.util.find_spec(needs[n])]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import real_scenarios

        results = launch(healthy_in_turn, (names,), timeout=300)
    finally:
        sys.path.remove(str(BENCHMARKS))
    steps = [real_scenarios.SCENARIOS[name].steps for name in names]
    assert results == [steps, steps]  # every scenario ran to its end on both ranks


@pytest.mark.parametrize("control", [False, True])
def test_bench_debugs_alternating_launch_times_both_kinds(control):
    """The benchmark turns the checks off and on inside ranks through their internals: it must
    still find them (its control launch too, which leaves them off in both kinds)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_debug

        per_rank = launch(bench_debug.alternating_blocks, (2, 3, 16, 2, control))
    finally:
        sys.path.remove(str(BENCHMARKS))
    for times in per_rank:
        assert sorted(times) == ["checked", "reads", "unchecked"]
        for kind in ("checked", "unchecked"):
            assert len(times[kind]) == 2 and min(min(b) for b in times[kind]) > 0
        # the flight recorder's reads in checked blocks, and its thread's CPU per checked step
        ((reads, read_s, reader_cpu),) = times["reads"]
        assert reads >= 0 and read_s >= 0 and reader_cpu >= 0


# --- the monitor alone ----------------------------------------------------------------------------


def record(rank: int, op: str = "torch.distributed.all_reduce", shape=(2,), **fields):
    shapes = [list(shape)]
    base = {
        "op": op,
        "rank": rank,
        "site": f"train.py:{10 + rank}",
        "rule": "same",
        "n": 1,
        "shapes": shapes,
        "dtypes": ["torch.float32"],
        "devices": ["cpu"],
        "key": {"shape": digest(shapes), "dtype": "d", "device": "c"},
        "out": None,
        "args": {},
        "problem": None,
    }
    return {**base, **fields}


def batch(rank: int, *calls, task: int = 1):
    """A joined node's ``Collectives`` event: ``rank``'s calls ``(group, n, record)``."""
    return {
        "kind": "collectives",
        "calls": [
            {"rank": rank, "task": task, "group": g, "n": n, "size": 2, "record": r}
            for g, n, r in calls
        ],
    }


class FakeRun:
    def now(self) -> float:
        return 0.0


def monitor() -> CollectiveChecks:
    return CollectiveChecks(plan_launch(print, 2, LaunchOptions(debug=False)))


def test_records_that_agree_are_compared_once_and_forgotten():
    checks, run = monitor(), FakeRun()
    checks.on_event(run, batch(0, ("0", 1, record(0)), ("0", 2, record(0))))
    assert len(checks.open) == 2
    checks.on_event(run, batch(1, ("0", 1, record(1)), ("0", 2, record(1))))
    assert checks.open == {} and checks.compared == 2
    assert checks.check(run) is None


def test_the_first_disagreement_ends_the_run_once():
    checks, run = monitor(), FakeRun()
    checks.on_event(run, batch(0, ("0", 1, record(0)), ("0", 2, record(0))))
    checks.on_event(
        run, batch(1, ("0", 1, record(1)), ("0", 2, record(1, "torch.distributed.barrier")))
    )
    root = checks.check(run)
    assert root is not None and root.cause is Cause.MISMATCH
    assert isinstance(root.exception, DistributedOperationException)
    assert "rank 0 called all_reduce at train.py:10 while rank 1 called barrier at train.py:11" in (
        str(root.exception)
    )
    assert root.title == "rank 0 and rank 1 of 2 disagree on collective #2"
    assert checks.check(run) is None  # reported once


def test_calls_of_other_groups_and_tasks_are_never_compared():
    checks, run = monitor(), FakeRun()
    checks.on_event(run, batch(0, ("0", 1, record(0)), ("1", 1, record(0, shape=(3,)))))
    checks.on_event(run, batch(1, ("0", 1, record(1, shape=(2,)))))
    checks.on_event(run, batch(1, ("1", 1, record(1, shape=(3,))), task=2))
    assert checks.check(run) is None


def test_an_all_gathers_outputs_wait_for_every_rank():
    gathered = record(0, rule="all_gather", out=digest([[2], [9]]))
    assert (
        compare({0: gathered, 1: record(1, rule="all_gather", out=digest([[2], [9]]))}, False)
        is None
    )
    complete = compare({0: gathered, 1: record(1, rule="all_gather", out=digest([[2], [9]]))}, True)
    assert complete is not None and "shape mismatches" in complete
    other = compare({0: gathered, 1: record(1, "torch.distributed.barrier")}, False)
    assert other is not None and "different collectives" in other


def facts(shapes=((2,),), site="train.py:10", rule="same", out=None, problem=None):
    """A call's facts, as a rank sends them (``debug_report.FACTS``)."""
    dtypes, devices = ("torch.float32",) * len(shapes), ("cpu",) * len(shapes)
    op = "torch.distributed.all_reduce"
    return (op, site, rule, 0, shapes, dtypes, devices, out, (("op", "SUM"),), problem)


def test_facts_that_differ_only_in_the_line_agree_and_others_get_debug_modes_report():
    assert same_facts([facts(), facts(site="train.py:11")])
    assert compare({0: facts(), 1: facts(site="train.py:11")}, True) is None
    bigger = facts(shapes=((3,),), site="train.py:11")
    report = compare({0: facts(), 1: bigger}, True)
    assert report == mismatch_message([record_of(facts(), 0), record_of(bigger, 1)])
    assert "shape mismatches" in report and "Process 1: [3]" in report
    assert "Process 1: train.py:11" in report
    rows = facts(shapes=((2, 5),), rule="same_except_dim")
    assert compare({0: rows, 1: facts(shapes=((7, 5),), rule="same_except_dim")}, True) is None
    # Equal facts that are wrong all the same: outputs sized for other inputs, a problem found.
    assert compare({r: facts(rule="all_gather", out=((2,), (2,))) for r in (0, 1)}, True) is None
    wrong = compare({r: facts(rule="all_gather", out=((2,), (3,))) for r in (0, 1)}, True)
    assert wrong is not None and "shape mismatches" in wrong
    problem = compare({r: facts(problem="tensor_list has 1 tensors") for r in (0, 1)}, True)
    assert problem is not None and "invalid arguments" in problem


class Node(FakeRun):
    """A launcher with some of the ranks; what its checks publish."""

    def __init__(self, ranks: set[int]) -> None:
        self.ranks = ranks
        self.published: list[dict] = []

    def runs_here(self, rank: int) -> bool:
        return rank in self.ranks

    def publish(self, event: dict) -> None:
        self.published.append(event)


@pytest.mark.parametrize("ranks", [{0, 1}, {1}], ids=["one machine", "a joined node"])
def test_only_a_node_without_every_rank_passes_its_ranks_calls_on(ranks, monkeypatch):
    monkeypatch.delenv("NBLAUNCH_CHECKS", raising=False)
    checks, node = CollectiveChecks(plan_launch(print, 2, LaunchOptions())), Node(ranks)
    rank = Outbox(1, 1, checks.reader.address)  # rank 1's end, in its first task
    try:
        rank.add(Route(0, "0", [0, 1]), facts())
        assert wait_until(lambda: checks.check(node) is None and checks.open, timeout=5)
        calls = [{"rank": 1, "task": 1, "group": "0", "size": 2, "n": 1, "record": facts()}]
        calls[0]["members"] = [0, 1]
        assert node.published == (
            [{"kind": "collectives", "calls": calls}] if 0 not in ranks else []
        )
    finally:
        rank.close()
        checks.reader.close()


def test_the_reader_takes_whole_calls_and_drops_a_sender_of_garbage():
    reader = CallReader()
    read_end, pipe = os.pipe()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rank:  # a rank's first words
            rank.connect("\0" + reader.address)
            socket.send_fds(rank, [definition(("rank", 1, 3))], [read_end])
        defined = definition(("group", 0, "0", 2, [0, 1])) + definition(("facts", 0, facts()))
        second = CALL.pack(CALL_TAG, 0, 2, 0)
        os.write(pipe, defined + CALL.pack(CALL_TAG, 0, 1, 0) + second[:5])
        got: list = []
        assert wait_until(lambda: got.extend(reader.read()) or got, timeout=5)
        first = {"rank": 1, "task": 3, "group": "0", "size": 2, "n": 1, "record": facts()}
        assert got == [dict(first, members=[0, 1])]  # the second is not whole yet
        os.write(pipe, second[5:])
        got.clear()
        assert wait_until(lambda: got.extend(reader.read()) or got, timeout=5)
        assert got == [dict(first, n=2, members=None)]

        def hung_up(conn: socket.socket) -> bool:
            reader.read()
            try:
                return conn.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False

        stranger.connect("\0" + reader.address)
        stranger.sendall(struct.pack("<I", 3) + b"bad")  # no pipe
        assert wait_until(lambda: hung_up(stranger), timeout=5)
        assert len(reader.pipes) == 1 and not reader.connecting  # the rank's
        os.write(pipe, b"bad")
        assert wait_until(lambda: reader.read() == [] and not reader.pipes, timeout=5)
    finally:
        os.close(pipe)
        os.close(read_end)
        stranger.close()
        reader.close()


def test_facts_are_sent_once_and_their_numbers_start_again_when_the_table_is_full(monkeypatch):
    monkeypatch.setattr(fingerprints, "MAX_FACTS", 2)
    reader = CallReader()
    rank = Outbox(0, 1, reader.address)
    try:
        group, other = Route(0, "0", [0, 1]), Route(1, "5", [0, 2])
        sent = [facts(shapes=((n,),)) for n in (1, 1, 2, 3, 1, 3)]
        for n, call in enumerate(sent):
            rank.add(other if n == 3 else group, call)
        got: list = []
        assert wait_until(lambda: got.extend(reader.read()) or len(got) == len(sent), timeout=5)
        assert [call["record"] for call in got] == sent
        assert [(call["group"], call["n"], call["members"]) for call in got] == [
            ("0", 1, [0, 1]),
            ("0", 2, None),
            ("0", 3, None),
            ("5", 1, [0, 2]),
            ("0", 4, None),
            ("0", 5, None),
        ]
        # Two tables of two: ((1,),) and ((2,),), then ((3,),) and ((1,),) again.
        assert list(rank.facts) == [facts(shapes=((3,),)), facts(shapes=((1,),))]
    finally:
        rank.close()
        reader.close()


def test_the_wrappers_bind_torchs_arguments_as_inspect_does():
    import torch
    import torch.distributed as dist

    from nblaunch.ranks.checks.debug_patches import PATCHED, _binder

    t = torch.ones(2)
    for name in PATCHED:
        function = getattr(dist, name, None)
        if function is None:
            continue
        signature, bind = inspect.signature(function), _binder(function)
        first, *_ = signature.parameters
        calls = [
            ((), {}),
            ((t,), {}),
            ((t, t), {"group": None}),
            ((t,), {first: t}),  # given twice
            ((t,), {"no_such_argument": 1}),
            ((t,) * 9, {}),
            ((), dict.fromkeys(signature.parameters, t)),
        ]
        for args, kwargs in calls:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                assert bind(args, kwargs) is None, (name, args, kwargs)
                continue
            bound.apply_defaults()
            assert bind(args, kwargs) == dict(bound.arguments), (name, args, kwargs)
