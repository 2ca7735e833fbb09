"""Cost of checking collectives on a training step: nblaunch's checks against Accelerate's.

Run: ``.venv/bin/python benchmarks/bench_debug.py [rounds]`` (default 5). Prints one markdown
table.

The step: a small MLP wrapped in DistributedDataParallel, synthetic data, SGD, 2 CPU ranks with
gloo, plus the two collectives a training loop typically makes itself (gather the loss for
logging, sum the number of correct predictions). Accelerate checks the two explicit
collectives; nblaunch checks those and DDP's gradient all-reduce (read from torch's flight
recorder by a thread of each rank; DDP keeps its own C++ all-reduce).

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

Two launches of the same code differ by up to ±20% on this machine (measured: the same
``debug=False`` step's CPU), which hides a cost of a few percent. So each round also runs one
launch in which the same ranks alternate blocks of ``BLOCK`` steps checked and unchecked
(``alternating_blocks``; A B B A ...): the second table is their ratio, per round. A second
launch per round runs the same blocks with both kinds unchecked (the control): how far two
kinds of the same code drift apart in one launch on this machine, the least cost the first
launch can tell from nothing.
"""

from __future__ import annotations

import resource
import statistics
import sys
from typing import Any

import nblaunch

ROUNDS = 5
WARMUP = 20
STEPS = 200
BATCH = 64
WIDTH = 256
BLOCK = 25  # steps per block in the alternating launch
BLOCKS = 16  # blocks of each kind per launch


