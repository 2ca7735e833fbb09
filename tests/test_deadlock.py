"""Deadlocks proven from the ranks' waits: the proof as a pure function, and real ranks (2 CPU,
gloo, default settings) for the cases nothing reported before (subgroups, point-to-point)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from nblaunch import DistributedHangError
from nblaunch.engine.monitors.deadlock import (
    Counts,
    Wait,
    describe_need,
    prove,
    prove_from_beats,
    wait_of,
)
from nblaunch.engine.monitors.hang import HangMonitor
from tests.conftest import assert_no_ranks_left
from tests.test_watchdog import FakeRun, launch, line_of

MEMBERS = {"0": [0, 1], "1": [0, 1]}


def counts(collectives=None, **posted):
    """Counts with posts given as send_1=2 (two sends to rank 1, tag 0, default group)."""
    table = {}
    for key, count in posted.items():
        op, peer = key.split("_")
        table[(op, "0", int(peer), 0)] = count
    return Counts(collectives if collectives is not None else {}, table)


# --- the proof ------------------------------------------------------------------------------------


def test_a_group_with_a_description_is_named_by_it_too():
    """A device mesh's groups are numbered by torch ("4") and described by the mesh ("mesh_tp"):
    what a rank needs names both, as its position names the description."""
    beat = {"collective": "all_reduce", "still_s": 2.0}
    described = wait_of({**beat, "in_flight": {"group": "4", "seq": 3, "group_desc": "mesh_tp"}})
    plain = wait_of({**beat, "in_flight": {"group": "1", "seq": 3, "group_desc": "undefined"}})
    needs = describe_need(2, described, {3}, {3: counts({"4": 2})})
    assert needs == "rank 3, which issued 2 collectives on group 4 (mesh_tp)"
    assert describe_need(0, plain, {1}, {1: counts({"1": 2})}).endswith("on group 1")


def test_collectives_of_different_groups_are_proven():
    waits = {0: Wait("collective", "1", 1), 1: Wait("collective", "0", 3)}
    issued = {0: counts({"0": 2, "1": 1}), 1: counts({"0": 3})}
    assert prove(waits, issued, set(), MEMBERS) == {0: {1}, 1: {0}}


def test_the_same_collective_on_every_rank_is_not_a_deadlock():
    # Both issued #3 on the default group: it can complete (a slow transfer, not a hang).
    waits = {0: Wait("collective", "0", 3), 1: Wait("collective", "0", 3)}
    issued = {0: counts({"0": 3}), 1: counts({"0": 3})}
    assert prove(waits, issued, set(), MEMBERS) == {}


def test_a_rank_that_is_not_waiting_breaks_every_chain_through_it():
    members = {"0": [0, 1, 2]}
    # 0 waits for 1's send; 1 waits for 2's; 2 computes: it may still send, so nothing is proven.
    waits = {0: Wait("recv", "0", 1, peer=1, tag=0), 1: Wait("recv", "0", 1, peer=2, tag=0)}
    issued = {0: counts(), 1: counts(recv_2=1, recv_0=0), 2: counts()}
    assert prove(waits, issued, set(), members) == {}
    # Once 2 returned without sending, both are proven.
    assert prove(waits, issued, {2}, members) == {0: {1}, 1: {2}}


def test_receives_from_each_other_are_proven_and_a_posted_send_is_not():
    waits = {0: Wait("recv", "0", 1, peer=1, tag=0), 1: Wait("recv", "0", 1, peer=0, tag=0)}
    assert prove(waits, {0: counts(recv_1=1), 1: counts(recv_0=1)}, set(), MEMBERS) == {
        0: {1},
        1: {0},
    }
    # Rank 1 posted an isend before its receive: rank 0's receive can complete.
    issued = {0: counts(recv_1=1), 1: counts(recv_0=1, send_0=1)}
    assert prove(waits, issued, set(), MEMBERS) == {}


def test_a_receive_from_a_rank_waiting_in_a_collective_is_proven():
    # Rank 0 waits for rank 1's send; rank 1 waits in barrier #3, which rank 0 never issued.
    waits = {0: Wait("recv", "0", 1, peer=1, tag=0), 1: Wait("collective", "0", 3)}
    issued = {0: counts({"0": 2}, recv_1=1), 1: counts({"0": 3})}
    assert prove(waits, issued, set(), MEMBERS) == {0: {1}, 1: {0}}
    # Ranks that both send first (gloo's send waits for the receive).
    sends = {0: Wait("send", "0", 1, peer=1, tag=0), 1: Wait("send", "0", 1, peer=0, tag=0)}
    issued = {0: counts(send_1=1), 1: counts(send_0=1)}
    assert prove(sends, issued, set(), MEMBERS) == {0: {1}, 1: {0}}


def test_a_returned_peer_proves_a_receive_only_if_it_never_sent_it():
    waits = {0: Wait("recv", "0", 2, peer=1, tag=0)}
    assert prove(waits, {0: counts(recv_1=2), 1: counts(send_0=1)}, {1}, MEMBERS) == {0: {1}}
    assert prove(waits, {0: counts(recv_1=2), 1: counts(send_0=2)}, {1}, MEMBERS) == {}


def test_tags_are_matched_apart_and_any_source_proves_nothing():
    # A receive with tag 7 is not answered by a send with tag 0.
    waits = {0: Wait("recv", "0", 1, peer=1, tag=7)}
    assert prove(waits, {0: counts(), 1: counts(send_0=1)}, {1}, MEMBERS) == {0: {1}}
    # A receive from any source, or a send to a rank that posted one: cannot be told.
    anysource = {0: Wait("recv", "0", 1, peer=-1, tag=0)}
    assert prove(anysource, {0: counts(), 1: counts()}, {1}, MEMBERS) == {}
    send = {0: Wait("send", "0", 1, peer=1, tag=0)}
    taker = Counts({}, {("recv", "0", -1, 0): 1})
    assert prove(send, {0: counts(send_1=1), 1: taker}, {1}, MEMBERS) == {}


def test_a_rank_counts_as_waiting_only_after_it_settled_in_a_named_wait():
    p2p = {"op": "recv", "group": "0", "peer": 1, "tag": 0, "n": 1}
    beat = {"collective": "irecv().wait()", "still_s": 0.3, "p2p_wait": p2p}
    assert wait_of(beat) is None  # not settled yet
    assert wait_of({**beat, "still_s": 1.0}) == Wait("recv", "0", 1, peer=1, tag=0)
    # In a collective the flight recorder does not count: nothing to prove with.
    assert wait_of({"collective": "barrier", "still_s": 5.0, "in_flight": None}) is None
    # Groups unknown (no counts): the peer's collectives cannot be told.
    running = {
        0: {**beat, "still_s": 1.0, "p2p_wait": None, "groups": None, "members": MEMBERS},
    }
    running[0]["in_flight"] = {"group": "1", "seq": 1}
    assert prove_from_beats(running, {1: {"groups": None}}) == {}


def test_the_monitor_names_each_ranks_wait_line_and_what_it_needs():
    hang = HangMonitor(SimpleNamespace(world_size=2, hang_timeout=300, debug=False))
    run = FakeRun()

    def beat(rank, group, seq, where):
        return {
            "kind": "heartbeat", "rank": rank, "where": where, "collective": "all_reduce",
            "wait_s": 1.0, "busy_s": 2.0, "last_output": 0.0, "stack": f"stack {rank}",
            "seq": 2, "still_s": 1.0, "groups": {"0": 2 if rank == 0 else 3, "1": 1 - rank},
            "in_flight": {"group": group, "group_desc": "", "seq": seq, "label": "all_reduce",
                          "shapes": [[3]]},
            "members": MEMBERS,
        }  # fmt: skip

    hang.on_event(run, beat(0, "1", 1, "train.py:9 in step"))
    assert hang.check(run) is None  # rank 1 has not reported yet
    hang.on_event(run, beat(1, "0", 3, "train.py:11 in step"))
    root = hang.check(run)
    text = str(root.exception)
    assert isinstance(root.exception, DistributedHangError)
    assert text.startswith("ranks 0, 1 of 2 wait in calls that can never complete")
    assert "rank 0: in all_reduce (collective #1 of subgroup 1, shapes [[3]]) at train.py:9" in text
    assert "needs rank 1, which issued 0 collectives on group 1" in text
    assert "rank 1: in all_reduce (collective #3, shapes [[3]]) at train.py:11" in text
    assert "needs rank 0, which issued 2 collectives on the default group" in text
    assert "different process groups" in text


def test_a_collective_on_a_returned_rank_is_left_to_the_returned_rank_report():
    # The proof holds at once, but "rank 1 returned while rank 0 waits" (with its set_trigger
    # advice) is the better report for it: the proof waits for it.
    hang = HangMonitor(SimpleNamespace(world_size=2, hang_timeout=300, debug=False))
    run = FakeRun()
    final = {"kind": "heartbeat", "rank": 1, "where": "", "collective": None, "wait_s": 0.0,
             "busy_s": 1.0, "last_output": 0.0, "stack": "", "seq": 3, "still_s": 0.0,
             "in_flight": None, "groups": {"0": 3}, "members": MEMBERS}  # fmt: skip
    hang.on_event(run, final)
    hang.on_event(run, {"kind": "result", "rank": 1, "value_bytes": b""})
    run.outcome.finished.add(1)
    run.clock += 0.5
    waiting = {**final, "rank": 0, "collective": "all_reduce", "still_s": 1.0, "stack": "s0",
               "where": "train.py:5 in step", "groups": {"0": 4},
               "in_flight": {"group": "0", "group_desc": "", "seq": 4, "label": "all_reduce",
                             "shapes": []}}  # fmt: skip
    hang.on_event(run, waiting)
    assert hang.check(run) is None
    run.clock += 0.6
    text = str(hang.check(run).exception)
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective"), text


def test_a_finished_collective_the_recorder_marks_late_does_not_hide_a_returned_rank():
    # gloo's flight recorder may keep #3 unfinished for good: rank 0 issued #4, which rank 1
    # (returned after 3) never did, so rank 0 waits in #4 whatever the recorder says.
    hang = HangMonitor(SimpleNamespace(world_size=2, hang_timeout=300, debug=False))
    run = FakeRun()
    final = {"kind": "heartbeat", "rank": 1, "where": "", "collective": None, "wait_s": 0.0,
             "busy_s": 1.0, "last_output": 0.0, "stack": "", "seq": 3, "still_s": 0.0,
             "in_flight": None, "groups": {"0": 3}, "members": MEMBERS}  # fmt: skip
    hang.on_event(run, final)
    hang.on_event(run, {"kind": "result", "rank": 1, "value_bytes": b""})
    run.outcome.finished.add(1)
    run.clock += 0.5
    waiting = {**final, "rank": 0, "collective": "DDP gradient all-reduce", "still_s": 1.0,
               "stack": "s0", "where": "train.py:5 in step", "groups": {"0": 4},
               "in_flight": {"group": "0", "group_desc": "", "seq": 3, "label": "all_reduce",
                             "shapes": [[8]]}}  # fmt: skip
    hang.on_event(run, waiting)
    run.clock += 1.2
    root = hang.check(run)
    assert root is not None
    text = str(root.exception)
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective"), text
    assert "rank 0 waits in DDP gradient all-reduce (collective #4) at train.py:5" in text, text


def test_the_monitor_proves_a_receive_from_a_returned_rank_at_once():
    hang = HangMonitor(SimpleNamespace(world_size=2, hang_timeout=None, debug=False))
    run = FakeRun()
    final = {"kind": "heartbeat", "rank": 1, "where": "", "collective": None, "wait_s": 0.0,
             "busy_s": 1.0, "last_output": 0.0, "stack": "", "seq": 0, "still_s": 0.0,
             "in_flight": None, "groups": {}, "p2p_posted": [["recv", "0", 0, 0, 1]],
             "members": MEMBERS}  # fmt: skip
    hang.on_event(run, final)
    hang.on_event(run, {"kind": "result", "rank": 1, "value_bytes": b""})
    run.outcome.finished.add(1)
    p2p = {"op": "recv", "group": "0", "peer": 1, "tag": 0, "n": 1}
    waiting = {**final, "rank": 0, "collective": "irecv().wait()", "still_s": 1.0, "stack": "s",
               "where": "train.py:7 in step", "p2p_wait": p2p,
               "p2p_posted": [["recv", "0", 1, 0, 1]]}  # fmt: skip
    hang.on_event(run, waiting)
    text = str(hang.check(run).exception)
    assert text.startswith("rank 0 of 2 waits in calls that can never complete"), text
    assert "rank 0: in irecv().wait() (recv #1 from rank 1, tag 0) at train.py:7" in text
    assert "needs rank 1, which posted 0 sends to it" in text
    assert "rank 1: returned" in text


# --- real ranks -----------------------------------------------------------------------------------


def proven(function, **kwargs) -> tuple[str, float]:
    """The DistributedHangError's message (paths shortened) and the seconds to it."""
    kwargs.setdefault("timeout", 60)
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        launch(function, **kwargs)
    elapsed = time.monotonic() - started
    assert_no_ranks_left(10)
    return re.sub(r"[^\s\"]*test_deadlock\.py", "test_deadlock.py", str(info.value)), elapsed


