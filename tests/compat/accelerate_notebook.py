"""Accelerate's documented notebook example ("Launching distributed training from Jupyter
Notebooks": a ``training_loop(mixed_precision, seed, batch_size)`` run with
``notebook_launcher(training_loop, args, num_processes=2)``), shrunk to a synthetic data set
and a small model, and called with every keyword of Accelerate's ``notebook_launcher``.

``python accelerate_notebook.py accelerate|nblaunch OUT_DIR`` imports ``notebook_launcher``
from one or the other, as a notebook's first cell would; each rank writes what it computed to
``OUT_DIR/rank<N>.json`` (Accelerate's launcher returns nothing).
"""

from __future__ import annotations

import json
import os
import socket
import sys


def training_loop(mixed_precision="fp16", seed=42, batch_size=8, out_dir="."):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(seed)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    labels = (inputs.sum(dim=1) > 0).long()
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for epoch in range(2):
        model.train()
        for batch, targets in loader:
            loss = torch.nn.functional.cross_entropy(model(batch), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        accelerator.print(f"epoch {epoch}: loss {losses[-1]:.4f}")
    result = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": str(accelerator.distributed_type),
        "losses": losses,
    }
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as file:
        json.dump(result, file)
    return result


def main(which: str, out_dir: str) -> None:
    if which == "accelerate":
        from accelerate import notebook_launcher
    else:
        from nblaunch import notebook_launcher
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    args = ("bf16", 42, 8, out_dir)  # bf16: the mixed precision CPUs have
    notebook_launcher(
        training_loop,
        args,
        num_processes=2,
        mixed_precision="bf16",
        use_port=port,
        master_addr="127.0.0.1",
        node_rank=0,
        num_nodes=1,
        rdzv_backend="static",
        rdzv_endpoint="",
        rdzv_conf=None,
        rdzv_id="none",
        max_restarts=0,
        monitor_interval=0.1,
        log_line_prefix_template=None,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