def mlp(width: int = WIDTH, layers: int = 3) -> Any:
    """The step's model, the same weights every time (``layers`` linear layers, on the rank's
    device)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    parts: list[Any] = []
    for _ in range(layers - 1):
        parts += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*parts, nn.Linear(width, 10)).to(nblaunch.device())


def ddp_step(model: Any, optimizer: Any, inputs: Any, targets: Any, loss_fn: Any) -> None:
    """One step of a DDP model, with the two collectives a training loop makes itself."""
    optimizer.zero_grad()
    logits = model(inputs)
    loss = loss_fn(logits, targets)
    loss.backward()
    optimizer.step()
    nblaunch.gather(loss.detach())
    nblaunch.all_reduce((logits.argmax(1) == targets).sum(), "sum")


def train_step_timing(library: str, steps: int, warmup: int) -> tuple[float, float]:
    """Mean seconds per step on this rank, wall-clock and CPU (every thread of the rank's
    process: gloo's too). Runs inside a rank."""
    import os
    import time

    import torch
    from torch import nn

    model = mlp()
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
            ddp_step(model, optimizer, inputs, targets, loss_fn)

    for _ in range(warmup):
        step()
    nblaunch.wait_for_everyone()
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def alternating_blocks(
    blocks: int, block: int, width: int = WIDTH, layers: int = 3, control: bool = False
) -> dict[str, list[tuple[float, float]]]:
    """In a rank of a launch with the default checks: the step of ``train_step_timing``,
    timed in blocks of ``block`` steps that alternate between checked and unchecked (A B B A:
    each kind as often first), ``blocks`` of each. Unchecked is what ``debug=False`` runs:
    torch's own functions, nothing sent, and a DDP model made without the checks' comm hook
    (same weights). Returns each block's wall, CPU (the process's) and the task thread's CPU
    seconds per step, by kind; and under ``"reads"`` the flight recorder's reads in the checked
    blocks (how many, their seconds) and its thread's CPU seconds per checked step.
    ``control``: the "checked" blocks and models are unchecked too."""
    import contextlib
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nblaunch.ranks.checks import fingerprints, recorder

    outbox = fingerprints.current()
    assert outbox is not None, "the checks are off in this launch"
    reader = recorder.current()  # the flight recorder's reader: paused in unchecked blocks
    # The checks' wrappers of torch.distributed's functions and of DDP's constructor.
    wrapped = {
        name: value
        for name in dir(dist)
        if hasattr(value := getattr(dist, name), "__nblaunch_original__")
    }
    patched_init = DDP.__init__

    @contextlib.contextmanager
    def unchecked():
        fingerprints._outbox = None
        for name, function in wrapped.items():
            setattr(dist, name, function.__nblaunch_original__)
        DDP.__init__ = getattr(patched_init, "__nblaunch_original__", patched_init)
        if reader is not None:
            reader.pause()
        try:
            yield
        finally:
            fingerprints._outbox = outbox
            for name, function in wrapped.items():
                setattr(dist, name, function)
            DDP.__init__ = patched_init
            if reader is not None:
                reader.resume()  # its catching up is paid in the checked block

    def checks(kind: str) -> Any:
        """A block's (or a model's) checks: none in the control's blocks of either kind."""
        return contextlib.nullcontext() if kind == "checked" and not control else unchecked()

    device = nblaunch.device()
    inputs = torch.randn(BATCH, width, device=device)
    targets = torch.randint(0, 10, (BATCH,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    # Two models of each kind, made C U U C and used in turn: where a model's tensors land in
    # memory moves its step by a few percent, and that must not pass for the checks' cost.
    models: dict[str, list[Any]] = {"checked": [], "unchecked": []}
    for kind in ("checked", "unchecked", "unchecked", "checked"):
        with checks(kind):
            model = DDP(mlp(width, layers))
        models[kind].append((model, torch.optim.SGD(model.parameters(), lr=0.01)))

    def steps(kind: str, n: int, block: int) -> None:
        model, optimizer = models[kind][block % 2]
        for _ in range(n):
            ddp_step(model, optimizer, inputs, targets, loss_fn)

    times: dict[str, list[tuple[float, ...]]] = {"checked": [], "unchecked": []}
    # The reader thread's own CPU clock: what it costs, apart from the noise of the process's
    # other threads (gloo's) and of the machine.
    reader_clock = (
        time.pthread_getcpuclockid(reader._thread.ident)
        if reader is not None and reader._thread.ident is not None
        else None
    )
    reader_cpu = 0.0
    for i in range(2 * blocks + 4):  # the first four warm up each model
        kind = "checked" if i % 4 in (0, 3) else "unchecked"
        with checks(kind):
            dist.barrier()
            synchronize()
            started, cpu, task = time.perf_counter(), time.process_time(), time.thread_time()
            before = time.clock_gettime(reader_clock) if reader_clock is not None else 0.0
            steps(kind, block, i // 2)
            synchronize()
            elapsed = (
                (time.perf_counter() - started) / block,
                (time.process_time() - cpu) / block,
                (time.thread_time() - task) / block,
            )
            if i >= 4 and kind == "checked" and reader_clock is not None:
                reader_cpu += time.clock_gettime(reader_clock) - before
        if i >= 4:
            times[kind].append(elapsed)
    if reader is not None:  # the recorder's reads: how many, their cost, its thread's CPU
        times["reads"] = [(reader.reads, reader.read_s, reader_cpu / (blocks * block))]
    return times


def run_alternating(control: bool = False) -> tuple[float, float, float, float, float]:
    """One launch of ``alternating_blocks``: checked over unchecked, the slowest rank's median
    block (wall), and both ranks' median blocks summed (CPU); the flight recorder's reads,
    mean ms per read and ms per checked step (both ranks' mean; 0 where it did not read); and
    the checks' own threads: the task thread's CPU plus the reader thread's, checked, over the
    task thread's unchecked (both ranks summed). ``control``: both kinds unchecked."""
    per_rank = nblaunch.notebook_launcher(
        alternating_blocks,
        (BLOCKS, BLOCK, WIDTH, 3, control),
        num_processes=2,
        device_type="cpu",
        display="none",
    )

    def median(kind: str, column: int) -> list[float]:
        return [statistics.median(b[column] for b in rank[kind]) for rank in per_rank]

    wall = max(median("checked", 0)) / max(median("unchecked", 0))
    cpu = sum(median("checked", 1)) / sum(median("unchecked", 1))
    reads = [rank["reads"][0] for rank in per_rank if rank.get("reads")]
    timed = [r[1] / r[0] for r in reads if r[0]]  # none in a control: it never reads
    per_read = statistics.mean(timed) * 1e3 if timed else 0.0
    per_step = statistics.mean(r[1] for r in reads) / ((BLOCKS + 2) * BLOCK) * 1e3 if reads else 0.0
    reader = sum(r[2] for r in reads)
    threads = (sum(median("checked", 2)) + reader) / sum(median("unchecked", 2))
    return wall, cpu, per_read, per_step, threads


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
    alternating, controls = [], []
    for round_ in range(rounds):
        # Every other round in reverse: a launch's place in a round moves its step time by
        # up to 10% (two identical launches in a row measured 0.77-1.27x), so each
        # configuration takes each place equally often.
        for library, mode, _ in configs if round_ % 2 == 0 else configs[::-1]:
            results[(library, mode)].append(run(library, mode))
        for control in (False, True) if round_ % 2 == 0 else (True, False):
            (controls if control else alternating).append(run_alternating(control))

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
    print(
        f"\nThe same ranks in one launch, {BLOCKS} blocks of {BLOCK} steps checked and "
        f"{BLOCKS} unchecked, alternating (checked: the default checks; unchecked: as "
        "debug=False). Ratio of the median blocks, median and range over rounds. Threads: "
        "the task thread's CPU plus the recorder reader's, checked, over the task thread's "
        "unchecked (each thread's own clock: gloo's threads and the machine's noise left out; "
        "the launcher's comparing is not in it). The control: a launch of the same blocks "
        "with both kinds unchecked, the drift between two kinds of the same code.\n"
    )
    print(
        "| one launch per round | wall, checked vs. unchecked | CPU, checked vs. unchecked "
        "| threads, checked vs. unchecked | recorder: ms per read | recorder: ms per checked step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, launches in (("nblaunch, default checks", alternating), ("control", controls)):
        walls, cpus = _ratios([a[0] for a in launches]), _ratios([a[1] for a in launches])
        threads = _ratios([a[4] for a in launches])
        per_read = statistics.median(a[2] for a in launches)
        per_step = statistics.median(a[3] for a in launches)
        print(f"| {label} | {walls} | {cpus} | {threads} | {per_read:.3f} | {per_step:.4f} |")
    sys.stdout.flush()


def _ratios(ratios: list[float]) -> str:
    """``1.031x (0.97-1.08)``: the median and the range over rounds."""
    if len(ratios) == 1 or max(ratios) == min(ratios):
        return f"{statistics.median(ratios):.3f}x"
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS)
