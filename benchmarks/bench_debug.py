"""Cost of checking collectives on a training step: nblaunch's checks against Accelerate's.

Run: ``.venv/bin/python benchmarks/bench_debug.py``. Prints one markdown table.

The step: a small MLP wrapped in DistributedDataParallel, synthetic data, SGD, 2 CPU ranks with
gloo, plus the two collectives a training loop typically makes itself (gather the loss for
logging, sum the number of correct predictions). Accelerate checks the two explicit
collectives; nblaunch checks those and DDP's gradient all-reduce (a comm hook).

- nblaunch: ``nblaunch.gather`` and ``nblaunch.all_reduce``, with ``debug=False`` (no checks),
  the default (out-of-band checks: each rank sends its calls to the launcher, which compares
  them) and ``debug=True`` (one extra all_gather before each call).
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

ROUNDS = 5
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


# What each mode passes as notebook_launcher(debug=...).
MODES = {"off": False, "default": None, "debug": True}


def run(library: str, mode: str) -> float:
    """Seconds per step of the slowest rank for one configuration.

    ``mode``: ``"off"`` (no checks), ``"default"`` (nblaunch's out-of-band checks; Accelerate
    has none), ``"debug"`` (the check before each call).
    """

    def body() -> float:
        import os

        if library == "accelerate" and mode == "debug":
            os.environ["ACCELERATE_DEBUG_MODE"] = "1"
        return train_step_timing(library, STEPS, WARMUP)

    per_rank = nblaunch.notebook_launcher(
        body,
        num_processes=2,
        device_type="cpu",
        debug=MODES[mode] if library == "nblaunch" else False,
        display="none",
    )
    return max(per_rank)


def main() -> None:
    import accelerate
    import torch

    configs = [
        ("nblaunch", "off", "nblaunch, debug=False (no checks)"),
        ("nblaunch", "default", "nblaunch, default (out-of-band checks)"),
        ("nblaunch", "debug", "nblaunch, debug=True"),
        ("accelerate", "off", f"Accelerate {accelerate.__version__}, debug off"),
        ("accelerate", "debug", f"Accelerate {accelerate.__version__}, ACCELERATE_DEBUG_MODE=1"),
    ]
    run("nblaunch", "off")  # start the forkserver outside the measurements
    times: dict[tuple[str, str], list[float]] = {(lib, mode): [] for lib, mode, _ in configs}
    for _ in range(ROUNDS):
        for library, mode, _ in configs:
            times[(library, mode)].append(run(library, mode))
    median = {key: statistics.median(values) for key, values in times.items()}

    print(
        f"Cost of checking collectives on a DDP training step: MLP {WIDTH}-{WIDTH}-{WIDTH}-10, "
        f"batch {BATCH}, 2 CPU ranks, gloo, torch {torch.__version__}; each step also gathers "
        "the loss and sums the correct predictions (2 checked collectives, 3 with DDP's). "
        f"Median of {ROUNDS} rounds of {STEPS} steps, slowest rank. The ratio is the median "
        "over rounds of each round's time against the same round's checks-off time (rounds "
        "interleave the configurations, so a busy moment of the machine hits both).\n"
    )
    print("| configuration | ms / step | vs. its checks off, same round |")
    print("|---|---:|---:|")
    for library, mode, label in configs:
        ms = median[(library, mode)] * 1e3
        rounds = zip(times[(library, mode)], times[(library, "off")], strict=True)
        ratios = [t / off for t, off in rounds]
        print(f"| {label} | {ms:.3f} | {statistics.median(ratios):.3f}x |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
