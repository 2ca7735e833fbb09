"""Batch-size search under out-of-memory: nblaunch vs Accelerate, 2 CPU ranks with gloo.

The training function runs 5 steps per attempt; a step makes a batch, raises a fake CUDA
out-of-memory error above batch size 32 (on every rank, or on rank 1 only), then all-reduces its
"gradients" (the batch size), as data-parallel training does. Both tools start at 128
and halve; Accelerate is also shown with its default reduction (x0.9).

Columns: attempts each rank made (nblaunch counts the attempts of its whole search, restarts
included); restarts of all ranks; time from the launch call until every rank finished a step at
the size it ended with; the final batch size per rank; whether every all-reduce saw both ranks at
the same size; the outcome. Accelerate's ``find_executable_batch_size`` runs under its own
``notebook_launcher`` in a subprocess, stopped after ``BOUND_S``; a run still going then is
reported as a hang. nblaunch's forkserver is warmed up first, as in a notebook after one launch.

Run: ``.venv/bin/python benchmarks/bench_oom.py``
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

STEPS = 5
START = 128
THRESHOLD = 32
BOUND_S = 90.0


def nblaunch_train(mode: str, t0: float) -> dict:
    """One rank's training under nblaunch; returns what it saw."""
    import torch
    import torch.distributed as dist

    from nblaunch import find_executable_batch_size, rank

    tried: list[int] = []
    consistent = True
    first_good: dict[int, float] = {}

    @find_executable_batch_size(starting_batch_size=START)
    def train(batch_size: int) -> int:
        nonlocal consistent
        tried.append(batch_size)
        for _ in range(STEPS):
            batch = torch.ones(batch_size, 64)
            if (mode == "symmetric" or rank() == 1) and batch_size > THRESHOLD:
                raise RuntimeError(f"CUDA out of memory. Tried to allocate {batch_size} MiB")
            grad = torch.tensor([float(batch.shape[0])])
            dist.all_reduce(grad)
            consistent &= grad.item() == 2 * batch_size
            first_good.setdefault(batch_size, time.time() - t0)
        return batch_size

    final = train()
    return {"final": final, "tried": tried, "consistent": consistent, "first": first_good[final]}


ACCELERATE_SCRIPT = """
import json, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, notebook_launcher
from accelerate.utils import find_executable_batch_size

STEPS, START, THRESHOLD = {steps}, {start}, {threshold}


def run(mode, t0, out, halve):
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    tried, first_good, state = [], {{}}, {{"consistent": True}}

    size = {{"now": START}}

    def halving():  # Accelerate's reduce function takes no argument
        size["now"] //= 2
        return size["now"]

    @find_executable_batch_size(
        starting_batch_size=START, reduce_batch_size_fn=halving if halve else None
    )
    def train(batch_size):
        tried.append(batch_size)
        for _ in range(STEPS):
            batch = torch.ones(batch_size, 64)
            if (mode == "symmetric" or rank == 1) and batch_size > THRESHOLD:
                raise RuntimeError(f"CUDA out of memory. Tried to allocate {{batch_size}} MiB")
            grad = torch.tensor([float(batch.shape[0])])
            dist.all_reduce(grad)
            state["consistent"] &= grad.item() == 2 * batch_size
            first_good.setdefault(batch_size, time.time() - t0)
        return batch_size

    final = train()
    result = dict(final=final, tried=tried, consistent=state["consistent"],
                  first=first_good.get(final))
    Path(out, f"rank{{rank}}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    # The clock starts at the launch call, after torch and accelerate were imported.
    args = (sys.argv[1], time.time(), sys.argv[2], sys.argv[3] == "halve")
    notebook_launcher(run, args=args, num_processes=2)
"""


