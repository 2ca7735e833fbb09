"""Hang diagnosis: time from a divergence to an error in the caller, and what heartbeats cost.

Run: ``.venv/bin/python benchmarks/bench_hang.py [--accelerate-wait SECONDS]``. Prints one
markdown table.

Workloads
- early stop: 2 CPU ranks (gloo) all_reduce a loss every step; rank 1 leaves the loop at step 3
  (the guide's early-stopping divergence) and writes the time it did so to a file. We time from
  that moment to the exception in the caller. nblaunch runs with its default ``hang_timeout``
  (300 s); Accelerate's ``notebook_launcher`` runs the same loop (with ``Accelerator(cpu=True)``
  and ``accelerator.reduce``) in a subprocess that we kill after ``--accelerate-wait`` seconds.
- count mismatch: rank 0 calls all_reduce three times, rank 1 twice, then both a barrier; both
  ranks wait in collectives forever. nblaunch with ``hang_timeout=5``: time from the moment the
  later rank entered its hanging collective to the error, beyond the 5 s it is told to wait.
- heartbeat overhead: one process, one torch thread (a rank's share of this machine), a small
  MLP training step (784-256-10, batch 64, SGD). Steps are timed with and without a heartbeat
  thread watching the training thread and sending its heartbeats through a pipe to another
  process (as in a rank), in alternating rounds; the overhead is the median of paired rounds,
  in wall time and in the process's CPU time (all threads: the heartbeat thread's work shows
  there even when a busy machine's noise hides it in wall time).
  Also the cost of one stack sample and one heartbeat on a 40-frame stack, timed directly.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from nblaunch.ranks.heartbeat import HEARTBEAT_INTERVAL_S, SAMPLE_INTERVAL_S

DIVERGE_STEP = 3
ROUNDS = 10
ROUND_S = 2.5  # seconds of training steps per round: a few heartbeats in each
STACK_DEPTH = 40  # frames on the watched stack for the per-sample cost


def early_stop(stamp: str) -> int:
    """Rank 1 leaves the loop at DIVERGE_STEP; rank 0 goes on to its next all_reduce."""
    import torch
    import torch.distributed as dist

    loss = torch.ones(1)
    for step in range(100):
        dist.all_reduce(loss)
        if dist.get_rank() == 1 and step == DIVERGE_STEP:
            Path(stamp).write_text(repr(time.time()))
            break
    return step


def count_mismatch(stamp: str) -> None:
    """Rank 0 calls all_reduce three times, rank 1 twice; each notes when it entered its last
    collective (the hang starts when the later one does)."""
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(x)
    Path(f"{stamp}{dist.get_rank()}").write_text(repr(time.time()))
    if dist.get_rank() == 0:
        dist.all_reduce(x)  # rank 0's third all_reduce meets rank 1's barrier: both wait
    dist.barrier()


ACCELERATE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from accelerate import notebook_launcher

    def early_stop(stamp):
        import torch
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        loss = torch.ones(1)
        for step in range(100):
            loss = accelerator.reduce(loss)
            if accelerator.process_index == 1 and step == DIVERGE_STEP:
                Path(stamp).write_text(repr(time.time()))
                break
        return step

    notebook_launcher(early_stop, (sys.argv[1],), num_processes=2, use_port=sys.argv[2])
    print("returned")
    """
).replace("DIVERGE_STEP", str(DIVERGE_STEP))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def nblaunch_early_stop(workdir: Path) -> tuple[float, str]:
    from nblaunch import DistributedHangError, notebook_launcher

    stamp = workdir / "nblaunch-diverged"
    try:
        notebook_launcher(early_stop, (str(stamp),), num_processes=2, display="none")
    except DistributedHangError as exc:
        caught = time.time()
        return caught - float(stamp.read_text()), str(exc).splitlines()[0]
    return float("nan"), "no error"


