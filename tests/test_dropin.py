"""Code written for torchrun, the PyTorch DDP tutorial, Accelerate and Transformers, unchanged.

Real rank processes (CPU, gloo, 2 ranks) under ``notebook_launcher`` and ``nblaunch run``; the
tutorial in ``%%distributed`` cells, one-shot and on the pool, is in ``test_magics.py``; a
Transformers ``Trainer`` with default arguments (no ``ACCELERATE_USE_CPU`` in the caller's
environment) training on both CPU ranks is in ``compat/test_compat.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import nblaunch
from nblaunch import notebook_launcher
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.options import LaunchOptions
from tests.conftest import skip_unless_accelerates_test_ops_runs_on_cpu


def launch(function, args=(), n=2, **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, n, device_type="cpu", **kwargs)


# --- the PyTorch DDP tutorial (intermediate/ddp_tutorial), as written there -----------------------
# Only `.to(rank)` and `device_ids=[rank]` are left out: these ranks run on the CPU.


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()  # noqa: UP008 - the tutorial's own words
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and wrap it with DDP
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def tutorial_on_this_rank():
    """How a user calls the tutorial's demo_basic(rank, world_size) from a launched function."""
    demo_basic(nblaunch.rank(), nblaunch.world_size())
    return dist.is_initialized()


def all_reduce_sum():
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return total.item()


def test_the_ddp_tutorial_runs_under_notebook_launcher_and_the_next_launch_gets_a_group(capsys):
    assert launch(tutorial_on_this_rank, display="text") == [False, False]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] Finished running basic DDP example on rank {rank}." in out
    assert launch(all_reduce_sum) == [3.0, 3.0]


def test_a_function_written_for_mp_spawn_is_told_what_to_pass():
    # mp.spawn(demo_basic, args=(world_size,)) puts the rank first; a launcher passes args only.
    with pytest.raises(ValueError, match=r"init_process_group\(rank=2\) but this process is rank"):
        launch(demo_basic, (2, 2))


def test_init_calls_nblaunchs_group_satisfies_keep_it():
    def calls():
        import datetime

        ours = dist.group.WORLD
        dist.init_process_group()
        dist.init_process_group("gloo")
        dist.init_process_group(
            backend="gloo", init_method="env://", rank=dist.get_rank(), world_size=2
        )
        dist.init_process_group(backend="cpu:gloo,cuda:nccl")  # gloo is what CPU tensors use
        dist.init_process_group(device_id=torch.device("cpu"))
        kept = dist.group.WORLD is ours
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # made anew
        return kept, dist.group.WORLD is ours, all_reduce_sum()

    assert launch(calls) == [(True, False, 3.0)] * 2


def test_init_arguments_nblaunch_cannot_honour_raise_a_clear_error():
    def mistakes():
        messages = []
        for kwargs in (
            {"backend": "gloo", "rank": 3, "world_size": 2},
            {"backend": "gloo", "world_size": 4},
            {"backend": "nccl"},
            {"device_id": torch.device("cuda", 0)},
            {"device_id": 0},
        ):
            try:
                dist.init_process_group(**kwargs)
            except ValueError as exc:
                messages.append(str(exc))
        return messages, all_reduce_sum()  # nblaunch's group is still there

    messages, total = launch(mistakes)[1]
    assert total == 3.0 and len(messages) == 5
    rank3, size4, nccl, cuda, index = messages
    assert rank3.startswith("rank 1 of 2: init_process_group(rank=3) but this process is rank 1")
    assert "pass rank=nblaunch.rank()" in rank3
    assert "world_size=4) but nblaunch started 2 ranks" in size4 and "num_processes=4" in size4
    assert "backend='nccl') on a CPU rank: NCCL runs only on CUDA" in nccl
    assert "Use backend='gloo'" in nccl
    assert "device_id='cuda:0') but this rank runs on cpu" in cuda
    assert "device_id=0) names an accelerator, but nblaunch started CPU ranks" in index


def test_after_a_destroy_init_makes_a_new_group_on_nblaunchs_store():
    def again():
        sums = []
        for _ in range(3):
            dist.destroy_process_group()
            dist.init_process_group("gloo")
            sums.append(all_reduce_sum())
        dist.destroy_process_group()
        dist.init_process_group(backend="cpu:gloo,cuda:nccl")  # no NCCL here: gloo only
        return sums, all_reduce_sum(), dist.get_backend()

    assert launch(again) == [([3.0] * 3, 3.0, "cpu:gloo")] * 2


def test_the_cuda_build_without_gpus_gets_gloo_after_a_destroy():
    # The CUDA build of torch (what `pip install torch` gives on Linux) on a machine without
    # GPUs has NCCL built in; making NCCL's part of the group fails there ("no GPUs found").
    def again():
        available = dist.is_backend_available
        dist.is_backend_available = lambda name: name == "nccl" or available(name)
        try:
            dist.destroy_process_group()
            dist.init_process_group(backend="cpu:gloo,cuda:nccl")
            return all_reduce_sum(), dist.get_backend(), torch.cuda.is_available()
        finally:
            dist.is_backend_available = available

    assert launch(again) == [(3.0, "cpu:gloo", False)] * 2


# --- nblaunch run --------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main():
        dist.init_process_group(backend="gloo")
        rank = dist.get_rank()
        model = DDP(torch.nn.Linear(4, 1))
        model(torch.randn(8, 4)).sum().backward()
        print(f"rank {rank} of {dist.get_world_size()} stepped")
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
"""


def test_a_torchrun_script_that_makes_and_destroys_its_group_runs_with_nblaunch_run(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    done = subprocess.run(
        [sys.executable, "-m", "nblaunch", "run", "train.py", "-n", "2", "--device", "cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 stepped" in done.stdout


# --- Accelerate and Transformers on CPU ranks ----------------------------------------------------


def test_cpu_ranks_tell_accelerate_to_use_the_cpu_unless_the_caller_said_otherwise(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    plan = plan_launch(print, 2, LaunchOptions(device_type="cpu"))
    assert plan.rank_env(1)["ACCELERATE_USE_CPU"] == "1"
    assert plan.notes == [
        "CPU ranks: ACCELERATE_USE_CPU=1 set so Accelerate and Transformers run distributed "
        "on all 2 ranks"
    ]
    plan = plan_launch(print, 1, LaunchOptions(device_type="cpu"))  # not "all 1 ranks"
    assert plan.notes == [
        "CPU rank: ACCELERATE_USE_CPU=1 set so Accelerate and Transformers use the CPU"
    ]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "no")
    plan = plan_launch(print, 2, LaunchOptions(device_type="cpu"))
    assert plan.rank_env(1)["ACCELERATE_USE_CPU"] == "no" and plan.notes == []
    assert any("ACCELERATE_USE_CPU=no is set" in w for w in plan.warnings)


def test_accelerates_own_test_ops_pass_under_nblaunchs_debug_launcher(monkeypatch, capsys):
    skip_unless_accelerates_test_ops_runs_on_cpu()
    from accelerate.test_utils.scripts import test_ops

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert nblaunch.debug_launcher(test_ops.main) == [None, None]
    out = capsys.readouterr().out
    assert "DistributedType.MULTI_CPU" in out and "testing sending tensors across devices" in out
    # The view's header says what was set, and why.
    assert "nblaunch: CPU ranks: ACCELERATE_USE_CPU=1 set so Accelerate and Transformers" in out
