"""Output relay under load: 2 ranks printing 200k lines each, in a real Jupyter kernel.

Prints one markdown table. Rows:

- nblaunch, ranks writing to /dev/null: the floor (same launcher, same ranks, no output);
- nblaunch in a kernel with the live view (``display="auto"``): the notebook case;
- nblaunch in a kernel, a background run (``block=False``) and a detached run (``detach=True``),
  each with the live view, waited for with ``result()``;
- nblaunch in a script with the text view, stdout to a file;
- Accelerate's ``notebook_launcher`` in a kernel (output goes to the cell as stream messages),
  stopped after ``--accelerate-limit`` seconds if it has not finished;
- Accelerate's ``notebook_launcher`` in a script, stdout to a file.

Columns: finished lines that arrived intact where the output goes (the run's log files for
nblaunch, the cell or the file for the others), lines lost or broken on the way, lines holding
pieces of several lines (glued), wall time and its ratio to the /dev/null floor, messages to the
browser per second (mean over the run, and the busiest one-second window; counted on the kernel's
iopub channel as a frontend receives them), and peak memory (RSS) of the launching process, with
its growth during the run where the process existed before it.

    python benchmarks/bench_relay.py [--lines 200000] [--accelerate-limit 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

LINE = re.compile(r"rank [01] line \d+")
TEXT_VIEW_PREFIX = re.compile(r"^\[rank [01]\] ", re.MULTILINE)

WORKLOAD = '''
import json, os, sys, time

def emit(n, sink):
    """Print n numbered lines to stdout, or to /dev/null (line-buffered either way); return
    when the first was printed (wall clock: the relay's rate is timed from it)."""
    rank = int(os.environ.get("RANK", "0"))
    out = open(os.devnull, "w", buffering=1) if sink == "devnull" else sys.stdout
    began = time.time()
    for i in range(n):
        print(f"rank {rank} line {i}", file=out)
    out.flush()
    return began
'''

KERNEL_SETUP = (
    WORKLOAD
    + """
import nblaunch.notebook.views.choose as _choose
from nblaunch import notebook_launcher
_views = []
_make_view = _choose.make_view

def _capture(display):
    view = _make_view(display)
    _views.append(view)
    handle = view.handle

    def timed(event):  # when the view got each line: the relay's rate ends at the last
        if event["kind"] == "stream":
            view.last_line_at = time.time()
        handle(event)

    view.handle = timed
    return view


def _relay_rate(began, view, lines):  # from the first line a rank printed to the last seen
    deadline = time.monotonic() + 60  # a detached view's own connection may still be reading
    while getattr(getattr(view, "model", None), "lines_received", lines) < lines:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return lines / (view.last_line_at - min(began)) if hasattr(view, "last_line_at") else None

_choose.make_view = _capture
print("PID", os.getpid())
"""
)

NBLAUNCH_CELL = """
_t0 = time.perf_counter()
_began = notebook_launcher(emit, args=({n}, {sink!r}), num_processes=2, display="auto",
    run_dir={run_dir!r})
_wall = time.perf_counter() - _t0
_v = _views[-1]
print("BENCH " + json.dumps({{"wall": _wall, "view": type(_v).__name__,
    "rate": _relay_rate(_began, _v, 2 * {n}),
    "lines_received": getattr(getattr(_v, "model", None), "lines_received", None),
    "messages_sent": getattr(_v, "messages_sent", None)}}))
"""

# A run that does not hold the cell: the engine on a thread (block=False) or in a run host
# (detach=True, the kernel a client of its socket); the cell waits with result().
HANDLE_CELL = """
_t0 = time.perf_counter()
_h = notebook_launcher(emit, args=({n}, {sink!r}), num_processes=2, run_dir={run_dir!r}, MODE)
_began = _h.result()
_wall = time.perf_counter() - _t0
_v = _views[-1]
print("BENCH " + json.dumps({{"wall": _wall, "view": type(_v).__name__,
    "rate": _relay_rate(_began, _v, 2 * {n}),
    "lines_received": getattr(getattr(_v, "model", None), "lines_received", None),
    "messages_sent": getattr(_v, "messages_sent", None)}}))
"""

ACCELERATE_CELL = """
from accelerate import notebook_launcher as accelerate_launcher
_t0 = time.perf_counter()
accelerate_launcher(emit, args=({n}, "stdout"), num_processes=2, use_port="{port}")
print("\\nBENCH " + json.dumps({{"wall": time.perf_counter() - _t0}}))
"""

NBLAUNCH_SCRIPT = """
from nblaunch import notebook_launcher
if __name__ == "__main__":
    # Warm-up, as in the kernel: start the forkserver (torch preloaded) once.
    notebook_launcher(emit, args=(10, "devnull"), num_processes=2, display="none")
    t0 = time.perf_counter()
    notebook_launcher(emit, args=({n}, "stdout"), num_processes=2, display="text",
                      run_dir={run_dir!r})
    print("BENCH " + json.dumps({{"wall": time.perf_counter() - t0}}), file=sys.stderr)
"""

ACCELERATE_SCRIPT = """
from accelerate import notebook_launcher
if __name__ == "__main__":
    t0 = time.perf_counter()
    notebook_launcher(emit, args=({n}, "stdout"), num_processes=2, use_port="{port}")
    print("BENCH " + json.dumps({{"wall": time.perf_counter() - t0}}), file=sys.stderr)
"""


class PeakRSS:
    """Samples a process's resident memory ten times a second."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self, growth: bool = True) -> str:
        self._stop.set()
        self._thread.join()
        mib = 1 << 20
        if not growth:  # a fresh script: everything it holds was loaded during the run
            return f"{self.peak / mib:.0f}"
        return f"{self.peak / mib:.0f} (+{(self.peak - self.before) / mib:.0f})"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def count_lines(text: str) -> tuple[int, int]:
    """(well-formed numbered lines, lines that hold more or less than one of them)."""
    good = glued = 0
    for line in text.splitlines():
        if LINE.fullmatch(line):
            good += 1
        elif LINE.search(line):
            glued += 1
    return good, glued


def count_log_lines(run_dir: Path) -> tuple[int, int]:
    good = glued = 0
    for log in sorted(run_dir.glob("rank*.log")):
        g, b = count_lines(log.read_text(errors="replace"))
        good += g
        glued += b
    return good, glued


class Kernel:
    """A python3 kernel driven like a frontend: execute, then read iopub until idle."""

    def __init__(self, cwd: Path) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd))
        self.pid = int(re.search(r"PID (\d+)", self.run(KERNEL_SETUP, 120)["stdout"]).group(1))

    def run(self, code: str, limit: float) -> dict:
        """Execute ``code``; interrupt it after ``limit`` seconds. Returns what came back."""
        msg_id = self.client.execute(code)
        start = time.monotonic()
        stdout: list[str] = []
        comm_times: list[float] = []
        stream_times: list[float] = []
        errors: list[str] = []
        interrupted = False
        while True:
            if not interrupted and time.monotonic() - start > limit:
                self.manager.interrupt_kernel()
                interrupted = True
            if time.monotonic() - start > limit + 60:
                raise RuntimeError("the kernel did not come back after an interrupt")
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                stdout.append(msg["content"]["text"])
                stream_times.append(time.monotonic())
            elif kind == "comm_msg":
                comm_times.append(time.monotonic())
            elif kind == "error":
                errors.append(msg["content"]["ename"])
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        return {
            "stdout": "".join(stdout),
            "comm_times": comm_times,
            "stream_times": stream_times,
            "errors": errors,
            "interrupted": interrupted,
            "elapsed": time.monotonic() - start,
        }

    def leftover_children(self) -> list[psutil.Process]:
        from multiprocessing import resource_tracker  # noqa: F401  (names only)

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        return [c for c in children if "forkserver" not in " ".join(c.cmdline())]

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def bench_result(stdout: str) -> dict:
    match = re.search(r"BENCH (\{.*\})", stdout)
    return json.loads(match.group(1)) if match else {}


def rates(times: list[float], elapsed: float) -> str:
    """Messages per second over the cell's run, and in its busiest one-second window."""
    if not times:
        return "0 / 0"
    per_second = collections.Counter(int(t - times[0]) for t in times)
    return f"{len(times) / max(elapsed, 1.0):.1f} / {max(per_second.values())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000, help="lines per rank")
    parser.add_argument("--accelerate-limit", type=float, default=60.0, help="seconds")
    options = parser.parse_args()
    n = options.lines
    expected = 2 * n
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    kernel = Kernel(work)
    try:
        # Warm-up: the forkserver and torch import, paid once per kernel.
        kernel.run(NBLAUNCH_CELL.format(n=10, sink="stdout", run_dir=str(work / "warm")), 120)

        memory = PeakRSS(kernel.pid)
        out = kernel.run(NBLAUNCH_CELL.format(n=n, sink="devnull", run_dir=str(work / "null")), 600)
        floor = bench_result(out["stdout"])["wall"]
        rows.append(
            [
                "nblaunch, ranks write to /dev/null",
                "nowhere",
                "-",
                "-",
                "-",
                f"{floor:.2f}",
                "1.0x",
                rates(out["comm_times"], floor),
                memory.stop(),
            ]
        )

        memory = PeakRSS(kernel.pid)
        out = kernel.run(NBLAUNCH_CELL.format(n=n, sink="stdout", run_dir=str(work / "view")), 600)
        result = bench_result(out["stdout"])
        wall = result["wall"]
        good, glued = count_log_lines(work / "view")
        seen = result["lines_received"]
        rows.append(
            [
                "nblaunch in a kernel, live view",
                "view (bounded) + rank logs",
                f"{good:,} (view: {seen:,})",
                f"{expected - good:,}",
                f"{glued:,}",
                f"{wall:.2f}",
                f"{wall / floor:.1f}x",
                rates(out["comm_times"], wall),
                memory.stop(),
            ]
        )

        rates_by_row = {"nblaunch in a kernel, live view": result["rate"]}
        for label, mode in (("background run", "block=False"), ("detached run", "detach=True")):
            template = HANDLE_CELL.replace("MODE", mode)
            memory = PeakRSS(kernel.pid)
            run_dir = work / mode.split("=")[0]
            out = kernel.run(template.format(n=n, sink="stdout", run_dir=str(run_dir)), 600)
            result = bench_result(out["stdout"])
            handle_wall = result["wall"]
            good, glued = count_log_lines(run_dir)
            row = f"nblaunch in a kernel, {label}"
            rates_by_row[row] = result["rate"]
            rows.append(
                [
                    row,
                    "view (bounded) + rank logs",
                    f"{good:,} (view: {result['lines_received']:,})",
                    f"{expected - good:,}",
                    f"{glued:,}",
                    f"{handle_wall:.2f}",
                    f"{handle_wall / floor:.1f}x",
                    rates(out["comm_times"], handle_wall),
                    memory.stop(),
                ]
            )

        port = free_port()
        memory = PeakRSS(kernel.pid)
        out = kernel.run(ACCELERATE_CELL.format(n=n, port=port), options.accelerate_limit)
        good, glued = count_lines(out["stdout"])
        if out["interrupted"]:
            wall_text = f"stopped at {options.accelerate_limit:.0f}"
            ratio = f"> {options.accelerate_limit / floor:.0f}x"
            lost = f"{expected - good:,} not yet"
        else:
            wall = bench_result(out["stdout"]).get("wall", out["elapsed"])
            wall_text, ratio, lost = f"{wall:.2f}", f"{wall / floor:.1f}x", f"{expected - good:,}"
        stream_rate = f"{rates(out['stream_times'], out['elapsed'])} (stream messages)"
        rows.append(
            [
                "Accelerate notebook_launcher in a kernel",
                "the cell (stream messages)",
                f"{good:,}",
                lost,
                f"{glued:,}",
                wall_text,
                ratio,
                stream_rate,
                memory.stop(),
            ]
        )
        for child in kernel.leftover_children():  # ranks an interrupted launcher left behind
            child.kill()
    finally:
        kernel.close()

    for name, template, where in (
        ("nblaunch in a script, text view", NBLAUNCH_SCRIPT, "stdout file + rank logs"),
        ("Accelerate notebook_launcher in a script", ACCELERATE_SCRIPT, "stdout file"),
    ):
        script = work / "script.py"
        run_dir = work / "script-run"
        script.write_text(WORKLOAD + template.format(n=n, run_dir=str(run_dir), port=free_port()))
        out_path = work / "stdout.txt"
        with open(out_path, "wb") as stdout:
            process = subprocess.Popen(
                [sys.executable, str(script)],
                stdout=stdout,
                stderr=subprocess.PIPE,
                cwd=work,
            )
            memory = PeakRSS(process.pid)
            _, stderr = process.communicate(timeout=900)
        wall = bench_result(stderr.decode(errors="replace")).get("wall", float("nan"))
        good, glued = count_lines(TEXT_VIEW_PREFIX.sub("", out_path.read_text(errors="replace")))
        rows.append(
            [
                name,
                where,
                f"{good:,}",
                f"{expected - good:,}",
                f"{glued:,}",
                f"{wall:.2f}",
                f"{wall / floor:.1f}x",
                "-",
                memory.stop(growth=False),
            ]
        )

    header = [
        f"2 ranks x {n:,} lines",
        "output goes to",
        "lines arrived",
        "lost or broken",
        "glued",
        "wall s",
        "vs /dev/null",
        "browser msgs/s (mean / peak 1 s)",
        "peak launcher RSS MiB (growth)",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "\nRelay rate (lines/s from the first line a rank printed to the last the kernel's view "
        "got; starting a detached run's host is not in it): "
        + "; ".join(f"{row}: {rate:,.0f}" for row, rate in rates_by_row.items() if rate)
    )
    print(
        f"\n{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f} at the end. "
        "Lines are counted where each launcher puts them."
    )


if __name__ == "__main__":
    main()