def subgroup_against_default():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t, group=group)  # rank 0 waits here
    else:
        dist.all_reduce(t)  # rank 1 waits here


def irecv_from_returned():
    import torch
    import torch.distributed as dist

    t = torch.zeros(3)
    if dist.get_rank() == 0:
        dist.irecv(t, 1).wait()  # rank 0 waits here


def batch_from_returned():
    import torch
    import torch.distributed as dist

    t = torch.zeros(3)
    if dist.get_rank() == 0:
        for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1)]):
            request.wait()  # rank 0 waits here


def receive_from_each_other():
    import torch
    import torch.distributed as dist

    t = torch.zeros(3)
    dist.recv(t, 1 - dist.get_rank())  # both wait here


def irecv_from_sleeper():
    import torch
    import torch.distributed as dist

    t = torch.zeros(3)
    if dist.get_rank() == 1:
        time.sleep(60)  # rank 1 is stuck here
    dist.irecv(t, 1).wait() if dist.get_rank() == 0 else dist.send(t, 0)


def file_line(function, marker):
    return f"test_deadlock.py:{line_of(function, marker)}"


def test_collectives_of_different_groups_are_proven_within_seconds():
    text, elapsed = proven(subgroup_against_default)
    assert elapsed < 10, elapsed
    assert text.startswith("ranks 0, 1 of 2 wait in calls that can never complete"), text
    rank0 = file_line(subgroup_against_default, "rank 0 waits here")
    rank1 = file_line(subgroup_against_default, "rank 1 waits here")
    assert f"rank 0: in all_reduce (collective #1 of subgroup 1, shapes [[3]]) at {rank0}" in text
    assert f"rank 1: in all_reduce (collective #1, shapes [[3]]) at {rank1}" in text
    assert "needs rank 1, which issued 0 collectives on group 1" in text
    assert "different process groups" in text


