"""Failures in real training code, for ``bench_real.py``: six 2-rank CPU (gloo) scenarios.

Each scenario is a function with one optional argument, ``healthy``: ``False`` (the default) runs
it with its fault, ``True`` without, and that is the only difference. Each works unchanged under
three launchers:

- nblaunch's ``notebook_launcher`` (the process group is already initialised),
- torchrun, as ``python -m torch.distributed.run --nproc-per-node 2 real_scenarios.py NAME
  [--healthy]`` (the function initialises the process group from torchrun's variables),
- Accelerate's ``notebook_launcher`` (the same, from torch.distributed.elastic's variables).

The Transformers and Lightning scenarios leave the process group to the framework, as real code
does. Sizes are tiny (a healthy step takes milliseconds) and seeds are fixed.

When a rank commits the fault, it writes the time to ``$BENCH_REAL_FAULT_FILE`` (if set; the
first writer wins), so the benchmark can time from the fault to the error.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORLD_SIZE = 2
FAULT_FILE_ENV = "BENCH_REAL_FAULT_FILE"


def mark_fault(what: str) -> None:
    """Record when the fault happened; the first rank to get here wins."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "x") as stamp:
            stamp.write(f"{time.time()!r}\n{what}\n")
    except FileExistsError:
        pass


def _rank() -> int:
    """This rank's number before any framework has set up the process group."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _init() -> tuple[int, bool]:
    """Seed, one thread per rank (2 cores), and a gloo process group unless one exists.

    Returns the rank and whether this call created the process group (the caller then
    destroys it on a normal return, as a torchrun script would).
    """
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    return dist.get_rank(), created


def _finish(created: bool) -> None:
    """Destroy the process group this scenario created, once its model is gone.

    The caller drops its DDP/FSDP model first: destroying the group while a DDP reducer is
    still alive aborts the process at exit now and then ("terminate called without an active
    exception", 1 to 3 runs in 10 with gloo), which would make healthy runs fail.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if created:
        dist.destroy_process_group()


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _ddp_step(model, optimizer, generator) -> Any:
    import torch

    x = torch.randn(8, 16, generator=generator)
    y = torch.randn(8, 1, generator=generator)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


# --- 1. DDP, uneven inputs ---------------------------------------------------------------------


def ddp_uneven(healthy: bool = False) -> int:
    """DDP over per-rank shards: rank 0 has 5 batches, rank 1 only 4 (a shard one batch short).

    Rank 1 leaves the loop after 4 steps; rank 0's 5th ``loss.backward()`` waits in DDP's
    gradient all-reduce for a peer that will never join.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, created = _init()
    model = DDP(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = 5 if healthy or rank == 0 else 4
    for _ in range(batches):
        _ddp_step(model, optimizer, generator)
    if not healthy and rank == 1:
        mark_fault("rank 1 ran out of batches after 4 steps")
    del model, optimizer
    _finish(created)
    return batches


# --- 2. DDP, early break --------------------------------------------------------------------------


def ddp_early_break(healthy: bool = False) -> int:
    """DDP for 20 steps, but rank 1 ``break``s at step 3 on a condition only it sees (a local
    early-stopping check). Rank 0's next ``loss.backward()`` waits in DDP's all-reduce."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, created = _init()
    model = DDP(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    steps = 0
    for step in range(20):
        _ddp_step(model, optimizer, generator)
        steps += 1
        if not healthy and rank == 1 and step == 3:  # "my validation loss stopped improving"
            mark_fault("rank 1 broke out of the loop at step 3")
            break
    del model, optimizer
    _finish(created)
    return steps


# --- 3. mismatched collectives ------------------------------------------------------------------


def mismatched_collectives(healthy: bool = False) -> int:
    """DDP for 6 steps; at step 2 rank 0 alone all-reduces its loss for logging
    (``dist.all_reduce(t)``) before its backward, while rank 1 goes straight into
    ``loss.backward()``: rank 0's all_reduce meets rank 1's gradient all-reduce."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, created = _init()
    model = DDP(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(8, 16, generator=generator)
        y = torch.randn(8, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 2 and (healthy or rank == 0):
            if not healthy:
                mark_fault("rank 0 called all_reduce; rank 1 went into backward")
            t = loss.detach().clone()
            dist.all_reduce(t)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model, optimizer, loss
    _finish(created)
    return 6


# --- 4. FSDP2, one step skipped ------------------------------------------------------------------


def fsdp2_skip(healthy: bool = False) -> int:
    """FSDP2 (``fully_shard`` per Linear and on the root) on a CPU mesh over gloo, 6 steps;
    rank 1 skips step 2 (``continue``), so it runs out of steps one before rank 0, which then
    waits in its last step's parameter all-gather."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, created = _init()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    steps = 0
    for step in range(6):
        if not healthy and rank == 1 and step == 2:
            mark_fault("rank 1 skipped step 2")
            continue
        _ddp_step(model, optimizer, generator)
        steps += 1
    del model, optimizer
    _finish(created)
    return steps


# --- 5. Transformers Trainer ---------------------------------------------------------------------


def hf_trainer_raise(healthy: bool = False) -> int:
    """A Transformers ``Trainer`` on a one-layer GPT-2 (built from a config) and synthetic tokens,
    ``max_steps=6``; on rank 1 the model's 3rd forward raises ``RuntimeError("boom at step 3")``.

    ``use_cpu=True`` (and ``ACCELERATE_USE_CPU=1``) make Accelerate pick MULTI_CPU (gloo) from the
    launcher's ``WORLD_SIZE`` instead of one process on its own.
    """
    import torch

    os.environ["ACCELERATE_USE_CPU"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    rank = _rank()
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = GPT2LMHeadModel(config)
    forward = model.forward
    calls = 0

    @functools.wraps(forward)  # Trainer reads forward's signature to pick the dataset's columns
    def faulty_forward(*args, **kwargs):
        nonlocal calls
        calls += 1
        if not healthy and rank == 1 and calls == 3:
            mark_fault("rank 1's model raised in its 3rd forward")
            raise RuntimeError("boom at step 3")
        return forward(*args, **kwargs)

    model.forward = faulty_forward

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, config.vocab_size, (64, 16), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    with tempfile.TemporaryDirectory(prefix="bench-real-hf-") as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=6,
            per_device_train_batch_size=4,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        if args.world_size != WORLD_SIZE:  # healthy run on one process would prove nothing
            raise RuntimeError(f"Trainer runs on {args.world_size} process(es), not {WORLD_SIZE}")
        trainer.train()
        return trainer.state.global_step


# --- 6. Lightning ---------------------------------------------------------------------------------


def lightning_raise(healthy: bool = False) -> int:
    """A Lightning ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``, 6 steps; on rank 1
    ``training_step`` raises ``RuntimeError("boom at step 2")`` at batch 2.

    Under each of the three launchers Lightning finds ``TORCHELASTIC_RUN_ID`` and the torchrun
    variables, takes the torchelastic environment and starts no processes of its own.
    """
    import lightning as L
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            if not healthy and self.global_rank == 1 and batch_idx == 2:
                mark_fault("rank 1's training_step raised at step 2")
                raise RuntimeError("boom at step 2")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator)
    )
    with tempfile.TemporaryDirectory(prefix="bench-real-pl-") as root:
        trainer = L.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=WORLD_SIZE,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
        return trainer.global_step


# --- registry -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One row group of the table: the function, what goes wrong, and who is to blame.

    ``culprits`` is the set of ranks a report must name, and only those, to count as naming the
    right rank; ``rule`` says the same in words for the table's footnote. ``steps`` is what
    the function returns on every rank when it runs healthy.
    """

    name: str
    function: Callable[..., int]
    fault: str
    culprits: frozenset[int]
    rule: str
    steps: int


SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "ddp_uneven",
            ddp_uneven,
            "DDP, uneven inputs: rank 0 has 5 batches, rank 1 has 4",
            frozenset({1}),
            "rank 1 (it ran out of data and left; rank 0 is only its victim)",
            5,
        ),
        Scenario(
            "ddp_early_break",
            ddp_early_break,
            "DDP, 20 steps: rank 1 `break`s at step 3",
            frozenset({1}),
            "rank 1 (it left the loop early)",
            20,
        ),
        Scenario(
            "mismatched_collectives",
            mismatched_collectives,
            "rank 0 `dist.all_reduce(t)` while rank 1 is in DDP's `loss.backward()`",
            frozenset({0, 1}),
            "both ranks (each called a different collective: rank 0 all_reduce, rank 1 DDP's "
            "gradient all-reduce); naming one rank alone is wrong",
            6,
        ),
        Scenario(
            "fsdp2_skip",
            fsdp2_skip,
            "FSDP2 (`fully_shard`, gloo): rank 1 skips step 2 (`continue`)",
            frozenset({1}),
            "rank 1 (it skipped a step and ran out first)",
            6,
        ),
        Scenario(
            "hf_trainer_raise",
            hf_trainer_raise,
            "Transformers Trainer (tiny GPT-2): rank 1's model raises at step 3",
            frozenset({1}),
            "rank 1 (it raised)",
            6,
        ),
        Scenario(
            "lightning_raise",
            lightning_raise,
            'Lightning `Trainer(strategy="ddp")`: rank 1\'s `training_step` raises at step 2',
            frozenset({1}),
            "rank 1 (it raised)",
            6,
        ),
    )
}


def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun: run one scenario on this rank."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(description="Run one scenario on this rank (torchrun).")
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--healthy", action="store_true", help="run it without its fault")
    options = parser.parse_args(argv)
    # @record writes the exception to torchrun's error file, so its summary shows the traceback
    # (what torchrun's documentation tells users to do).
    steps = record(SCENARIOS[options.scenario].function)(healthy=options.healthy)
    print(f"{options.scenario}: rank {_rank_from_env()} finished {steps} steps", flush=True)


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    sys.exit(main())
