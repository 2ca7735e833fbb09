"""Collectives, debug-mode verification and triggers: real ranks, CPU, gloo, 2 ranks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import nblaunch
from nblaunch import DistributedOperationException, notebook_launcher
from nblaunch.ranks.checks.debug_mode import call_site
from nblaunch.ranks.checks.debug_patches import verified_collectives
from nblaunch.ranks.checks.debug_report import mismatch_message, split_site

SHAPE_TABLE = """\
Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid.

Operation: `{op}`
Input shapes:
  - Process 0: [1, 5]
  - Process 1: [1, 2, 5]
"""


def launch(function, args=(), n=2, **kwargs):
    kwargs.setdefault("display", "none")
    kwargs.setdefault("timeout", 60)  # a deadlock fails the test instead of hanging it
    return notebook_launcher(function, args, n, device_type="cpu", **kwargs)


# --- the collectives ------------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_collectives_give_the_same_results_with_and_without_debug(debug):
    def collectives():
        import torch

        r = nblaunch.rank()
        nested = {"a": torch.tensor([r, r]), "b": [torch.tensor(float(r))]}
        gathered = nblaunch.gather(nested)
        shared = nblaunch.broadcast(torch.tensor([float(r), 7.0]), from_process=1)
        objects = nblaunch.broadcast_object_list([f"from {r}", r], from_process=1)
        mean = nblaunch.reduce(torch.tensor([1.0 + r]))
        total = nblaunch.reduce(torch.tensor([1.0 + r]), "sum", scale=10.0)
        maximum = nblaunch.all_reduce(torch.tensor([1.0 + r]), "max")
        padded = nblaunch.pad_across_processes(torch.ones(r + 1, 2), dim=0, pad_index=-1)
        first = nblaunch.pad_across_processes(torch.ones(2, r + 1), dim=1, pad_first=True)
        return {
            "a": gathered["a"].tolist(),
            "b": gathered["b"][0].tolist(),
            "objects": nblaunch.gather_object({"rank": r}),
            "lists": nblaunch.gather_object([r, r]),
            "broadcast": shared.tolist(),
            "broadcast_objects": objects,
            "mean": mean.item(),
            "sum": total.item(),
            "max": maximum.item(),
            "padded": padded.tolist(),
            "pad_first": first.tolist(),
        }

    rank0, rank1 = launch(collectives, debug=debug)
    assert rank0["a"] == rank1["a"] == [0, 0, 1, 1]
    assert rank0["b"] == [0.0, 1.0]
    assert rank0["objects"] == rank1["objects"] == [{"rank": 0}, {"rank": 1}]
    assert rank0["lists"] == [0, 0, 1, 1]
    assert rank0["broadcast"] == rank1["broadcast"] == [1.0, 7.0]
    assert rank0["broadcast_objects"] == ["from 1", 1]
    assert rank0["mean"] == rank1["mean"] == 1.5
    assert rank0["sum"] == 30.0
    assert rank0["max"] == rank1["max"] == 2.0
    assert rank0["padded"] == [[1.0, 1.0], [-1.0, -1.0]]
    assert rank1["padded"] == [[1.0, 1.0], [1.0, 1.0]]
    assert rank0["pad_first"] == [[0.0, 1.0], [0.0, 1.0]]


def test_outside_a_launch_collectives_return_their_input():
    t = torch.arange(3)
    assert nblaunch.gather(t) is t
    assert nblaunch.broadcast(t) is t
    assert nblaunch.all_reduce(t, "mean") is t
    assert torch.equal(nblaunch.reduce(t.float(), "sum", scale=2.0), t.float() * 2)
    assert nblaunch.pad_across_processes(t) is t
    assert nblaunch.gather_object("x") == ["x"]
    assert nblaunch.broadcast_object_list([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="reduction must be one of"):
        nblaunch.reduce(t, "median")


def test_gather_refuses_non_tensors_with_a_pointer_to_gather_object():
    def gather_strings():
        return nblaunch.gather(["a", "b"])

    with pytest.raises(TypeError, match="use gather_object"):
        launch(gather_strings)


# --- debug mode -----------------------------------------------------------------------------------


def _mismatched_broadcast(use_torch):
    import torch
    import torch.distributed as dist

    t = torch.arange(5.0).reshape(1, 5) if dist.get_rank() == 0 else torch.zeros(1, 2, 5)
    try:
        if use_torch:
            dist.broadcast(t, src=0)
        else:
            nblaunch.broadcast(t, from_process=0)
    except DistributedOperationException as exc:
        return str(exc)
    return t.tolist()


@pytest.mark.parametrize(
    ("use_torch", "op"),
    [(False, "nblaunch.ranks.ops.broadcast"), (True, "torch.distributed.broadcast")],
)
def test_mismatched_broadcast_raises_on_every_rank_in_debug_mode(use_torch, op):
    rank0, rank1 = launch(_mismatched_broadcast, (use_torch,), debug=True)
    assert rank0 == rank1  # every rank raised, with the same report
    assert rank0.startswith(SHAPE_TABLE.format(op=op))
    assert "Called at:\n  - Process 0: test_ops.py:" in rank0


def test_without_debug_a_mismatched_broadcast_silently_corrupts_the_tensor():
    # What debug mode is for: gloo fills only the first row of rank 1's [1, 2, 5] tensor.
    rank0, rank1 = launch(_mismatched_broadcast, (True,), debug=False)
    assert rank0 == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    assert rank1 == [[[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0, 0.0]]]


def test_in_the_notebook_the_report_is_raised_once_as_the_root_cause():
    def mismatch():
        import torch

        shape = (1, 5) if nblaunch.rank() == 0 else (1, 2, 5)
        nblaunch.broadcast(torch.zeros(shape))

    started = time.monotonic()
    with pytest.raises(DistributedOperationException) as info:
        launch(mismatch, debug=True)
    assert time.monotonic() - started < 30  # an error, not a hang
    assert str(info.value).startswith(SHAPE_TABLE.format(op="nblaunch.ranks.ops.broadcast"))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on every rank (2 of 2)" in notes  # the verdict is every rank's, not one's
    assert "Input shapes" not in notes  # the other ranks' identical reports are not repeated
    assert "debug=True" not in notes  # debug mode was on: no hint to turn it on


@pytest.mark.parametrize(
    ("name", "value"), [("NBLAUNCH_DEBUG", "yes"), ("ACCELERATE_DEBUG_MODE", "On")]
)
def test_the_debug_environment_variables_turn_verification_on(monkeypatch, name, value):
    monkeypatch.delenv("NBLAUNCH_DEBUG", raising=False)
    monkeypatch.setenv(name, value)
    rank0, rank1 = launch(_mismatched_broadcast, (True,))
    assert rank0 == rank1
    assert rank0.startswith("Cannot apply desired operation due to shape mismatches")


def test_different_operations_name_each_ranks_call_and_line():
    def diverge():
        import torch
        import torch.distributed as dist

        t = torch.ones(2)
        try:
            if dist.get_rank() == 0:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
        except DistributedOperationException as exc:
            return str(exc)

    rank0, rank1 = launch(diverge, debug=True)
    assert rank0 == rank1
    assert "processes called different collectives" in rank0
    assert "rank 0 called broadcast at test_ops.py:" in rank0
    assert "rank 1 called all_reduce at test_ops.py:" in rank0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "dist.all_reduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64))",
            "Input dtypes:\n  - Process 0: torch.float32\n  - Process 1: torch.float64",
        ),
        (
            "dist.broadcast(torch.ones(2), src=r)",
            "Arguments:\n  - Process 0: src=0\n  - Process 1: src=1",
        ),
        (
            "dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if r else dist.ReduceOp.MAX)",
            "Arguments:\n  - Process 0: op=MAX\n  - Process 1: op=SUM",
        ),
        (
            "dist.all_gather_into_tensor(torch.zeros(4 if r == 0 else 3), torch.ones(2))",
            "  - Process 1: output_tensor has shape [3] but must hold 2 x input [2]",
        ),
        (
            "dist.all_gather([torch.zeros(2), torch.zeros(2)], torch.ones(2 if r == 0 else 3))",
            "Input shapes:\n  - Process 0: [2]\n  - Process 1: [3]",
        ),
        (  # NCCL would take these uneven shapes; gloo refuses them, so debug mode does too
            "dist.all_gather([torch.zeros(2), torch.zeros(3)], torch.ones(2 + r))",
            "Input shapes:\n  - Process 0: [2]\n  - Process 1: [3]",
        ),
        (
            "dist.broadcast_object_list([None] * (r + 1), src=0)",
            "  - Process 0: len(object_list)=1\n  - Process 1: len(object_list)=2",
        ),
    ],
    ids=[
        "dtype",
        "src",
        "reduce-op",
        "output-size",
        "all-gather",
        "all-gather-uneven-gloo",
        "object-list",
    ],
)
def test_torch_collectives_are_verified_in_debug_mode(body, expected):
    namespace: dict = {}
    exec(
        "def call():\n"
        "    import torch, torch.distributed as dist\n"
        "    from nblaunch import DistributedOperationException\n"
        "    r = dist.get_rank()\n"
        "    try:\n"
        f"        {body}\n"
        "    except DistributedOperationException as exc:\n"
        "        return str(exc)\n",
        namespace,
    )
    rank0, rank1 = launch(namespace["call"], debug=True)
    assert rank0 == rank1
    assert expected in rank0


def test_valid_torch_collectives_pass_verification_unchanged():
    def valid():
        import torch
        import torch.distributed as dist

        r = dist.get_rank()
        out = [torch.zeros(2), torch.zeros(2)]
        dist.all_gather(out, torch.full((2,), float(r)))
        flat = torch.zeros(4)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
        objects = [None, None]
        dist.all_gather_object(objects, {"r": r})
        chunk = torch.zeros(1)
        dist.all_to_all_single(chunk.expand(2).clone(), torch.full((2,), float(r)))
        dist.reduce_scatter_tensor(chunk, torch.ones(2))
        dist.barrier()
        nblaunch.wait_for_everyone()
        wrapped = hasattr(dist.all_reduce, "__nblaunch_original__")
        return [t.tolist() for t in out], flat.tolist(), objects, chunk.item(), wrapped

    for debug in (False, True):
        rank0, _ = launch(valid, debug=debug)
        assert rank0[:4] == (
            [[0.0, 0.0], [1.0, 1.0]],
            [0.0, 0.0, 1.0, 1.0],
            [{"r": 0}, {"r": 1}],
            2.0,
        )
        assert rank0[4] is debug  # patched inside ranks only while debug mode is on


def test_verification_costs_one_extra_collective_per_call():
    def count():
        import torch
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        before = group._get_sequence_number_for_group()
        nblaunch.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4))
        nblaunch.gather(torch.ones(2))
        return group._get_sequence_number_for_group() - before

    assert launch(count, debug=False) == [3, 3]
    assert launch(count, debug=True) == [6, 6]


def test_patches_are_removed_after_the_block():
    original = dist.all_reduce
    with verified_collectives():
        assert dist.all_reduce is not original
        assert dist.all_reduce.__nblaunch_original__ is original
    assert dist.all_reduce is original


def test_a_failure_inside_a_collective_without_debug_suggests_debug_mode():
    def wrong_output_size():
        import torch
        import torch.distributed as dist

        out = torch.zeros(3 if dist.get_rank() == 0 else 4)
        dist.all_gather_into_tensor(out, torch.ones(2))

    with pytest.raises(RuntimeError) as info:
        launch(wrong_output_size, debug=False)  # the default checks name it (test_checks.py)
    assert "debug=True" in "\n".join(info.value.__notes__)


# --- the report -----------------------------------------------------------------------------------


def _record(rank, **fields):
    record = {
        "op": "torch.distributed.all_reduce",
        "rank": rank,
        "site": f"cell line {4 + rank}",
        "rule": "same",
        "n": 1,
        "shapes": [[2]],
        "dtypes": ["torch.float32"],
        "devices": ["cuda"],
        "key": {"shape": "s", "dtype": "d", "device": "cuda"},
        "out": None,
        "args": {},
        "problem": None,
    }
    record.update(fields)
    return record


def test_device_mismatches_get_a_table_of_their_own():
    message = mismatch_message(
        [_record(0), _record(1, devices=["cpu"], key={"shape": "s", "dtype": "d", "device": "x"})]
    )
    assert message.startswith("Cannot apply desired operation due to device mismatches.")
    assert "Input devices:\n  - Process 0: cuda\n  - Process 1: cpu" in message
    assert "Called at:\n  - Process 0: cell line 4\n  - Process 1: cell line 5" in message
    assert mismatch_message([_record(0), _record(1)]) is None


def test_call_sites_in_notebook_cells_are_cell_lines():
    namespace = {"call_site": call_site}
    code = compile("\n\nsite = call_site()\n", "/tmp/ipykernel_4242/123456.py", "exec")
    exec(code, namespace)
    cell = "/tmp/ipykernel_4242/123456.py"
    assert split_site(namespace["site"]) == ("cell line 3", [cell, 3, "<module>"])
    assert split_site(call_site())[0].startswith("test_ops.py:")


def test_a_call_a_library_made_names_the_users_line_through_the_librarys():
    library = {"call_site": call_site}
    exec(
        compile("def gather():\n    return call_site()\n", "/v/site-packages/acc/ops.py", "exec"),
        library,
    )
    namespace = {"gather": library["gather"]}
    code = compile(
        "\ndef train():\n    return gather()\nsite = train()\n", "/tmp/ipykernel_1/2.py", "exec"
    )
    exec(code, namespace)
    assert split_site(namespace["site"]) == (
        "cell line 3, through acc/ops.py:2",
        ["/tmp/ipykernel_1/2.py", 3, "train"],
    )


# --- triggers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_a_trigger_stops_every_rank_at_the_same_step(debug):
    def train():
        for step in range(50):
            if nblaunch.rank() == 1 and step == 3:
                nblaunch.set_trigger()
            if nblaunch.check_trigger():
                return step, nblaunch.check_trigger()  # fired once, then reset
        return None

    assert launch(train, debug=debug) == [(3, False), (3, False)]


def test_a_trigger_outside_a_launch():
    assert nblaunch.check_trigger() is False
    nblaunch.set_trigger()
    assert nblaunch.check_trigger() is True
    assert nblaunch.check_trigger() is False
