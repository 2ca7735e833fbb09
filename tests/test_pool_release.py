"""A pool's task that ends on one rank while a peer waits in a collective (fault sweep case 2).

The rank that left issues the call its peer waits in (``nblaunch.ranks.release``), so the peer
stops at its line and both keep their names; where that cannot be done the pool is restarted
and the error's first line says so. Real ranks (CPU, gloo, 2 ranks), one pool for the lot.
"""

from __future__ import annotations

import time

import pytest
from conftest import assert_no_ranks_left, rank_children, wait_until

from nblaunch import PoolRestartedError
from nblaunch.engine.monitors.collective_checks import owed_calls
from nblaunch.events import Lifecycle
from nblaunch.notebook.pool_start import start_pool
from nblaunch.ranks.checks.debug_report import DDP_ALL_REDUCE
from nblaunch.ranks.namespace import rank_namespace
from nblaunch.ranks.release import unsupported


@pytest.fixture(scope="module")
def pool():
    # A release that left the ranks out of step would stall the next cell: a hang in 10 s.
    pool = start_pool(2, device_type="cpu", display="none", hang_timeout=10)
    yield pool
    pool.close()
    assert_no_ranks_left(5)


def keep_a_model():
    import torch

    torch.manual_seed(0)
    rank_namespace()["model"] = torch.nn.Linear(3, 2)


def check_the_names_and_a_collective():
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return type(rank_namespace()["model"]).__name__, total.item()


def leave_while_the_peer_waits(op: str, root: int):
    """Rank 0 raises at once; rank 1 calls ``op`` (``root`` as src/dst) and waits in it."""
    import torch
    import torch.distributed as dist

    import nblaunch

    if dist.get_rank() == 0:
        time.sleep(0.2)  # the peer is in its call by now
        raise ValueError(f"rank 0 leaves {op}")
    t = torch.ones(4, 3)
    world = dist.get_world_size()
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, src=root),
        "reduce": lambda: dist.reduce(t, dst=root),
        "all_gather": lambda: dist.all_gather([torch.empty_like(t) for _ in range(world)], t),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(world * 4, 3), t),
        "gather": lambda: dist.gather(
            t, [torch.empty_like(t) for _ in range(world)] if root == 1 else None, dst=root
        ),
        "scatter": lambda: dist.scatter(
            t, [torch.ones_like(t) for _ in range(world)] if root == 1 else None, src=root
        ),
        "barrier": lambda: dist.barrier(),
        "broadcast_object_list": lambda: dist.broadcast_object_list([{"a": 1}, 2], src=root),
        "all_gather_object": lambda: dist.all_gather_object([None] * world, {"rank": 1}),
        "nblaunch.all_reduce": lambda: nblaunch.all_reduce([t, t[0]], op="mean"),
        "nblaunch.gather": lambda: nblaunch.gather({"x": t}),
        "two async all_reduces": lambda: [dist.all_reduce(t, async_op=True) for _ in range(2)][
            -1
        ].wait(),
        "subgroup all_reduce": lambda: dist.all_reduce(t, group=rank_namespace()["pair"]),
    }
    calls[op]()
    return "returned"


def make_a_subgroup():
    import torch.distributed as dist

    rank_namespace()["pair"] = dist.new_group([0, 1])


OPS = [
    ("all_reduce", 0),
    ("broadcast", 0),  # the rank that left is the root: its zeros reach the peer
    ("broadcast", 1),
    ("reduce", 1),
    ("all_gather", 0),
    ("all_gather_into_tensor", 0),
    ("gather", 1),
    ("scatter", 0),
    ("barrier", 0),
    ("broadcast_object_list", 1),
    ("all_gather_object", 0),
    ("nblaunch.all_reduce", 0),
    ("nblaunch.gather", 0),
    ("two async all_reduces", 0),
    ("subgroup all_reduce", 0),
]


def test_a_peer_waiting_in_each_collective_is_released_and_keeps_its_names(pool):
    pool.run(keep_a_model)
    pool.run(make_a_subgroup)
    pids = pool.pids
    slow = []
    for op, root in OPS:
        began = time.monotonic()
        with pytest.raises(ValueError, match=f"rank 0 leaves {op}") as info:
            pool.run(leave_while_the_peer_waits, op, root)
        took = time.monotonic() - began
        notes = "\n".join(info.value.__notes__)
        assert "rank 0 issued" in notes and "which rank 1 waited in" in notes, (op, notes)
        assert pool.state is Lifecycle.IDLE and pool.pids == pids, op
        assert pool.run(check_the_names_and_a_collective) == [("Linear", 3.0)] * 2, op
        if took > 2.0:
            slow.append((op, round(took, 2)))
    assert not slow, slow  # released at once, not after the interrupt's 3 s
    assert pool.restarts == 0


