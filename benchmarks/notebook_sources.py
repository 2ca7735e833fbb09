"""Five public distributed training sources, adapted to run on 2 CPU ranks, with faults to inject.

For ``bench_notebooks.py`` (issue 56). Each source is a function ``(fault=None) -> dict`` that
runs unchanged under nblaunch's ``notebook_launcher`` and Accelerate's; ``fault=None`` runs it as
written (adapted) and returns what the comparison needs (losses, a digest of the weights), a
fault name runs it with that fault. When a rank commits the fault it writes the time to
``$BENCH_REAL_FAULT_FILE`` (``real_scenarios.mark_fault``), so the benchmark times from there.

What was changed from each source, and why (the same for every source: no download, so models
are built from configs or small modules and data is synthetic and seeded; sizes shrunk to run in
seconds on 2 CPU cores; no ``.to(device)``/``device_ids`` since there is no GPU; a seeded loop of
fixed length):

- ``hf_nlp``: Accelerate's ``examples/nlp_example.py`` (the ``simple_nlp_example`` notebook's
  ``training_function``): BERT from a 2-layer config instead of ``bert-base-cased``; GLUE MRPC
  replaced by random token ids and labels (no ``datasets``/``evaluate``: accuracy computed by
  hand from ``gather_for_metrics``); ``Accelerator(cpu=True)``, no mixed precision.
- ``hf_cv``: Accelerate's ``examples/cv_example.py`` (``simple_cv_example``): timm's
  ``resnet50d`` replaced by a 2-conv network (timm is not installed), the Oxford pets images by
  random 3x32x32 images of 4 classes; the example's normalisation, Adam with ``lr / 25`` and
  ``OneCycleLR`` kept.
- ``ddp_tutorial``: the PyTorch DDP tutorial's "Basic Use Case" (``ToyModel``, SGD, MSE), run for
  ``STEPS`` steps on seeded data; no ``MASTER_PORT`` line (the launcher sets it).
- ``ddp_series``: pytorch/examples ``distributed/ddp-tutorial-series/multigpu.py``
  (``Trainer``, ``MyTrainDataset``, ``DistributedSampler``, ``destroy_process_group()`` at the
  end), 2 epochs of 64 samples, the checkpoint written to a temporary directory.
- ``mingpt``: pytorch/examples ``distributed/minGPT-ddp`` (``GPT``, ``CharDataset``, its
  ``Trainer`` with DDP and gradient clipping): a 1-layer GPT of width 32, a seeded random text
  instead of the Shakespeare file, no snapshots.

Faults (``FAULTS``): ``raise`` (rank 1's step 2 raises), ``one_fewer`` (rank 1 has one batch
fewer: it leaves its loop a batch early), ``shape`` (rank 1 gathers one prediction fewer),
``oom_accelerate`` (rank 1 runs out of memory, for real, above half the starting batch size,
under Accelerate's ``find_executable_batch_size``) and ``oom_nblaunch`` (the same under
nblaunch's).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from real_scenarios import mark_fault

STEPS = 6
BATCH = 8
FAULTS = ("raise", "one_fewer", "shape", "oom_accelerate", "oom_nblaunch")
OOM_BYTES = 10**12  # per sample of a batch that runs out: more than any machine's memory


def digest(module: Any) -> str:
    """SHA-256 of a module's parameters: equal digests mean bit-identical weights."""
    sha = hashlib.sha256()
    for name, param in module.named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _maybe_raise(fault: str | None, rank: int, step: int) -> None:
    if fault == "raise" and rank == 1 and step == 2:
        mark_fault("rank 1 raised at step 2")
        raise RuntimeError("injected fault: rank 1's step 2 failed")


def _finder(fault: str | None, starting: int, train: Any) -> Any:
    """``train(batch_size)`` under the batch-size finder the fault names (or called at once)."""
    if fault == "oom_accelerate":
        from accelerate.utils import find_executable_batch_size

        return find_executable_batch_size(train, starting_batch_size=starting)()
    if fault == "oom_nblaunch":
        from nblaunch import find_executable_batch_size

        return find_executable_batch_size(train, starting_batch_size=starting)()
    return train(starting)


