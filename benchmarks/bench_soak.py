"""A kernel used for days, in ten minutes: does anything grow with use?

Each scenario runs in one real kernel (jupyter_client, as the tests drive it) and counts, before
and after every iteration, the kernel's RSS, fds, threads and live widgets, the run host's RSS,
fds and threads (detached scenarios) and the ranks' RSS (summed):

- ``views``: a background run printing ~200 lines/s and logging ~50 metrics/s per rank, viewed
  again every few seconds (``h.view()``, the live widget; the kernel's CPU share is counted);
- ``attach``: a detached run printing ~100 lines/s (no metrics: its history is full at once)
  attached by new processes, half of them reading the state, half
  watching it for half a second (``attach()``, ``.watch()``), each then exiting;
- ``launches``: background launches (``block=False``), each waited for;
- ``pool``: a pool of the kernel driven by ``%%distributed`` cells, then pushes and pulls;
- ``detached pool``: the same on a detached pool (``start_pool(detach=True)``).

It prints one line per iteration and a table of start, middle and end, the growth in all, per
iteration and over the second half (what is bounded stops growing there).

    python benchmarks/bench_soak.py            # ~10 minutes
    python benchmarks/bench_soak.py --smoke    # well under a minute (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import Kernel  # noqa: E402  (the tests' real-kernel driver)

FULL = {
    "views": {"seconds": 180, "every": 10},
    "attach": {"times": 40},
    "launches": {"times": 200, "step": 20},
    "pool": {"cells": 300, "step": 50, "pushes": 20, "mb": 50},
}
SMOKE = {
    "views": {"seconds": 7, "every": 2},
    "attach": {"times": 2},
    "launches": {"times": 4, "step": 2},
    "pool": {"cells": 6, "step": 3, "pushes": 2, "mb": 5},
}

SETUP = """
import gc, json, os, threading, time
import psutil
import nblaunch
import nblaunch.engine.detached.registry
import nblaunch.engine.processes.spares
from multiprocessing import forkserver, resource_tracker
%load_ext nblaunch

def chatty(seconds):
    import time
    end, step = time.time() + seconds, 0
    while time.time() < end:  # ~200 lines/s and ~50 metrics/s per rank
        print("step", step, time.time(), flush=True)
        print("loss", 1 / (step + 1), flush=True)
        if step % 2 == 0:
            nblaunch.log_metrics({"loss": 1 / (step + 1)}, step=step)
        step += 1
        time.sleep(0.01)
    return 1

def printer(seconds):  # output only: the host's history is full within seconds
    import time
    end = time.time() + seconds
    while time.time() < end:
        print("step", time.time(), flush=True)
        time.sleep(0.01)
    return 1

def quick():
    return nblaunch.rank()

me = psutil.Process()  # one object: cpu_percent() is the share since its last call

def ranks_rss(pid):
    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    helpers.update(nblaunch.engine.processes.spares.pids())
    total = 0
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE:
                total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20

def count(host=0):
    from nblaunch.engine.processes import supervisor
    for _, _, process in list(supervisor._leaving):  # ranks let go, still exiting: not counted
        process.join(5.0)
    gc.collect()
    import ipywidgets.widgets.widget as w
    row = {"kernel MB": me.memory_info().rss / 2**20, "kernel CPU %": me.cpu_percent(),
           "kernel fds": me.num_fds(),
           "kernel threads": threading.active_count(), "widgets": len(w._instances),
           "ranks MB": ranks_rss(host or os.getpid())}
    if host:
        try:
            h = psutil.Process(host)
            row.update({"host MB": h.memory_info().rss / 2**20, "host fds": h.num_fds(),
                        "host threads": h.num_threads()})
        except psutil.NoSuchProcess:
            pass
    print("COUNT " + json.dumps(row))