@pytest.mark.parametrize("function", [irecv_from_returned, batch_from_returned])
def test_a_request_waiting_on_a_returned_peer_is_proven(function):
    text, elapsed = proven(function)
    assert elapsed < 10, elapsed
    where = file_line(function, "rank 0 waits here")
    assert text.startswith("rank 0 of 2 waits in calls that can never complete"), text
    assert f"rank 0: in irecv().wait() (recv #1 from rank 1, tag 0) at {where}" in text
    assert "needs rank 1, which posted 0 sends to it" in text
    assert "rank 1: returned" in text


def test_ranks_receiving_from_each_other_are_proven():
    text, elapsed = proven(receive_from_each_other)
    assert elapsed < 10, elapsed
    where = file_line(receive_from_each_other, "both wait here")
    assert f"rank 0: in recv (recv #1 from rank 1, tag 0) at {where}" in text
    assert f"rank 1: in recv (recv #1 from rank 0, tag 0) at {where}" in text
    assert "batch_isend_irecv" in text


def pipeline_whose_middle_stage_leaves():
    """Three stages pass a tensor down 5 times (the middle one posts twice as many sends and
    receives as the others), then the middle one leaves before the loss's all-reduce."""
    import torch
    import torch.distributed as dist

    rank, stages = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    for _ in range(5):
        if rank > 0:
            dist.recv(t, rank - 1)
        if rank < stages - 1:
            dist.send(t, rank + 1)
    if rank == 1:
        return
    dist.all_reduce(t)  # ranks 0 and 2 wait here