def nblaunch_count_mismatch(workdir: Path, hang_timeout: float) -> tuple[float, str]:
    from nblaunch import DistributedHangError, notebook_launcher

    stamp = workdir / "mismatch-rank"
    try:
        notebook_launcher(
            count_mismatch,
            (str(stamp),),
            num_processes=2,
            display="none",
            hang_timeout=hang_timeout,
            debug=False,  # the hang watchdog's time; the default checks name it at the call
        )
    except DistributedHangError as exc:
        caught = time.time()
        hung = max(float(Path(f"{stamp}{rank}").read_text()) for rank in (0, 1))
        return caught - hung - hang_timeout, str(exc).splitlines()[0]
    return float("nan"), "no error"


def accelerate_early_stop(workdir: Path, wait_s: float) -> str:
    """Run Accelerate's launcher in its own session; kill that session if it is still hung."""
    script = workdir / "accelerate_early_stop.py"
    script.write_text(ACCELERATE_SCRIPT)
    stamp = workdir / "accelerate-diverged"
    process = subprocess.Popen(
        [sys.executable, str(script), str(stamp), str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: we can stop exactly what we started
    )
    deadline = time.monotonic() + 120  # start-up bound, before the divergence happens
    try:
        while not stamp.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not stamp.exists():
            return f"did not reach the divergence (exit code {process.poll()})"
        diverged = float(stamp.read_text())
        try:
            process.wait(timeout=max(0.0, wait_s - (time.time() - diverged)))
        except subprocess.TimeoutExpired:
            return f"still hung after {time.time() - diverged:.0f} s (killed)"
        return f"exited after {time.time() - diverged:.1f} s (exit code {process.returncode})"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- heartbeat overhead ---------------------------------------------------------------------------


def _drain(conn) -> None:
    try:
        while True:
            conn.recv_bytes()
    except EOFError:
        pass


def sampling_cost() -> tuple[float, float]:
    """Microseconds for one stack sample and for one heartbeat (stacks formatted, pickled) of a
    thread STACK_DEPTH frames deep."""
    import pickle

    from nblaunch.ranks.heartbeat import HeartbeatThread

    result: list[float] = []

    def deep(depth: int) -> None:
        if depth:
            deep(depth - 1)
            return
        beat = HeartbeatThread(0, lambda event: None)
        started = time.perf_counter()
        for _ in range(2000):
            beat.sample(time.monotonic())
        result.append((time.perf_counter() - started) / 2000 * 1e6)
        started = time.perf_counter()
        for _ in range(200):
            pickle.dumps(beat._heartbeat(time.monotonic()))
        result.append((time.perf_counter() - started) / 200 * 1e6)

    deep(STACK_DEPTH)
    return result[0], result[1]


def heartbeat_overhead() -> dict[str, float]:
    import torch

    from nblaunch.ranks.heartbeat import HeartbeatThread

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def round_time(steps: int) -> tuple[float, float]:
        """Wall seconds and process CPU seconds (every thread, the heartbeat's too) per step."""
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps

    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    drain = context.Process(target=_drain, args=(reader,), daemon=True)
    drain.start()
    reader.close()
    sizes: list[int] = []
    live: list[int] = []

    def send(event) -> None:
        import pickle

        payload = pickle.dumps(event)
        sizes.append(len(payload))
        if event["stack"]:  # the final heartbeat of a task carries no stack
            live.append(len(payload))
        writer.send_bytes(payload)

    round_time(50)  # warm up
    steps = max(100, int(ROUND_S / round_time(200)[0]))  # rounds long enough for heartbeats
    without, with_beats, samples, seconds = [], [], 0, 0.0

    def beating_round() -> None:
        nonlocal samples, seconds
        beat = HeartbeatThread(0, send)
        beat.start()
        started = time.perf_counter()
        with_beats.append(round_time(steps))
        seconds += time.perf_counter() - started
        beat.stop()
        samples += beat.samples

    for index in range(ROUNDS):
        # ABBA order, so neither variant always runs first (warm caches, allocator, clocks).
        if index % 2 == 0:
            without.append(round_time(steps))
            beating_round()
        else:
            beating_round()
            without.append(round_time(steps))
    writer.close()
    drain.join(10)

    def paired(index: int) -> float:
        # Each "with" round against the "without" round next to it: cancels slow drifts in the
        # machine's load better than comparing two medians.
        pairs = zip(with_beats, without, strict=True)
        return statistics.median(w[index] / wo[index] - 1 for w, wo in pairs) * 100

    return {
        "step_without_ms": statistics.median(w for w, _ in without) * 1e3,
        "step_with_ms": statistics.median(w for w, _ in with_beats) * 1e3,
        "cpu_without_ms": statistics.median(c for _, c in without) * 1e3,
        "cpu_with_ms": statistics.median(c for _, c in with_beats) * 1e3,
        "wall_overhead_pct": paired(0),
        "cpu_overhead_pct": paired(1),
        "samples_per_s": samples / seconds,
        "heartbeat_bytes": statistics.median(live) if live else 0,
        "heartbeats_per_s": len(live) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerate-wait", type=float, default=30.0)
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        os.environ.setdefault("NBLAUNCH_RUN_DIR", str(workdir / "runs"))
        from nblaunch import notebook_launcher

        notebook_launcher(lambda: None, num_processes=2, display="none")  # start the forkserver
        latency, first_line = nblaunch_early_stop(workdir)
        rows.append(
            (
                "early stop: rank 1 leaves the loop at step 3",
                "nblaunch (hang_timeout=300)",
                f"DistributedHangError {latency:.1f} s after the divergence",
                first_line,
            )
        )
        accelerate = accelerate_early_stop(workdir, options.accelerate_wait)
        rows.append(
            (
                "early stop: rank 1 leaves the loop at step 3",
                "Accelerate notebook_launcher",
                accelerate,
                "no message",
            )
        )
        extra, first_line = nblaunch_count_mismatch(workdir, 5.0)
        rows.append(
            (
                "count mismatch: 3 all_reduce vs 2, then barrier",
                "nblaunch (hang_timeout=5)",
                f"DistributedHangError hang_timeout + {extra:.1f} s after the hang began",
                first_line,
            )
        )
    cost = heartbeat_overhead()
    sample_us, beat_us = sampling_cost()
    per_second = sample_us / SAMPLE_INTERVAL_S + beat_us / HEARTBEAT_INTERVAL_S
    rows.append(
        (
            "MLP training step, 1 thread",
            "no heartbeat thread",
            f"{cost['step_without_ms']:.3f} ms/step wall, {cost['cpu_without_ms']:.3f} ms CPU",
            "",
        )
    )
    rows.append(
        (
            "MLP training step, 1 thread",
            "with heartbeats",
            f"{cost['step_with_ms']:.3f} ms/step wall ({cost['wall_overhead_pct']:+.1f}%), "
            f"{cost['cpu_with_ms']:.3f} ms CPU ({cost['cpu_overhead_pct']:+.1f}%)",
            f"{cost['samples_per_s']:.0f} stack samples/s, {cost['heartbeats_per_s']:.1f} "
            f"heartbeats/s of {cost['heartbeat_bytes']:.0f} bytes",
        )
    )
    rows.append(
        (
            f"one stack sample / one heartbeat, {STACK_DEPTH}-frame stack",
            "nblaunch heartbeat thread",
            f"{sample_us:.1f} µs / {beat_us:.0f} µs",
            f"{per_second / 1e4:.3f}% of one core at {1 / SAMPLE_INTERVAL_S:.0f} samples "
            f"and {1 / HEARTBEAT_INTERVAL_S:.0f} heartbeat a second",
        )
    )
    print("| scenario | launcher | result | first line of the error / notes |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")


if __name__ == "__main__":
    main()
