"""Launch cost and root-cause accuracy: nblaunch against bare torch.multiprocessing and Accelerate.

Run: ``.venv/bin/python benchmarks/bench_launch.py``. Every scenario runs in a fresh Python
process, so "first launch" really is the first one (forkserver not yet started, torch imported).
Prints one markdown table.

Workloads
- hello: 2 CPU ranks, init the gloo process group, one all_reduce, return.
- raise: rank 1 raises ``ValueError("boom on rank 1")`` while rank 0 waits in an all_reduce;
  we time from the call to the exception in the caller and check that the caller's error names
  rank 1's ValueError ("boom"), over 20 runs.
- train: 2 CPU ranks make a DDP model (Accelerate: ``prepare``) and AdamW and take one step;
  launches ``TRAIN_PAUSE_S`` apart, as cells are. A rank's first optimizer imports
  ``torch._dynamo`` (1 s of CPU) unless the process it was forked from has it.
- big parent: the same hello world with the parent holding a 4 GB tensor, as a notebook kernel
  often does: fork must copy the parent's page tables, a forkserver does not.
- first launch in a kernel: a real Jupyter kernel runs the import cell (``import torch,
  nblaunch`` and the function; or ``import nblaunch`` alone, as the quick start does), then,
  ``KERNEL_PAUSE_S`` later (the user moving to the next cell), the launch cell twice; for
  nblaunch with its forkserver started in the background at import (the default) and without
  (``NBLAUNCH_PRESTART=0``), and for Accelerate.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = 5
RAISE_RUNS = 20
BIG_PARENT_GB = 4
KERNEL_PAUSE_S = 2.0
KERNEL_RUNS = 3  # fresh kernels per launcher
TRAIN_PAUSE_S = 1.0

HELLO_CELL = """
import torch, nblaunch
def hello():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
"""
# The quick start's import cell imports nblaunch alone: torch is imported by the ranks.
NBLAUNCH_ONLY_CELL = HELLO_CELL.replace("import torch, nblaunch", "import nblaunch")
ACCELERATE_CELL = """
import contextlib, io, socket, torch
from accelerate import notebook_launcher
def hello():
    import torch
    from accelerate import Accelerator
    return Accelerator(cpu=True).reduce(torch.ones(1)).item()
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
"""
KERNEL_LAUNCHERS = {
    "nblaunch (forkserver started at import, the default)": (
        {"NBLAUNCH_PRESTART": "1"},
        HELLO_CELL,
        "nblaunch.notebook_launcher(hello, (), 2, device_type='cpu', display='none')",
    ),
    "nblaunch, the import cell imports only nblaunch": (
        {"NBLAUNCH_PRESTART": "1"},
        NBLAUNCH_ONLY_CELL,
        "nblaunch.notebook_launcher(hello, (), 2, device_type='cpu', display='none')",
    ),
    "nblaunch, NBLAUNCH_PRESTART=0": (
        {"NBLAUNCH_PRESTART": "0"},
        HELLO_CELL,
        "nblaunch.notebook_launcher(hello, (), 2, device_type='cpu', display='none')",
    ),
    "Accelerate notebook_launcher": (
        {"ACCELERATE_USE_CPU": "1"},
        ACCELERATE_CELL,
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    notebook_launcher(hello, (), num_processes=2, use_port=port())",
    ),
}

SCENARIO_CODE = r"""
import json, os, socket, sys, time

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def hello(*_):
    import torch, torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        own_group = True
    else:
        own_group = False
    t = torch.ones(1)
    dist.all_reduce(t)
    if own_group:
        dist.destroy_process_group()
    return t.item()

def bare_rank(index, start_method_port):
    os.environ.update(RANK=str(index), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(start_method_port))
    hello()

def accelerate_hello():
    import torch
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    accelerator.reduce(torch.ones(1))

def raise_on_rank_1():
    import torch, torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))

def accelerate_raise():
    import torch
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    if accelerator.process_index == 1:
        raise ValueError("boom on rank 1")
    accelerator.reduce(torch.ones(1))

def ddp_train():
    import torch
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()