def run_accelerate(mode: str, reduce: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "acc.py")
        script.write_text(
            textwrap.dedent(ACCELERATE_SCRIPT).format(steps=STEPS, start=START, threshold=THRESHOLD)
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        process = subprocess.Popen(
            [sys.executable, str(script), mode, tmp, reduce],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own group, so a hang can be stopped as a whole
        )
        try:
            _, stderr = process.communicate(timeout=BOUND_S)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            hung = True
        elapsed = time.time() - t0
        ranks = {}
        for rank in (0, 1):
            path = Path(tmp, f"rank{rank}.json")
            if path.exists():
                ranks[rank] = json.loads(path.read_text())
    if hung:
        outcome = f"hang: stopped after {BOUND_S:g} s"
    elif process.returncode != 0:
        outcome = f"failed (exit {process.returncode}): {stderr.strip().splitlines()[-1][:80]}"
    else:
        outcome = "finished"
    return {"ranks": ranks, "outcome": outcome, "elapsed": elapsed, "restarts": 0}


def run_nblaunch(mode: str) -> dict:
    from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
    from nblaunch.engine.run.run import Run
    from nblaunch.options import LaunchOptions

    class Recorder:
        def __init__(self) -> None:
            self.progress: list[dict] = []

        def handle(self, event: dict) -> None:
            if event["kind"] == "progress" and event["what"] == "batch_size":
                self.progress.append(event)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    recorder = Recorder()
    t0 = time.time()
    plan = plan_launch(nblaunch_train, 2, LaunchOptions(device_type="cpu", hang_timeout=BOUND_S))
    try:
        values = Run(plan, recorder).execute(serialize_payload(nblaunch_train, (mode, t0)))
        outcome = "finished"
    except Exception as exc:
        values, outcome = [], f"failed: {type(exc).__name__}: {str(exc)[:60]}"
    elapsed = time.time() - t0
    ranks = dict(enumerate(values))
    ok = [e for e in recorder.progress if e["data"].get("status") == "ok"]
    restarts = sum(1 for e in recorder.progress if e["data"].get("status") == "restart")
    history = ok[-1]["data"]["history"] if ok else []
    for value in ranks.values():
        value["tried"] = [entry["batch_size"] for entry in history]
    return {"ranks": ranks, "outcome": outcome, "elapsed": elapsed, "restarts": restarts}


def row(tool: str, mode: str, result: dict) -> str:
    ranks = result["ranks"]

    def per_rank(key, fmt=str):
        return " / ".join(fmt(ranks[r][key]) if r in ranks else "-" for r in (0, 1))

    attempts = per_rank("tried", lambda t: str(len(t)))
    first = [ranks[r]["first"] for r in (0, 1) if r in ranks and ranks[r]["first"] is not None]
    first_text = f"{max(first):.2f} s" if len(first) == 2 else "-"
    finals = per_rank("final")
    consistent = "yes" if ranks and all(ranks[r]["consistent"] for r in ranks) else "no"
    if not ranks:
        consistent = "-"
    same = len({ranks[r]["final"] for r in ranks}) == 1 and len(ranks) == 2
    outcome = result["outcome"]
    if outcome == "finished" and not same:
        outcome = "finished, ranks on different sizes"
    return (
        f"| {tool} | {mode} | {attempts} | {result['restarts']} | {first_text} | {finals} | "
        f"{consistent} | {outcome} |"
    )


def main() -> None:
    import accelerate
    import torch

    from nblaunch import notebook_launcher

    notebook_launcher(lambda: None, (), 2, device_type="cpu", display="none")  # warm-up
    rows = []
    for mode in ("symmetric", "asymmetric"):
        rows.append(row("nblaunch (halve)", mode, run_nblaunch(mode)))
        for reduce in ("halve", "x0.9"):
            name = f"accelerate {accelerate.__version__} ({reduce})"
            rows.append(row(name, mode, run_accelerate(mode, reduce)))
    print(
        f"OOM batch-size search from {START}, fake OOM above {THRESHOLD} ({STEPS} steps per "
        f"attempt, all_reduce each step), 2 CPU ranks, gloo, torch {torch.__version__}, "
        f"{os.cpu_count()} cores\n"
    )
    print(
        "| tool | OOM on | attempts (rank 0 / 1) | restarts | time to first good step "
        "| final batch size (rank 0 / 1) | all-reduces consistent | outcome |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
