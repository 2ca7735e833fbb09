"""Cost of debug mode on a training step: nblaunch's verification against Accelerate's.

Run: ``.venv/bin/python benchmarks/bench_debug.py``. Prints one markdown table.

The step: a small MLP wrapped in DistributedDataParallel, synthetic data, SGD, 2 CPU ranks with
gloo, plus the two collectives a training loop typically makes itself (gather the loss for
logging, sum the number of correct predictions). DDP's own gradient all-reduce runs in C++ and
is not verified by either library; the two explicit collectives are.

- nblaunch: ``nblaunch.gather`` and ``nblaunch.all_reduce``, ``debug=False`` / ``debug=True``.
- Accelerate 1.x: ``Accelerator().prepare(...)``, ``accelerator.gather`` and
  ``accelerator.reduce``, with and without ``ACCELERATE_DEBUG_MODE=1`` (its ``verify_operation``
  gathers every rank's shapes with ``gather_object`` before each call).

All four run inside nblaunch launches (Accelerate reads the torchrun variables every rank gets),
so only the step differs. Each configuration is timed ``ROUNDS`` times, interleaved, over
``STEPS`` steps after ``WARMUP`` steps; a step's time is the slowest rank's mean, and the table
shows the median over rounds.
"""

from __future__ import annotations

import statistics
import sys

import nblaunch

ROUNDS = 3
WARMUP = 20
STEPS = 200
BATCH = 64
WIDTH = 256


def train_step_timing(library: str, steps: int, warmup: int) -> float:
    """Mean seconds per step on this rank (runs inside a rank)."""
    import os
    import time

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(BATCH, WIDTH)
    targets = torch.randint(0, 10, (BATCH,))
    loss_fn = nn.CrossEntropyLoss()

    if library == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)

        def step() -> None:
            optimizer.zero_grad()
            logits = model(inputs)
            loss = loss_fn(logits, targets)
            accelerator.backward(loss)
            optimizer.step()
            accelerator.gather(loss.detach())
            accelerator.reduce((logits.argmax(1) == targets).sum(), "sum")

        assert accelerator.state.debug == (os.environ.get("ACCELERATE_DEBUG_MODE") == "1")
    else:
        model = nn.parallel.DistributedDataParallel(model)

        def step() -> None:
            optimizer.zero_grad()
            logits = model(inputs)
            loss = loss_fn(logits, targets)
            loss.backward()
            optimizer.step()
            nblaunch.gather(loss.detach())
            nblaunch.all_reduce((logits.argmax(1) == targets).sum(), "sum")

    for _ in range(warmup):
        step()
    nblaunch.wait_for_everyone()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


def run(library: str, debug: bool) -> float:
    """Seconds per step of the slowest rank for one configuration."""

    def body() -> float:
        import os

        if library == "accelerate" and debug:
            os.environ["ACCELERATE_DEBUG_MODE"] = "1"
        return train_step_timing(library, STEPS, WARMUP)

    per_rank = nblaunch.notebook_launcher(
        body,
        num_processes=2,
        device_type="cpu",
        debug=debug and library == "nblaunch",
        display="none",
    )
    return max(per_rank)


def main() -> None:
    import accelerate
    import torch

    configs = [
        ("nblaunch", False, "nblaunch, debug off"),
        ("nblaunch", True, "nblaunch, debug=True"),
        ("accelerate", False, f"Accelerate {accelerate.__version__}, debug off"),
        ("accelerate", True, f"Accelerate {accelerate.__version__}, ACCELERATE_DEBUG_MODE=1"),
    ]
    run("nblaunch", False)  # start the forkserver outside the measurements
    times: dict[tuple[str, bool], list[float]] = {(lib, dbg): [] for lib, dbg, _ in configs}
    for _ in range(ROUNDS):
        for library, debug, _ in configs:
            times[(library, debug)].append(run(library, debug))
    median = {key: statistics.median(values) for key, values in times.items()}

    print(
        f"Debug-mode cost on a DDP training step: MLP {WIDTH}-{WIDTH}-{WIDTH}-10, batch {BATCH}, "
        f"2 CPU ranks, gloo, torch {torch.__version__}; each step also gathers the loss and "
        f"sums the correct predictions (2 verified collectives). Median of {ROUNDS} rounds of "
        f"{STEPS} steps, slowest rank.\n"
    )
    print("| configuration | ms / step | vs. its debug off | extra ms per verified call |")
    print("|---|---:|---:|---:|")
    for library, debug, label in configs:
        ms = median[(library, debug)] * 1e3
        base = median[(library, False)] * 1e3
        ratio = f"{ms / base:.2f}x"
        extra = f"{(ms - base) / 2:.3f}" if debug else "-"
        print(f"| {label} | {ms:.3f} | {ratio} | {extra} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