def _out_of_memory(fault: str | None, rank: int, batch_size: int, starting: int) -> None:
    """Rank 1 runs out of memory for real at any batch size above half the starting one."""
    if fault in ("oom_accelerate", "oom_nblaunch") and rank == 1 and batch_size > starting // 2:
        import torch

        mark_fault(f"rank 1 ran out of memory at batch_size={batch_size}")
        torch.empty(batch_size * OOM_BYTES, dtype=torch.uint8)


# --- Accelerate's nlp_example (simple_nlp_example) ----------------------------------------------


def hf_nlp(fault: str | None = None) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        get_linear_schedule_with_warmup,
    )

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    lr, num_epochs, seed = 2e-5 * 100, 2, 42
    set_seed(seed)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (96, 16), generator=generator)
    labels = torch.randint(0, 2, (96,), generator=generator)

    def inner_training_loop(batch_size: int) -> dict[str, Any]:
        accelerator.free_memory()
        set_seed(seed)
        train_ids, eval_ids = ids[:64], ids[64:]
        train_set = TensorDataset(train_ids, torch.ones_like(train_ids), labels[: len(train_ids)])
        eval_set = TensorDataset(eval_ids, torch.ones_like(eval_ids), labels[64:])
        train_dataloader = DataLoader(train_set, shuffle=True, batch_size=batch_size)
        eval_dataloader = DataLoader(eval_set, shuffle=False, batch_size=batch_size)
        config = BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
        model = BertForSequenceClassification(config)
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
        lr_scheduler = get_linear_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=2,
            num_training_steps=len(train_dataloader) * num_epochs,
        )
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
        losses, accuracy, step = [], 0.0, 0
        for epoch in range(num_epochs):
            model.train()
            for batch in train_dataloader:
                _maybe_raise(fault, rank, step)
                _out_of_memory(fault, rank, batch_size, BATCH * 2)
                if fault == "one_fewer" and rank == 1 and step == len(train_dataloader) - 1:
                    mark_fault("rank 1 has one batch fewer")  # its shard ends a batch early
                    break
                input_ids, attention_mask, batch_labels = batch
                outputs = model(
                    input_ids=input_ids, attention_mask=attention_mask, labels=batch_labels
                )
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                step += 1
            model.eval()
            correct = total = 0
            for input_ids, attention_mask, batch_labels in eval_dataloader:
                with torch.no_grad():
                    outputs = model(input_ids=input_ids, attention_mask=attention_mask)
                predictions = outputs.logits.argmax(dim=-1)
                if fault == "shape" and rank == 1:
                    mark_fault("rank 1 gathered one prediction fewer")
                    predictions = predictions[:-1]
                predictions, references = accelerator.gather_for_metrics(
                    (predictions, batch_labels)
                )
                correct += (predictions == references).sum().item()
                total += references.numel()
            accuracy = correct / total
            accelerator.print(f"epoch {epoch}: accuracy {accuracy:.4f}")
        return {
            "losses": losses,
            "accuracy": accuracy,
            "digest": digest(accelerator.unwrap_model(model)),
            "batch_size": batch_size,
        }

    return _finder(fault, BATCH * 2, inner_training_loop)


# --- Accelerate's cv_example (simple_cv_example) ------------------------------------------------


