"""What ``nblaunch.log_metrics`` costs: in the rank, and in the notebook that charts it.

Run: ``.venv/bin/python benchmarks/bench_metrics.py [--seconds 60] [--rate 1000]``. Prints one
markdown table and writes it to ``benchmarks/results/bench_metrics.md``.

Rows:

- cost per call: 2 CPU ranks each call ``log_metrics({"loss": ..., "lr": ...}, step=i)`` 20,000
  times as fast as they can (``display="none"``; the notebook still relays every event and
  writes ``metrics.jsonl``); microseconds per call, the slower rank's mean;
- in a real kernel with the live view: 2 ranks each log ``--rate`` metric events a second (one
  value each) for ``--seconds``; messages the kernel sent the browser per second (iopub, as a
  frontend receives them: mean, and the busiest second), the kernel's memory (RSS) before, at
  its peak and after (torch, ipywidgets and nblaunch imported before), and whether every event
  reached ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_metrics.md"


def cost_per_call(calls: int) -> float:
    """Seconds per ``log_metrics`` call in a rank (runs inside the rank)."""
    import time

    import nblaunch

    began = time.perf_counter()
    for step in range(calls):
        nblaunch.log_metrics({"loss": 1.0 / (step + 1), "lr": 1e-3}, step=step)
    return (time.perf_counter() - began) / calls


KERNEL_CELL = """
import nblaunch
def steady(rate, seconds):
    import time, nblaunch
    began = time.perf_counter()
    for step in range(int(rate * seconds)):
        nblaunch.log_metrics({{"loss": 1.0 / (step + 1)}}, step=step)
        wait = began + (step + 1) / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    return step + 1
nblaunch.notebook_launcher(steady, ({rate}, {seconds}), num_processes=2, device_type="cpu",
                           run_dir={run_dir!r})
"""


def in_a_kernel(rate: float, seconds: float) -> dict[str, float]:
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    run_dir = tempfile.mkdtemp(prefix="bench-metrics-")
    manager.start_kernel(cwd=run_dir)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        # What a notebook has imported before it launches, so the memory measured is the run's.
        reply = client.execute_interactive(
            "import torch, ipywidgets, nblaunch", timeout=120, output_hook=lambda msg: None
        )
        assert reply["content"]["status"] == "ok"
        kernel = psutil.Process(manager.provisioner.pid)
        before = kernel.memory_info().rss
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                try:
                    peak.append(kernel.memory_info().rss)
                except psutil.Error:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        msg_id = client.execute(KERNEL_CELL.format(rate=rate, seconds=seconds, run_dir=run_dir))
        per_second: collections.Counter[int] = collections.Counter()
        began = time.monotonic()
        deadline = began + seconds + 120
        while time.monotonic() < deadline:
            try:
                msg = client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            per_second[int(time.monotonic() - began)] += 1
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        elapsed = time.monotonic() - began
        stop.set()
        sampler.join(2)
        after = kernel.memory_info().rss
        lines = sum(1 for _ in open(os.path.join(run_dir, "metrics.jsonl")))  # noqa: SIM115
        return {
            "elapsed": elapsed,
            "messages_per_s": sum(per_second.values()) / elapsed,
            "busiest_s": max(per_second.values()),
            "rss_before_mb": before / 2**20,
            "rss_peak_mb": max(peak) / 2**20,
            "rss_after_mb": after / 2**20,
            "lines": lines,
            "expected": 2 * int(rate * seconds),
        }
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="events per second per rank")
    parser.add_argument("--calls", type=int, default=20_000)
    options = parser.parse_args()

    from nblaunch import notebook_launcher

    per_call = notebook_launcher(
        cost_per_call, (options.calls,), num_processes=2, device_type="cpu", display="none"
    )
    kernel = in_a_kernel(options.rate, options.seconds)
    rows = [
        (
            "cost per `log_metrics` call (2 metrics), rank logging flat out",
            f"{max(per_call) * 1e6:.1f} µs",
            f"ranks: {', '.join(f'{c * 1e6:.1f}' for c in per_call)} µs; {options.calls} calls",
        ),
        (
            f"browser messages, 2 ranks x {options.rate:g} events/s for {options.seconds:g} s",
            f"{kernel['messages_per_s']:.1f}/s",
            f"busiest second {kernel['busiest_s']}; cell took {kernel['elapsed']:.1f} s",
        ),
        (
            "kernel memory (RSS)",
            f"+{kernel['rss_peak_mb'] - kernel['rss_before_mb']:.1f} MB at peak",
            f"{kernel['rss_before_mb']:.0f} MB before, {kernel['rss_peak_mb']:.0f} peak, "
            f"{kernel['rss_after_mb']:.0f} after",
        ),
        (
            "events in metrics.jsonl",
            f"{kernel['lines']:,} of {kernel['expected']:,}",
            "every event, one line each",
        ),
    ]
    lines = [
        "# bench_metrics",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cores, 2 CPU ranks.",
        "",
        "| what | value | note |",
        "|---|---:|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