def test_a_pipeline_stage_is_numbered_by_its_collectives_not_its_sends():
    """gloo numbers sends and receives with collectives; uneven stages gave the all-reduce #6
    on the ends and #11 in the middle, and a rank that left no collective was "after 5"."""
    text, elapsed = proven(pipeline_whose_middle_stage_leaves, num_processes=3)
    where = file_line(pipeline_whose_middle_stage_leaves, "ranks 0 and 2 wait here")
    assert text.startswith("rank 1 of 3 returned while ranks 0, 2 wait in a collective"), text
    assert "rank 1 returned after 0 collectives" in text, text
    for rank in (0, 2):
        assert f"rank {rank} waits in all_reduce (collective #1, shapes [[4]]) at {where}" in text
    assert elapsed < 10, elapsed


def posts_then_the_group_made_again():
    """A send and receive, an all-reduce; the default group destroyed and made again (as the
    DDP tutorial's set-up and clean-up do in every run), an all-reduce on the new one."""
    import torch
    import torch.distributed as dist

    from nblaunch.ranks import stacks
    from nblaunch.ranks.checks import process_groups

    def collectives():
        return process_groups.group_status()["0"][0], stacks.collective_sequence()

    t = torch.ones(2)
    (dist.send if dist.get_rank() == 0 else dist.recv)(t, 1 - dist.get_rank())
    dist.all_reduce(t)
    first = collectives()
    dist.destroy_process_group()
    dist.init_process_group("gloo")
    dist.all_reduce(t)
    return first, collectives()