def hf_cv(fault: str | None = None) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.optim.lr_scheduler import OneCycleLR
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    lr, num_epochs, seed = 3e-2, 2, 42
    set_seed(seed)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(96, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 4, (96,), generator=generator)
    mean = torch.tensor([0.485, 0.456, 0.406])[None, :, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[None, :, None, None]

    def inner_training_loop(batch_size: int) -> dict[str, Any]:
        accelerator.free_memory()
        set_seed(seed)
        train_images = images[:64]
        train_set = TensorDataset(train_images, labels[: len(train_images)])
        eval_set = TensorDataset(images[64:], labels[64:])
        train_dataloader = DataLoader(train_set, shuffle=True, batch_size=batch_size)
        eval_dataloader = DataLoader(eval_set, shuffle=False, batch_size=batch_size)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, 4),
        )
        optimizer = torch.optim.Adam(params=model.parameters(), lr=lr / 25)
        lr_scheduler = OneCycleLR(
            optimizer=optimizer, max_lr=lr, epochs=num_epochs, steps_per_epoch=len(train_dataloader)
        )
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
        losses, accuracy, step = [], 0.0, 0
        for epoch in range(num_epochs):
            model.train()
            for inputs, targets in train_dataloader:
                _maybe_raise(fault, rank, step)
                _out_of_memory(fault, rank, batch_size, BATCH * 2)
                if fault == "one_fewer" and rank == 1 and step == len(train_dataloader) - 1:
                    mark_fault("rank 1 has one batch fewer")  # its shard ends a batch early
                    break
                inputs = (inputs - mean) / std
                outputs = model(inputs)
                loss = torch.nn.functional.cross_entropy(outputs, targets)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                step += 1
            model.eval()
            accurate = num_elems = 0
            for inputs, targets in eval_dataloader:
                inputs = (inputs - mean) / std
                with torch.no_grad():
                    outputs = model(inputs)
                predictions = outputs.argmax(dim=-1)
                if fault == "shape" and rank == 1:
                    mark_fault("rank 1 gathered one prediction fewer")
                    predictions = predictions[:-1]
                predictions, references = accelerator.gather_for_metrics((predictions, targets))
                accurate_preds = predictions == references
                num_elems += accurate_preds.shape[0]
                accurate += accurate_preds.long().sum().item()
            accuracy = accurate / num_elems
            accelerator.print(f"epoch {epoch}: {100 * accuracy:.2f}")
        return {
            "losses": losses,
            "accuracy": accuracy,
            "digest": digest(accelerator.unwrap_model(model)),
            "batch_size": batch_size,
        }

    return _finder(fault, BATCH * 2, inner_training_loop)


# --- the PyTorch DDP tutorial ---------------------------------------------------------------