def accelerate_train():
    import torch
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 8)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    accelerator.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()

def quiet(fn):
    # keep the launchers' own output out of the table
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    os.dup2(devnull, 1); os.dup2(devnull, 2)
    try:
        return fn()
    finally:
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)

if __name__ == "__main__":  # spawned children import this file again
    scenario, repeats = sys.argv[1], int(sys.argv[2])
    import torch  # a notebook has torch imported before it launches
    times = []
    if scenario.startswith("big-"):
        ballast = torch.ones(int(float(os.environ["BIG_PARENT_GB"]) * 2**30 // 4))
        scenario = scenario[4:]

    if scenario.startswith("nblaunch-"):
        from nblaunch import notebook_launcher
        method = scenario.split("-", 1)[1]
        for _ in range(repeats):
            t0 = time.perf_counter()
            notebook_launcher(hello, (), 2, start_method=method, device_type="cpu", display="none")
            times.append(time.perf_counter() - t0)
    elif scenario.startswith("bare-"):
        import torch.multiprocessing as mp
        method = scenario.split("-", 1)[1]
        for _ in range(repeats):
            t0 = time.perf_counter()
            mp.start_processes(bare_rank, args=(free_port(),), nprocs=2, start_method=method)
            times.append(time.perf_counter() - t0)
    elif scenario == "accelerate":
        from accelerate import notebook_launcher as accelerate_launcher
        for _ in range(repeats):
            t0 = time.perf_counter()
            quiet(lambda: accelerate_launcher(accelerate_hello, (), num_processes=2,
                                              use_port=str(free_port())))
            times.append(time.perf_counter() - t0)
    elif scenario in ("train-nblaunch", "train-accelerate"):
        for i in range(repeats):
            if i:
                time.sleep(float(os.environ["TRAIN_PAUSE_S"]))
            t0 = time.perf_counter()
            if scenario == "train-nblaunch":
                from nblaunch import notebook_launcher
                notebook_launcher(ddp_train, (), 2, device_type="cpu", display="none")
            else:
                from accelerate import notebook_launcher as accelerate_launcher
                quiet(lambda: accelerate_launcher(accelerate_train, (), num_processes=2,
                                                  use_port=str(free_port())))
            times.append(time.perf_counter() - t0)
    elif scenario in ("raise-nblaunch", "raise-accelerate"):
        right = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                if scenario == "raise-nblaunch":
                    from nblaunch import notebook_launcher
                    notebook_launcher(raise_on_rank_1, (), 2, device_type="cpu", display="none")
                else:
                    from accelerate import notebook_launcher as accelerate_launcher
                    quiet(lambda: accelerate_launcher(accelerate_raise, (), num_processes=2,
                                                      use_port=str(free_port())))
            except BaseException as exc:  # noqa: BLE001 - whatever the launcher raises
                times.append(time.perf_counter() - t0)
                right += isinstance(exc, ValueError) and "boom" in str(exc)
        print(json.dumps({"times": times, "right": right}))
        sys.exit(0)
    print(json.dumps({"times": times}))
"""


def run_scenario(name: str, repeats: int, timeout: float = 600) -> dict:
    env = {**os.environ, "BIG_PARENT_GB": str(BIG_PARENT_GB), "TRAIN_PAUSE_S": str(TRAIN_PAUSE_S)}
    script = Path(tempfile.gettempdir()) / "nblaunch_bench_launch_scenario.py"
    script.write_text(SCENARIO_CODE)
    done = subprocess.run(
        [sys.executable, str(script), name, str(repeats)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    return json.loads(lines[-1])


def kernel_first_launch(env: dict[str, str], setup: str, launch: str) -> tuple[float, float]:
    """In a fresh kernel: the import cell, a pause, then the launch cell twice (seconds)."""
    from bench_pool import Kernel  # this folder is on sys.path when run as a script

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory() as directory:
            kernel = Kernel(directory)
            try:
                _, error, text = kernel.run(setup)
                if error:
                    raise RuntimeError(f"{error}: {text[-300:]}")
                time.sleep(KERNEL_PAUSE_S)
                times = []
                for _ in range(2):
                    seconds, error, text = kernel.run(launch)
                    if error:
                        raise RuntimeError(f"{error}: {text[-300:]}")
                    times.append(seconds)
                return times[0], times[1]
            finally:
                kernel.close()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fmt(seconds: float) -> str:
    return f"{seconds:.3f}"


def main() -> None:
    rows: list[tuple[str, str, str, str]] = []

    def hello_row(label: str, scenario: str) -> None:
        result = run_scenario(scenario, REPEATS)
        if "error" in result:
            rows.append((label, "error", "error", result["error"]))
            return
        first, *warm = result["times"]
        rows.append((label, fmt(first), fmt(statistics.median(warm)), f"{len(warm)} warm runs"))

    hello_row("nblaunch forkserver (default)", "nblaunch-forkserver")
    hello_row("nblaunch spawn", "nblaunch-spawn")
    hello_row("nblaunch fork", "nblaunch-fork")
    hello_row("bare torch.multiprocessing fork", "bare-fork")
    hello_row("bare torch.multiprocessing spawn", "bare-spawn")
    hello_row("Accelerate notebook_launcher", "accelerate")
    hello_row(f"nblaunch forkserver, parent holds {BIG_PARENT_GB} GB", "big-nblaunch-forkserver")
    hello_row(f"nblaunch fork, parent holds {BIG_PARENT_GB} GB", "big-nblaunch-fork")
    hello_row(f"bare fork, parent holds {BIG_PARENT_GB} GB", "big-bare-fork")

    print("## 2-rank hello world (init process group, one all_reduce), CPU/gloo\n")
    print("| launcher | first launch (s) | warm launch, median (s) | note |")
    print("|---|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")

    print(
        f"\n## A training launch: 2 CPU ranks, DDP (Accelerate: prepare), AdamW, one step; "
        f"launches {TRAIN_PAUSE_S:g} s apart\n"
    )
    print("| launcher | first launch (s) | second launch (s) | later launches, median (s) |")
    print("|---|---:|---:|---:|")
    for label, scenario in (
        ("nblaunch forkserver (default)", "train-nblaunch"),
        ("Accelerate notebook_launcher", "train-accelerate"),
    ):
        result = run_scenario(scenario, REPEATS + 1)
        if "error" in result:
            print(f"| {label} | error | {result['error']} | |")
            continue
        first, second, *later = result["times"]
        print(f"| {label} | {fmt(first)} | {fmt(second)} | {fmt(statistics.median(later))} |")

    print(f"\n## rank 1 raises ValueError('boom on rank 1'), {RAISE_RUNS} runs\n")
    print("| launcher | median time to the exception (s) | root cause right |")
    print("|---|---:|---:|")
    for label, scenario in (
        ("nblaunch", "raise-nblaunch"),
        ("Accelerate notebook_launcher", "raise-accelerate"),
    ):
        result = run_scenario(scenario, RAISE_RUNS)
        if "error" in result:
            print(f"| {label} | error | {result['error']} |")
            continue
        median = statistics.median(result["times"]) if result["times"] else float("nan")
        print(f"| {label} | {fmt(median)} | {result['right']}/{RAISE_RUNS} |")

    print(
        f"\n## In a real kernel: the launch cell {KERNEL_PAUSE_S:g} s after the import cell, "
        f"2-rank hello world, median of {KERNEL_RUNS} fresh kernels\n"
    )
    print("| launcher | first launch (s) | second launch (s) |")
    print("|---|---:|---:|")
    for label, (env, setup, launch) in KERNEL_LAUNCHERS.items():
        try:
            runs = [kernel_first_launch(env, setup, launch) for _ in range(KERNEL_RUNS)]
        except Exception as exc:  # a launcher that fails is a row, not a crash
            print(f"| {label} | error | {type(exc).__name__}: {str(exc)[:80]} |")
            continue
        first = statistics.median(r[0] for r in runs)
        second = statistics.median(r[1] for r in runs)
        print(f"| {label} | {fmt(first)} | {fmt(second)} |")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
