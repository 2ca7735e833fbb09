"""Cost of checking collectives on a training step: nblaunch's checks against Accelerate's.

Run: ``.venv/bin/python benchmarks/bench_debug.py [rounds]`` (default 5). Prints one markdown
table.

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
shows the median over rounds, and for the ratios against checks off (each round's against the
same round's) their range too: on a shared machine single rounds swing by tens of percent.
"""

from __future__ import annotations

import resource
import statistics
import sys

import nblaunch

ROUNDS = 5
WARMUP = 20
STEPS = 200
BATCH = 64
WIDTH = 256


def train_step_timing(library: str, steps: int, warmup: int) -> tuple[float, float]:
    """Mean seconds per step on this rank, wall-clock and CPU (every thread of the rank's
    process: gloo's too). Runs inside a rank."""
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
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


# What each mode passes as notebook_launcher(debug=...).
MODES = {"off": False, "default": None, "debug": True}


def run(library: str, mode: str) -> tuple[float, float, float]:
    """Seconds per step of the slowest rank, the ranks' CPU seconds per step (summed) and the
    launcher's CPU seconds for the whole launch, for one configuration.

    ``mode``: ``"off"`` (no checks), ``"default"`` (nblaunch's out-of-band checks; Accelerate
    has none), ``"debug"`` (the check before each call).
    """

    def body() -> tuple[float, float]:
        import os

        if library == "accelerate" and mode == "debug":
            os.environ["ACCELERATE_DEBUG_MODE"] = "1"
        return train_step_timing(library, STEPS, WARMUP)

    before = resource.getrusage(resource.RUSAGE_SELF)
    per_rank = nblaunch.notebook_launcher(
        body,
        num_processes=2,
        device_type="cpu",
        debug=MODES[mode] if library == "nblaunch" else False,
        display="none",
    )
    after = resource.getrusage(resource.RUSAGE_SELF)
    launcher_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return max(w for w, _ in per_rank), sum(c for _, c in per_rank), launcher_cpu


def main(rounds: int = ROUNDS) -> None:
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
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {
        (lib, mode): [] for lib, mode, _ in configs
    }
    for round_ in range(rounds):
        # Every other round in reverse: a launch's place in a round moves its step time by
        # up to 10% (two identical launches in a row measured 0.77-1.27x), so each
        # configuration takes each place equally often.
        for library, mode, _ in configs if round_ % 2 == 0 else configs[::-1]:
            results[(library, mode)].append(run(library, mode))

    print(
        f"Cost of checking collectives on a DDP training step: MLP {WIDTH}-{WIDTH}-{WIDTH}-10, "
        f"batch {BATCH}, 2 CPU ranks, gloo, torch {torch.__version__}; each step also gathers "
        "the loss and sums the correct predictions (2 checked collectives, 3 with DDP's). "
        f"Median of {rounds} rounds of {STEPS} steps; rounds interleave the configurations, "
        "every other round in reverse order. "
        "Wall: the slowest rank's step; each ratio is a round's against the same round's "
        "checks off (a busy moment of the machine hits both), median and range over rounds. "
        "CPU: both ranks' processes, per step, and the launcher's over the whole launch per "
        "step, which a busy machine inflates less.\n"
    )
    print(
        "| configuration | wall ms / step | vs. checks off, same round | ranks' CPU ms / step "
        "| CPU vs. checks off | launcher CPU ms / step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    per_launch = STEPS + WARMUP
    for library, mode, label in configs:
        rows = results[(library, mode)]
        off = results[(library, "off")]
        wall = statistics.median(w for w, _, _ in rows) * 1e3
        cpu = statistics.median(c for _, c, _ in rows) * 1e3
        launcher = statistics.median(lc for _, _, lc in rows) / per_launch * 1e3
        pairs = list(zip(rows, off, strict=True))
        walls, cpus = (
            _ratios([r[0] / o[0] for r, o in pairs]),
            _ratios([r[1] / o[1] for r, o in pairs]),
        )
        print(f"| {label} | {wall:.3f} | {walls} | {cpu:.3f} | {cpus} | {launcher:.3f} |")
    sys.stdout.flush()


def _ratios(ratios: list[float]) -> str:
    """``1.031x (0.97-1.08)``: the median and the range over rounds."""
    if len(ratios) == 1 or max(ratios) == min(ratios):
        return f"{statistics.median(ratios):.3f}x"
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS)