def test_a_group_made_again_counts_its_collectives_from_its_start():
    for first, again in launch(posts_then_the_group_made_again):
        assert first == (1, 1)
        assert again == (1, 1)  # not 0: the first group's send or receive is not the new one's


def subgroup_left():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    t = torch.ones(3)
    for step in range(4):
        if dist.get_rank() == 1 and step == 2:
            return
        dist.all_reduce(t, group=group)  # rank 0 waits here


def test_a_rank_that_left_a_subgroups_loop_is_counted_on_that_subgroup():
    """The count of what the rank that left issued was its default group's: "after 0
    collectives" beside "collective #3 of subgroup 1"."""
    text, elapsed = proven(subgroup_left)
    where = file_line(subgroup_left, "rank 0 waits here")
    assert "rank 1 returned after 2 collectives on subgroup 1;" in text, text
    waits = f"rank 0 waits in all_reduce (collective #3 of subgroup 1, shapes [[3]]) at {where}"
    assert waits in text, text
    assert elapsed < 10, elapsed


def default_group_made_again_then_left():
    import torch
    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group("gloo")
    t = torch.ones(4)
    for step in range(6):
        if dist.get_rank() == 1 and step == 3:
            return
        dist.all_reduce(t)  # rank 0 waits here


def test_a_hang_in_a_default_group_made_again_names_it_as_the_default_group():
    """The recorder keys its status by its own count of groups made: the default group made
    again was its group 1, and the hang was reported in "subgroup 1", without shapes."""
    text, elapsed = proven(default_group_made_again_then_left)
    where = file_line(default_group_made_again_then_left, "rank 0 waits here")
    assert "rank 1 returned after 3 collectives" in text, text
    assert f"rank 0 waits in all_reduce (collective #4, shapes [[4]]) at {where}" in text, text
    assert elapsed < 10, elapsed


def test_hang_timeout_fires_for_a_request_waiting_on_a_stuck_peer():
    text, elapsed = proven(irecv_from_sleeper, hang_timeout=2)
    assert elapsed < 10, elapsed
    sleep = file_line(irecv_from_sleeper, "rank 1 is stuck here")
    assert text.startswith(f"rank 1 of 2 is stuck at {sleep}"), text
    assert "rank 0: in irecv().wait() (recv #1 from rank 1, tag 0)" in text


def correct_point_to_point_and_collectives():
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ring = torch.full((4,), float(rank))
    for _ in range(20):  # a ring exchange, both sides posted together
        got = torch.empty(4)
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, ring, (rank + 1) % world),
                dist.P2POp(dist.irecv, got, (rank - 1) % world),
            ]
        )
        for request in requests:
            request.wait()
        ring = got
    # A receive that waits a while for a peer that computes, then sends.
    t = torch.zeros(2)
    if rank == 0:
        dist.irecv(t, 1).wait()
    else:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        dist.send(torch.ones(2), 0)
    # Blocking send and receive ordered by rank, then a subgroup and the default group.
    if rank == 0:
        dist.send(torch.ones(2), 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(torch.ones(2), 0)
    group = dist.new_group([0, 1])
    if rank == 1:
        time.sleep(1.2)  # still, but not waiting: rank 0's wait on the subgroup can complete
    dist.all_reduce(t, group=group)
    dist.all_reduce(t)
    dist.gather(t, [torch.zeros(2) for _ in range(world)] if rank == 0 else None, dst=0)
    splits = [1, 2] if rank == 0 else [3, 1]
    received = [[1, 3], [2, 1]][rank]
    out = torch.empty(sum(received))
    dist.all_to_all_single(out, torch.ones(sum(splits)), received, splits)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.ones(2, 4)).sum().backward()
    return ring.tolist(), [o["rank"] for o in objects]


def test_correct_code_of_every_kind_is_never_reported():
    # Twenty swaps around a ring of two: each rank ends with its own values.
    assert launch(correct_point_to_point_and_collectives, timeout=60) == [
        ([0.0] * 4, [0, 1]),
        ([1.0] * 4, [0, 1]),
    ]