def make_a_ddp_model():
    """A DDP model past its first step; says whether it was at its first step, then and now,
    and whether it kept DDP's own all-reduce (the checks read it from the flight recorder)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nblaunch.ranks.checks.debug_patches import first_step

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    first = first_step(model)
    model(torch.ones(4, 8)).sum().backward()
    model(torch.ones(4, 8))  # the forward after the first backward rebuilds the buckets
    rank_namespace()["ddp"] = model
    return first, first_step(model), not hasattr(model, "_nblaunch_hook")


def ddp_step_with_rank_0_leaving():
    import torch
    import torch.distributed as dist

    model = rank_namespace()["ddp"]
    loss = model(torch.ones(4, 8)).sum()
    if dist.get_rank() == 0:
        time.sleep(0.2)
        raise RuntimeError("rank 0 leaves before backward")
    loss.backward()  # waits in DDP's bucket all-reduce
    return "returned"


def ddp_step():
    import torch

    model = rank_namespace()["ddp"]
    model.zero_grad()
    model(torch.ones(4, 8)).sum().backward()
    return [p.grad.sum().item() for p in model.parameters()]


def test_a_peer_in_ddps_backward_is_released_once_the_model_took_its_first_step(pool):
    # DDP's first backward rebuilds its buckets, and the next forward broadcasts them: a first
    # step that only rank 1 took would leave that broadcast to rank 1 alone, a hang one cell
    # later. Its records say so (and release.unsupported refuses them: the pool restarts).
    assert pool.run(make_a_ddp_model) == [(True, False, True)] * 2
    with pytest.raises(RuntimeError, match="rank 0 leaves before backward") as info:
        pool.run(ddp_step_with_rank_0_leaving)
    assert "rank 0 issued DDP's backward all-reduce" in "\n".join(info.value.__notes__)
    assert pool.state is Lifecycle.IDLE
    grads = pool.run(ddp_step)
    assert grads[0] == grads[1]  # both ranks all-reduced the same buckets again
    assert pool.run(check_the_names_and_a_collective) == [("Linear", 3.0)] * 2


def rank_one_waits_in_recv():
    import datetime
    import time

    import torch
    import torch.distributed as dist

    # Rank 0 raises once rank 1 is in its recv: a rank 1 still on its way there is released by
    # the interrupt, and the pool needs no restart. The key comes just before the recv; the
    # half second after it covers a loaded machine (the 3.13 + torch 2.14.1 cell's run, once).
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.wait(["rank 1 in recv"], datetime.timedelta(seconds=30))
        time.sleep(0.5)
        raise ValueError("rank 0 leaves the recv")
    store.set("rank 1 in recv", "1")
    dist.recv(torch.ones(1), src=0)


def test_a_peer_nothing_can_release_gets_the_pool_restarted_and_the_error_says_so_first(
    pool, monkeypatch
):
    monkeypatch.setattr("nblaunch.engine.pool.task_end.INTERRUPT_WAIT_S", 1.0)  # 3 s otherwise
    pool.run(keep_a_model)
    old = pool.pids
    began = time.monotonic()
    with pytest.raises(PoolRestartedError) as info:
        pool.run(rank_one_waits_in_recv)
    assert time.monotonic() - began < 1.0 + 8.0
    first = str(info.value).splitlines()[0]
    assert first.startswith("The pool was restarted, so the names from earlier cells are gone")
    assert "rank(s) 1 did not stop within 1 s" in first
    assert "no collective call the checks recorded holds rank(s) 1: a point-to-point" in first
    assert "The cell's own error is above: ValueError: rank 0 leaves the recv" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert pool.state is Lifecycle.IDLE and set(pool.pids).isdisjoint(old)
    assert wait_until(lambda: not any(p.pid in old for p in rank_children()), timeout=5)
    with pytest.raises(KeyError):
        pool.run(check_the_names_and_a_collective)  # as the error said: no model any more


def test_the_owed_calls_are_those_every_missing_rank_can_issue():
    record = {"op": "torch.distributed.all_reduce", "shapes": [[2]], "dtypes": ["f"], "n": 1}
    p2p = {"op": "torch.distributed.all_to_all", "n": 1}
    members = {"0": [0, 1, 2], "7": [1, 2]}
    open_calls = {
        (5, "0", 3): {1: record, 2: record},  # rank 0 owes it
        (5, "7", 1): {1: record},  # rank 2 owes it, but still runs
        (4, "0", 9): {1: record},  # an earlier task's
    }
    owed = owed_calls(open_calls, members, 5, idle={0}, skip=set())
    assert owed.calls == {0: [{"group": "0", "n": 3, "record": record}]}
    assert owed.keys == [(5, "0", 3)] and owed.waiting == {1, 2} and not owed.problem
    assert not owed_calls(open_calls, members, 5, idle={0}, skip={(5, "0", 3)}).calls
    both = owed_calls(open_calls, members, 5, idle={0, 2}, skip=set())
    assert both.calls[2] == [{"group": "7", "n": 1, "record": record}]
    cannot = owed_calls({(5, "0", 1): {1: p2p, 2: p2p}}, members, 5, idle={0}, skip=set())
    assert not cannot.calls
    assert cannot.problem == (
        "rank(s) 1, 2 wait in torch.distributed.all_to_all, which nblaunch cannot release"
    )
    first = {"op": DDP_ALL_REDUCE, "shapes": [[9]], "dtypes": ["f"], "n": 1}
    first["args"] = {"first step": True}
    assert unsupported(first) == (
        "DDP's backward all-reduce of a model's first step, after which DDP rebuilds its buckets"
    )
    assert unsupported(dict(first, args={})) is None
    unknown = owed_calls({(5, "3", 1): {1: record}}, members, 5, idle={0}, skip=set())
    assert unknown.problem == "the ranks of process group 3 are not known"