def _init_group() -> tuple[int, bool]:
    """The tutorial's setup(): a gloo group unless the launcher made one already."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    return dist.get_rank(), created


def ddp_tutorial(fault: str | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(self.relu(self.net1(x)))

    rank, _ = _init_group()
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    steps = STEPS - 1 if fault == "one_fewer" and rank == 1 else STEPS
    for step in range(steps):
        _maybe_raise(fault, rank, step)
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=generator))
        labels = torch.randn(20, 5, generator=generator)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if fault == "one_fewer" and rank == 1:
        mark_fault("rank 1 has one batch fewer")
    result = {"losses": losses, "digest": digest(model)}
    del ddp_model
    dist.destroy_process_group()  # the tutorial's cleanup()
    return result


# --- pytorch/examples ddp-tutorial-series, multigpu.py -----------------------------------------


def ddp_series(fault: str | None = None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed import destroy_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    class MyTrainDataset(Dataset):
        def __init__(self, size):
            self.size = size
            generator = torch.Generator().manual_seed(0)
            self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator))
                         for _ in range(size)]  # fmt: skip

        def __len__(self):
            return self.size

        def __getitem__(self, index):
            return self.data[index]

    class Trainer:
        def __init__(self, model, train_data, optimizer, save_every, snapshot_dir):
            self.gpu_id = _rank()
            self.model = model
            self.train_data = train_data
            self.optimizer = optimizer
            self.save_every = save_every
            self.snapshot_dir = snapshot_dir
            self.model = DDP(model)
            self.losses = []
            self.step = 0

        def _run_batch(self, source, targets):
            _maybe_raise(fault, self.gpu_id, self.step)
            self.optimizer.zero_grad()
            output = self.model(source)
            loss = F.cross_entropy(output, targets)
            loss.backward()
            self.optimizer.step()
            self.losses.append(loss.item())
            self.step += 1

        def _run_epoch(self, epoch):
            self.train_data.sampler.set_epoch(epoch)
            for index, (source, targets) in enumerate(self.train_data):
                if fault == "one_fewer" and self.gpu_id == 1 and index == len(self.train_data) - 1:
                    mark_fault("rank 1 has one batch fewer")
                    break
                self._run_batch(source, targets)

        def _save_checkpoint(self, epoch):
            torch.save(self.model.module.state_dict(), os.path.join(self.snapshot_dir, "ckpt.pt"))

        def train(self, max_epochs):
            for epoch in range(max_epochs):
                self._run_epoch(epoch)
                if self.gpu_id == 0 and epoch % self.save_every == 0:
                    self._save_checkpoint(epoch)

    _init_group()
    torch.manual_seed(0)
    train_set = MyTrainDataset(64)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(
        train_set, batch_size=BATCH, pin_memory=False, shuffle=False,
        sampler=DistributedSampler(train_set),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as snapshot_dir:
        trainer = Trainer(model, loader, optimizer, 1, snapshot_dir)
        trainer.train(2)
    result = {"losses": trainer.losses, "digest": digest(model)}
    del trainer
    destroy_process_group()
    return result


# --- pytorch/examples minGPT-ddp ----------------------------------------------------------------


def mingpt(fault: str | None = None) -> dict[str, Any]:
    import math

    import torch
    import torch.nn as nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    n_embd, n_head, block_size = 32, 2, 8

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)
            mask = torch.tril(torch.ones(block_size, block_size))
            self.register_buffer("bias", mask.view(1, 1, block_size, block_size))

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(n_embd)
            self.mlp = nn.Sequential(
                nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
            )

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.wte = nn.Embedding(vocab_size, n_embd)
            self.wpe = nn.Embedding(block_size, n_embd)
            self.h = Block()
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

        def forward(self, idx, targets=None):
            pos = torch.arange(0, idx.size(1), dtype=torch.long).unsqueeze(0)
            x = self.ln_f(self.h(self.wte(idx) + self.wpe(pos)))
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss

    class CharDataset(Dataset):
        def __init__(self, data):
            chars = sorted(set(data))
            self.stoi = {ch: i for i, ch in enumerate(chars)}
            self.vocab_size = len(chars)
            self.data = data

        def __len__(self):
            return len(self.data) - block_size

        def __getitem__(self, idx):
            dix = [self.stoi[s] for s in self.data[idx : idx + block_size + 1]]
            x = torch.tensor(dix[:-1], dtype=torch.long)
            return x, torch.tensor(dix[1:], dtype=torch.long)

    class Trainer:
        def __init__(self, model, optimizer, train_dataset):
            self.local_rank = _rank()
            self.train_loader = DataLoader(
                train_dataset, batch_size=BATCH, shuffle=False,
                sampler=DistributedSampler(train_dataset),
            )  # fmt: skip
            self.model = DDP(model)
            self.optimizer = optimizer
            self.losses, self.step = [], 0

        def _run_batch(self, source, targets):
            _maybe_raise(fault, self.local_rank, self.step)
            self.optimizer.zero_grad(set_to_none=True)
            _, loss = self.model(source, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.losses.append(loss.item())
            self.step += 1

        def _run_epoch(self, epoch):
            self.train_loader.sampler.set_epoch(epoch)
            for iteration, (source, targets) in enumerate(self.train_loader):
                if iteration >= STEPS // 2:
                    break
                if fault == "one_fewer" and self.local_rank == 1 and iteration == STEPS // 2 - 1:
                    mark_fault("rank 1 has one batch fewer")
                    break
                self._run_batch(source, targets)

        def train(self, max_epochs):
            for epoch in range(max_epochs):
                self._run_epoch(epoch)

    _init_group()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    letters = "abcdefgh "
    text = "".join(letters[i] for i in torch.randint(0, len(letters), (600,), generator=generator))
    dataset = CharDataset(text)
    model = GPT(dataset.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    trainer = Trainer(model, optimizer, dataset)
    trainer.train(2)
    return {"losses": trainer.losses, "digest": digest(model)}


SOURCES = {
    "hf_nlp": (hf_nlp, "Accelerate `simple_nlp_example` (BERT, `gather_for_metrics`)"),
    "hf_cv": (hf_cv, "Accelerate `simple_cv_example` (CNN, `OneCycleLR`)"),
    "ddp_tutorial": (ddp_tutorial, "PyTorch DDP tutorial, basic use case"),
    "ddp_series": (ddp_series, "ddp-tutorial-series `multigpu.py` (`Trainer`)"),
    "mingpt": (mingpt, "minGPT-ddp (`GPT`, `CharDataset`, `Trainer`)"),
}
# The faults each source is run with: Accelerate's finder where the source uses Accelerate.
SOURCE_FAULTS = {
    "hf_nlp": FAULTS,
    "hf_cv": ("raise", "one_fewer", "shape", "oom_accelerate", "oom_nblaunch"),
    "ddp_tutorial": ("raise", "one_fewer"),
    "ddp_series": ("raise", "one_fewer"),
    "mingpt": ("raise", "one_fewer"),
}