"""


class Soak:
    """One scenario's counts, iteration by iteration."""

    def __init__(self, kernel: Kernel, name: str) -> None:
        self.kernel, self.name, self.rows = kernel, name, []

    def run(self, code: str, timeout: float = 300) -> str:
        cell = self.kernel.run(code, timeout=timeout)
        if cell["error"]:
            raise RuntimeError(f"{self.name}: {cell['error']}: {cell['message']}\n{code}")
        return cell["out"]

    def count(self, label: str, host: int = 0) -> None:
        out = self.run(f"count({host})")
        row = json.loads(out.split("COUNT ", 1)[1].splitlines()[0])
        self.rows.append((label, row))
        shown = ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
        )
        print(f"  {self.name} {label}: {shown}", flush=True)

    def table(self, iterations: int) -> list[str]:
        """Start, middle and end; growth in all, per iteration, and over the second half (a
        bounded cost stops growing there)."""
        (_, first), (_, middle), (_, last) = (
            self.rows[0],
            self.rows[len(self.rows) // 2],
            self.rows[-1],
        )
        lines = []
        for key in first:
            if key not in last:
                continue
            growth = last[key] - first[key]
            lines.append(
                f"| {self.name} | {key} | {first[key]:.1f} | {middle[key]:.1f} | {last[key]:.1f} "
                f"| {growth:+.1f} | {growth / iterations:+.3f} | {last[key] - middle[key]:+.1f} |"
            )
        return lines


def views(kernel: Kernel, size: dict) -> tuple[Soak, int]:
    soak = Soak(kernel, "views")
    soak.run(
        f"h = nblaunch.notebook_launcher(chatty, ({size['seconds']},), num_processes=2, "
        "block=False, display='widget')\ntime.sleep(1.0)"
    )
    soak.count("view 1")
    n = 1
    end = time.monotonic() + size["seconds"] - 2 * size["every"]
    while time.monotonic() < end:
        time.sleep(size["every"])
        soak.run("h.view('widget')")
        n += 1
        soak.count(f"view {n}")
    soak.run("h.result(120)", timeout=150)
    return soak, n - 1


def attach(kernel: Kernel, size: dict) -> tuple[Soak, int]:
    soak = Soak(kernel, "attach")
    out = soak.run(
        "h = nblaunch.notebook_launcher(printer, (3600,), num_processes=2, detach=True, "
        "display='none')\nwhile not (h.run_dir / 'rank1.log').stat().st_size if "
        "(h.run_dir / 'rank1.log').exists() else True: time.sleep(0.1)\n"
        "print(h.id, nblaunch.engine.detached.registry.find(h.id).pid)",
        timeout=120,
    )
    run_id, host = out.split()[-2], int(out.split()[-1])
    client = (
        "import time, nblaunch\nfrom nblaunch.notebook.views.recording import RecordingView\n"
        "h = nblaunch.attach({!r})\nassert h.state == 'running'\n{}"
    )
    time.sleep(1.0)
    soak.count("attach 0", host)
    for i in range(size["times"]):
        watch = "h.watch(RecordingView()); time.sleep(0.5)" if i % 2 else ""
        subprocess.run([sys.executable, "-c", client.format(run_id, watch)], check=True, timeout=60)
        time.sleep(0.3)
        soak.count(f"attach {i + 1}", host)
    soak.run("h.stop()\ntry:\n    h.result(60)\nexcept Exception:\n    pass", timeout=90)
    return soak, size["times"]


def launches(kernel: Kernel, size: dict) -> tuple[Soak, int]:
    soak = Soak(kernel, "launches")
    soak.run(  # the first one forks the spare ranks ahead (their pipes): counted from here
        "nblaunch.notebook_launcher(quick, num_processes=2, block=False, display='none').result(60)"
    )
    soak.count("launch 0")
    for done in range(0, size["times"], size["step"]):
        soak.run(
            f"for _ in range({size['step']}):\n"
            "    h = nblaunch.notebook_launcher(quick, num_processes=2, block=False, "
            "display='widget')\n"
            "    assert h.result(60) == [0, 1]"
        )
        soak.count(f"launch {done + size['step']}")
    return soak, size["times"]


def pool(kernel: Kernel, size: dict, detach: bool) -> tuple[Soak, int]:
    soak = Soak(kernel, "detached pool" if detach else "pool")
    out = soak.run(
        f"pool = nblaunch.start_pool(2, detach={detach}, display='none')\n"
        "print(pool.entry.pid if getattr(pool, 'entry', None) else 0)",
        timeout=120,
    )
    host = int(out.split()[-1])
    soak.run("%%distributed\nx = 0")
    soak.count("cell 0", host)
    for done in range(0, size["cells"], size["step"]):
        for _ in range(size["step"]):
            soak.run("%%distributed\nx = x + 1")
        soak.count(f"cell {done + size['step']}", host)
    nbytes = size["mb"] * 2**20
    for i in range(size["pushes"]):
        soak.run(
            f"pool.push('blob', b'x' * {nbytes})\nassert len(pool.pull('blob')) == {nbytes}",
            timeout=120,
        )
        soak.count(f"push {i + 1}", host)
    soak.run("pool.close()", timeout=60)
    return soak, size["cells"] + size["pushes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small size, well under a minute")
    parser.add_argument("--only", nargs="+", help="run only these scenarios (names as above)")
    args = parser.parse_args()
    size = SMOKE if args.smoke else FULL
    began = time.monotonic()
    lines = [
        "| scenario | what | start | middle | end | growth | per iteration | 2nd half |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as cwd:
        kernel = Kernel(cwd)
        try:
            cell = kernel.run(SETUP, timeout=60)
            if cell["error"]:
                raise RuntimeError(f"setup: {cell['error']}: {cell['message']}")
            for name, scenario in (
                ("views", lambda: views(kernel, size["views"])),
                ("attach", lambda: attach(kernel, size["attach"])),
                ("launches", lambda: launches(kernel, size["launches"])),
                ("pool", lambda: pool(kernel, size["pool"], detach=False)),
                ("detached pool", lambda: pool(kernel, size["pool"], detach=True)),
            ):
                if args.only and name not in args.only:
                    continue
                t0 = time.monotonic()
                soak, iterations = scenario()
                print(f"{name}: {iterations} iterations in {time.monotonic() - t0:.0f} s")
                lines += soak.table(iterations)
        finally:
            kernel.close()
    print(f"\nbench_soak ({'smoke' if args.smoke else 'full'}, {time.monotonic() - began:.0f} s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
