"""Third-party distributed workloads, each written once and run by two launchers.

Every function here is a complete rank program: it returns what the compatibility tests compare
(losses, a digest of the final weights, what the framework believed about the run). The tests
run it with ``nblaunch.notebook_launcher`` (the function travels to the ranks by reference, so
this directory must be on ``sys.path``) and with torchrun, which runs this file::

    python -m torch.distributed.run --standalone --nproc-per-node 2 workloads.py NAME '{"k": 1}' ...

Under torchrun each rank writes its result of each workload as JSON to a file in the working
directory; :func:`read_results` collects them by rank. Floats survive JSON exactly (``repr``
round-trips), so "equal" means bit-identical.

Nothing is downloaded: models are built from configs, data is synthetic and seeded. Heavy
frameworks are imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def digest(module: Any) -> str:
    """SHA-256 of a module's parameters, in order: equal digests mean bit-identical weights."""
    sha = hashlib.sha256()
    for name, param in module.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # a sharded DTensor (FSDP2): every rank gathers
            tensor = tensor.full_tensor()
        sha.update(name.encode())
        sha.update(tensor.cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# --- (a) the PyTorch DDP tutorial --------------------------------------------------------------
# https://pytorch.org/tutorials/intermediate/ddp_tutorial.html, "Basic Use Case", kept as written
# but for three changes a CPU run needs or a comparison needs: no ``.to(rank)`` /
# ``device_ids=[rank]`` (there is no GPU), no ``os.environ["MASTER_PORT"] = "12355"`` (both
# launchers give the rank its address and port; under torchrun that line would point the ranks
# at a port nobody listens on), and seeded data with a loop of ``steps`` steps instead of one.


def ddp_tutorial(steps: int = 5, seed: int = 0) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    def setup(rank: int, world_size: int) -> None:
        # initialize the process group
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def cleanup() -> None:
        dist.destroy_process_group()

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net2(self.relu(self.net1(x)))

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(seed + rank)  # each rank its own data; DDP gives every rank rank 0's weights

    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    result = {"rank": rank, "losses": losses, "weights": digest(model), "threads": _threads()}
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
    return result


# --- (b) Transformers Trainer ------------------------------------------------------------------


def transformers_trainer(
    output_dir: str, steps: int = 4, seed: int = 0, metrics: bool = False, prints: bool = False
) -> dict[str, Any]:
    """A 1-layer GPT-2 trained by ``Trainer`` with default ``TrainingArguments`` (but a few
    that keep it small and offline: steps, batch size, no reporting, no checkpoints).
    ``metrics``: with nblaunch's callback, as a user who wants the charts would add it.
    ``prints``: with a callback that prints on every rank, as users write them: the logs,
    then, at the end, the rank's number and its shard's."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, count: int, length: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, config.vocab_size, (count, length), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
    )
    callbacks = []
    if metrics:
        from nblaunch.integrations import TrainerMetrics

        callbacks.append(TrainerMetrics())
    if prints:
        callbacks.append(_printing_callback())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 16), callbacks=callbacks)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "rank": int(os.environ["RANK"]),
        "process_index": args.process_index,  # 0 on every rank when it does not run in parallel
        "world_size": args.world_size,
        "parallel_mode": str(args.parallel_mode),
        "losses": losses,
        "weights": digest(model),
        "threads": _threads(),
    }


def _printing_callback() -> Any:
    from transformers import TrainerCallback

    class Prints(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            print(logs)

        def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            print(f"hello from rank {args.process_index}")
            print(f"on shard {args.process_index}")

    return Prints()


# --- (c) Lightning: Trainer and Fabric ---------------------------------------------------------


def _regression_data(seed: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1)


def lightning_trainer(steps: int = 6, seed: int = 0, metrics: bool = False) -> dict[str, Any]:
    """``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` on a tiny module.
    ``metrics``: ``self.log`` the loss, with nblaunch's logger."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.layer(x), y)
            self.losses.append(loss.item())
            if metrics:
                self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    L.seed_everything(seed, verbose=False)
    model = Tiny()
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=_lightning_logger() if metrics else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(_regression_data(seed), batch_size=8, shuffle=True))
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "losses": model.losses,
        "weights": digest(model),
        "threads": _threads(),
    }


def _lightning_logger() -> Any:
    from nblaunch.integrations import LightningMetrics

    return LightningMetrics()


def lightning_fabric(steps: int = 6, seed: int = 0) -> dict[str, Any]:
    """``Fabric(accelerator="cpu", devices=2, strategy="ddp")`` with a hand-written loop."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(seed, verbose=False)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(_regression_data(seed), batch_size=8, shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    losses: list[float] = []
    while len(losses) < steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "losses": losses,
        "weights": digest(model),
        "threads": _threads(),
    }


def dataloader_workers(workers: int = 2) -> dict[str, Any]:
    """A ``DataLoader`` with worker processes and a ``collate_fn`` made on the spot, as
    notebooks write them: under torchrun the workers are forked from the rank."""
    import multiprocessing
    import time

    import torch
    from torch.utils.data import DataLoader

    began = time.monotonic()
    offset = 100 * int(os.environ["RANK"])
    loader = DataLoader(
        list(range(8)),
        batch_size=4,
        num_workers=workers,
        collate_fn=lambda batch: torch.tensor(batch) + offset,  # a closure: pickles only by fork
    )
    batches = [batch.tolist() for batch in loader]
    return {
        "rank": int(os.environ["RANK"]),
        "start_method": multiprocessing.get_start_method(),
        "batches": batches,
        "seconds": time.monotonic() - began,
    }


# --- (d) Accelerate's own test scripts ---------------------------------------------------------


def accelerate_script(name: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``accelerate.test_utils.scripts.<name>.main()``: the script asserts its own results.

    ``skip`` names test functions of the script that ``main()`` should not run (replaced by
    no-ops), for one that cannot pass on CPU ranks under any launcher.
    """
    import importlib

    from accelerate.state import PartialState

    script = importlib.import_module(f"accelerate.test_utils.scripts.{name}")
    for function in skip:
        setattr(script, function, lambda *args, **kwargs: None)
    script.main()
    state = PartialState._shared_state  # main() destroyed the process group; the facts remain
    return {
        "rank": int(os.environ["RANK"]),
        "distributed_type": str(state.get("distributed_type")),
        "num_processes": state.get("num_processes"),
    }


# --- (e) FSDP2 and distributed checkpointing ---------------------------------------------------


def fsdp2_dcp(checkpoint_dir: str, steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """A few ``fully_shard`` training steps on gloo, then a ``torch.distributed.checkpoint``
    save and a load into a freshly initialised model (the round trip must give the weights)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():  # torchrun leaves this to the script
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))

    def build(init_seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(init_seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, optimizer = build(seed)
    generator = torch.Generator().manual_seed(seed + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), torch.zeros(8, 4))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    trained = digest(model)

    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=checkpoint_dir,
    )
    fresh, fresh_optimizer = build(seed + 1000)
    before_load = digest(fresh)
    state = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, fresh_optimizer),
    }
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])
    loaded = digest(fresh)
    # one more step on each: the restored optimizer state must give the same next loss
    x = torch.randn(8, 16, generator=generator)
    next_losses = []
    for net, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        loss = torch.nn.functional.mse_loss(net(x), torch.zeros(8, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        next_losses.append(loss.item())
    return {
        "rank": rank,
        "losses": losses,
        "weights": trained,
        "fresh_differs": before_load != trained,
        "loaded": loaded,
        "next_losses": next_losses,
        "after_next_step": [digest(model), digest(fresh)],
        "threads": _threads(),
    }


# --- the torchrun entry ------------------------------------------------------------------------


def workload_kwargs(name: str, directory: Path) -> dict[str, Any]:
    """Arguments of a workload that need a directory of its own (checkpoints, outputs)."""
    if name == "fsdp2_dcp":
        return {"checkpoint_dir": str(directory / "checkpoint")}
    if name == "transformers_trainer":
        return {"output_dir": str(directory / "trainer")}
    return {}


def read_results(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """What a torchrun run's ranks wrote to ``directory``: workload name -> results by rank."""
    results: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.rank*.json")):
        name = path.name.split(".rank")[0]
        results.setdefault(name, []).append(json.loads(path.read_text()))
    return {name: sorted(ranks, key=lambda r: r["rank"]) for name, ranks in results.items()}


def main(argv: list[str]) -> None:
    """``workloads.py NAME KWARGS_JSON [NAME KWARGS_JSON ...]``: run each in turn.

    Several workloads share one torchrun run, so a framework is imported once. Each rank writes
    ``NAME.rank<R>.json`` in the working directory (a file rather than stdout, where two
    ranks' lines can interleave).
    """
    for name, kwargs in zip(argv[::2], argv[1::2], strict=True):
        result = globals()[name](**json.loads(kwargs))
        Path(f"{name}.rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
    # The results are written. Skip the interpreter's teardown: with gloo, destroying a process
    # group while a DDP reducer is still alive aborts the process now and then ("terminate
    # called without an active exception"), which failed the reference run, not the workload.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
