"""Hang diagnosis on real training code: DDP's collectives are issued from C++ in backward().

Real processes, 2 CPU ranks on gloo, the default hang_timeout (300 s): each case must end in
seconds because the process groups' own counts show a rank waiting in a collective its peer
will never issue.
"""

from __future__ import annotations

import inspect
import re
import sys
import time

import pytest
from conftest import RANKS_LEFT_CODE, ROOT, assert_no_ranks_left

from nblaunch import (
    DistributedHangError,
    DistributedOperationException,
    RankFailedError,
    notebook_launcher,
)


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def shown(text: str) -> str:
    return re.sub(r"[^\s\"]*test_real_training\.py", "test_real_training.py", text)


def ddp_uneven_inputs():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 5 if dist.get_rank() == 0 else 4  # rank 1 has one batch fewer
    for _ in range(batches):
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()  # rank 0 waits here
        optimizer.step()
        optimizer.zero_grad()
    return batches


def ddp_early_break():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for step in range(20):
        model(torch.randn(8, 4)).sum().backward()  # rank 0 waits here
        if dist.get_rank() == 1 and step == 3:
            break  # a local condition on one rank only
    return "done"


def assert_nothing_left() -> None:
    assert_no_ranks_left(10)


@pytest.mark.parametrize(
    ("function", "returned_after"),
    [(ddp_uneven_inputs, "rank 1 returned after 9 collectives"), (ddp_early_break, None)],
)
def test_a_rank_that_left_a_ddp_loop_is_reported_in_seconds(function, returned_after):
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        launch(function)  # the default hang_timeout: 300 s
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed
    text = shown(str(info.value))
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective"), text
    if returned_after:
        assert returned_after in text
    line = line_of(function, "rank 0 waits here")
    assert "rank 0 waits in DDP gradient all-reduce (collective #" in text
    assert f"at test_real_training.py:{line} in {function.__name__}" in text, text[:600]
    assert "model.join()" in text  # DDP's own remedy for uneven inputs
    assert_nothing_left()


def ddp_skipped_step():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(30):
        loss = model(torch.randn(8, 4)).sum()
        if dist.get_rank() == 1 and step == 5:
            continue  # rank 1 skips this step's backward() and step(), and goes on
        loss.backward()  # rank 0 waits here at the end
        optimizer.step()
        optimizer.zero_grad()
    return "all 30 steps"


@pytest.mark.parametrize("debug", [None, True], ids=["checks", "debug"])
def test_a_skipped_step_is_reported_as_observed_without_a_guess_or_debug_mode(debug):
    # Issue 44 (5): the hint said "Ranks left the loop at different steps" while both ranks ran
    # every iteration, suggested debug=True, which says the same, and under debug=True named
    # debug mode's own buffer ("shapes [[2048]]") instead of the gradient all-reduce.
    with pytest.raises(DistributedHangError) as info:
        launch(ddp_skipped_step, debug=debug)
    text = shown(str(info.value))
    assert text.startswith("rank 1 of 2 returned while rank 0 waits in a collective"), text
    assert re.search(r"Rank 1 issued \d+ fewer collectives? than rank 0", text), text
    assert "the counts show where the ranks parted, not why" in text
    assert "a collective skipped on one rank" in text and "left the loop early" in text
    assert "Ranks left the loop at different steps" not in text
    assert "debug=True" not in "\n".join(getattr(info.value, "__notes__", []))
    assert "[[2048]]" not in text  # (debug mode's buffer)
    first = text.split("Stacks")[0]
    check = "debug mode's check before DDP's backward all-reduce" if debug else "DDP gradient"
    assert f"rank 0 waits in {check}" in first, first
    assert_nothing_left()


def test_a_hang_in_a_function_from_site_packages_names_its_frame_not_the_bootstrap(tmp_path):
    package_dir = tmp_path / "site-packages"
    package_dir.mkdir()
    (package_dir / "sleepy_lib.py").write_text(
        "import time\n"
        "import torch.distributed as dist\n"
        "\n"
        "def train():\n"
        "    if dist.get_rank() == 1:\n"
        "        time.sleep(120)\n"
        "    dist.barrier()\n"
    )
    sys.path.insert(0, str(package_dir))
    try:
        import sleepy_lib

        with pytest.raises(DistributedHangError) as info:
            launch(sleepy_lib.train, hang_timeout=2)
    finally:
        sys.path.remove(str(package_dir))
        sys.modules.pop("sleepy_lib", None)
    text = str(info.value)
    assert "<string>" not in text.splitlines()[0]
    assert re.match(r"rank 1 of 2 is stuck at \S*sleepy_lib\.py:6 in train outside", text), text
    assert re.search(r"rank 0: in barrier \(collective #1\) at \S*sleepy_lib\.py:7 in train", text)
    assert_nothing_left()


def bad_subgroup():
    import torch.distributed as dist

    dist.new_group(ranks=[0, 7])  # no rank 7 in a 2-rank run


def test_the_debug_mode_hint_is_only_given_for_failures_inside_collectives():
    with pytest.raises((ValueError, RankFailedError)) as info:
        launch(bad_subgroup)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank" in notes
    assert "debug=True" not in notes  # torch.distributed was involved, but no collective


# --- the bench_real scenarios: DDP, FSDP2, Trainer, Lightning, with and without debug mode -------

BENCHMARKS = ROOT / "benchmarks"
# What each scenario must end with: the exception type and the start of its first line.
EXPECTED = {
    "ddp_uneven": (DistributedHangError, "rank 1 of 2 returned while rank 0 waits"),
    "ddp_early_break": (DistributedHangError, "rank 1 of 2 returned while rank 0 waits"),
    "fsdp2_skip": (DistributedHangError, "rank 1 of 2 returned while rank 0 waits"),
    "hf_trainer_raise": (RuntimeError, "boom at step 3"),
    "lightning_raise": (RuntimeError, "boom at step 2"),
}


@pytest.fixture(scope="module")
def scenarios():
    """``benchmarks/real_scenarios.py`` (the ranks import it by name: its folder is on sys.path)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_real
        import real_scenarios

        yield real_scenarios, bench_real.nblaunch_blamed
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("debug", [False, None, True], ids=["off", "checks", "debug"])
@pytest.mark.parametrize("name", [*EXPECTED, "mismatched_collectives"])
def test_each_real_training_failure_names_the_right_rank_in_seconds(scenarios, name, debug):
    real_scenarios, blamed = scenarios
    scenario = real_scenarios.SCENARIOS[name]
    if name in ("hf_trainer_raise", "lightning_raise"):
        pytest.importorskip("transformers" if name == "hf_trainer_raise" else "lightning")
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        launch(scenario.function, debug=debug)  # the default hang_timeout: 300 s
    elapsed = time.monotonic() - started
    first_line = str(info.value).splitlines()[0]
    if name == "mismatched_collectives" and debug is False:
        # gloo aborts the process on the size mismatch: the best a run without checks can do is
        # say so and point at debug mode.
        assert isinstance(info.value, RankFailedError), info.value
        # gloo's own words: torch 2.9+ asks "Is there a distributed collective mismatch in your
        # code?", torch 2.8 only shows the failed size check
        assert re.search(r"collective mismatch|op\.preamble\.length <= op\.nbytes", str(info.value))
        assert "debug=True" in "\n".join(info.value.__notes__)
    elif name == "mismatched_collectives":
        assert isinstance(info.value, DistributedOperationException), info.value
        line = line_of(real_scenarios.mismatched_collectives, "    dist.all_reduce(t)")
        backward = line_of(real_scenarios.mismatched_collectives, "    loss.backward()")
        assert (
            f"rank 0 called all_reduce at real_scenarios.py:{line} while rank 1 entered DDP's "
            f"backward all-reduce at real_scenarios.py:{backward}"
        ) in first_line
        assert "input shapes [577]" in str(info.value)  # the gradient bucket
        assert set(blamed(info.value)) == scenario.culprits  # raised on every rank
    else:
        exc_type, start = EXPECTED[name]
        assert isinstance(info.value, exc_type), info.value
        assert first_line.startswith(start), first_line
        assert set(blamed(info.value)) == scenario.culprits, info.value
    if name == "fsdp2_skip":
        check = "debug mode's check before " if debug else ""
        assert f"rank 0 waits in {check}FSDP all-gather" in first_line, first_line
    assert elapsed < 60, elapsed
    assert_nothing_left()


COMM_HOOKS = (None, "user", "builtin")


def ddp_gradients(comm_hooks=COMM_HOOKS):
    """For each comm hook in turn, a fresh DDP model's gradients after 3 steps and how many
    times a user's hook ran; each model is deleted before the next (as separate runs)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    results = []
    for comm_hook in comm_hooks:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        calls = []
        if comm_hook == "user":

            def counting_hook(state, bucket, calls=calls):
                calls.append(bucket.index())
                return default_hooks.allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting_hook)
        elif comm_hook == "builtin":
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            model(torch.randn(8, 4, generator=generator)).sum().backward()
        results.append(([p.grad.flatten().tolist() for p in model.parameters()], len(calls)))
        del model
    return results


def test_checks_leave_ddp_gradients_and_a_users_comm_hook_as_they_were():
    # One launch per mode, each running every comm hook on a model of its own.
    plain = launch(ddp_gradients, debug=False)  # DDP's own C++ all-reduce
    default = launch(ddp_gradients)  # the out-of-band checks' hook
    checked = launch(ddp_gradients, debug=True)
    for hook, comm_hook in enumerate(COMM_HOOKS):
        by_rank = [checked[rank][hook] for rank in (0, 1)]
        assert [default[rank][hook] for rank in (0, 1)] == [plain[rank][hook] for rank in (0, 1)]
        assert by_rank == [plain[rank][hook] for rank in (0, 1)], comm_hook  # bit for bit
        assert by_rank[0] == by_rank[1], comm_hook
        if comm_hook == "user":
            assert [calls for _, calls in by_rank] == [3, 3]  # the user's hook still ran each step


def three_rank_gradients():
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 33))
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(8, 64, generator=generator)).sum().backward()
    return [p.grad.flatten().tolist() for p in model.parameters()]


def test_checks_leave_ddp_gradients_as_they_were_on_three_ranks():
    # DDP scales by 1/3 (a multiplication); dividing by 3 differs in the last bit.
    options = {"num_processes": 3, "device_type": "cpu", "display": "none"}
    plain = notebook_launcher(three_rank_gradients, debug=False, **options)
    assert notebook_launcher(three_rank_gradients, **options) == plain


def pipeline_1f1b(steps: int, leaves_at: int | None = None) -> str:
    """torch.distributed.pipelining as its docs use it: one stage of two layers per rank, a
    1F1B schedule of 4 micro-batches, the loss summed for logging; with ``leaves_at``, the last
    stage leaves at that step."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, stages = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(2 * stages)]
    mine = nn.Sequential(*layers[2 * rank : 2 * rank + 2])
    micro = torch.randn(2, 16)  # a micro-batch's shape: no shape inference over gloo
    stage = PipelineStage(mine, rank, stages, torch.device("cpu"), (micro,), (micro,))
    last = rank == stages - 1
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss() if last else None)
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.01)
    inputs, targets = torch.randn(8, 16), torch.randn(8, 16)
    for step in range(steps):
        if last and step == leaves_at:
            return "left"
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # rank 0 waits here
        elif last:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()  # rank 1 waits here
        optimizer.step()
        dist.all_reduce(torch.tensor(float(rank)))
    return "done"


def test_a_pipeline_schedule_runs_checked_and_a_stage_that_left_is_proven_in_seconds():
    """Three stages: the default checks pass the schedule's batched sends and receives and the
    loss's all-reduce; a last stage that leaves is proven from the chain of sends that wait."""
    options = {"num_processes": 3, "device_type": "cpu", "display": "none", "timeout": 60}
    assert notebook_launcher(pipeline_1f1b, (4,), **options) == ["done"] * 3
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        notebook_launcher(pipeline_1f1b, (4, 2), **options)
    elapsed = time.monotonic() - started
    text = shown(str(info.value))
    # Rank 1's wait on the stage that left is proven; rank 0's on rank 1 with it, once settled.
    assert re.match(r"(rank 1 of 3 waits|ranks 0, 1 of 3 wait) in calls that can never", text)
    line = line_of(pipeline_1f1b, "rank 1 waits here")
    assert re.search(
        r"rank 1: in isend\(\)\.wait\(\) \(send #\d+ to rank 2, tag 0\) at "
        rf"test_real_training\.py:{line} in pipeline_1f1b: .*; needs rank 2, which posted \d+ "
        "receives from it",
        text,
    ), text
    assert "rank 2: returned" in text
    assert elapsed < 15, elapsed
    assert_nothing_left()


def test_in_a_kernel_a_rank_that_left_a_ddp_loop_fails_the_cell_with_its_line(kernel):
    cell = kernel.run(
        "import torch, torch.distributed as dist\n"
        "from nblaunch import notebook_launcher\n"
        "def train():\n"
        "    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
        "    for _ in range(5 if dist.get_rank() == 0 else 4):\n"
        "        model(torch.randn(8, 4)).sum().backward()\n"
        "notebook_launcher(train, num_processes=2, device_type='cpu', display='text')\n",
        timeout=120,
    )
    assert cell["error"] == "DistributedHangError", cell
    assert cell["seconds"] < 30, cell
    assert cell["message"].startswith("rank 1 of 2 returned while rank 0 waits"), cell
    assert "DDP gradient all-reduce" in cell["message"], cell["message"]
    assert (
        "at Cell In[1]:6 in train: `model(torch.randn(8, 4)).sum().backward()`" in (cell["message"])
    ), cell["message"]
    left = kernel.run(RANKS_LEFT_CODE)
    assert left["out"].strip() == "[]", left


def test_the_hang_report_knows_debug_modes_buffer():
    from nblaunch.engine.monitors import beats
    from nblaunch.ranks.checks import debug_mode

    assert beats.RECORD_BYTES == debug_mode.RECORD_BYTES
