"""Scaling: how nblaunch's costs grow with the number of ranks (2, 4 and 8 CPU ranks, gloo).

Run: ``.venv/bin/python benchmarks/bench_scale.py`` (a few minutes on 2 cores). Prints two markdown
tables, with a sentence per scenario under them, and writes them to
``benchmarks/results/bench_scale.md``.

- ``--ranks 2,4`` measures only those rank counts; ``--quick`` uses small line counts, one
  repeat and a short heartbeat window. Either makes a partial run: it prints its tables and
  writes nothing, unless ``--out PATH`` says where.
- ``--lines N`` changes the lines each printing rank writes (100,000; 2,000 with ``--quick``).

Every measurement runs in a fresh Python process (this file with ``--scenario``), with torch
imported before the first launch, as in a notebook: "first launch" really is the first one
(the forkserver not yet started). Ranks are started with
``notebook_launcher(fn, num_processes=N, device_type="cpu", display="none")``; a machine with
fewer cores than ranks runs them oversubscribed (nblaunch allows 4 CPU ranks per core; where a
rank count needs more, ``NBLAUNCH_MAX_PROCESSES`` is set for it).

First table: one row per (scenario, ranks). Columns: the value, the value divided by the
number of ranks, and a note.

- first launch: seconds from the call to the results of a function that returns its rank,
  the first launch of a fresh process (starts the forkserver, which imports torch);
- warm launch: the same, median of the next launches (5; 1 with ``--quick``);
- time to a rank's exception: the last rank raises ``ValueError`` at once while the others wait
  in ``torch.distributed.all_reduce``; median seconds from the call to the exception in the
  caller, over 5 runs (1 with ``--quick``) after a warm-up launch. The note says how many were
  the rank's own ``ValueError`` (the right root cause), and the difference to the warm launch;
- relay: every rank prints ``--lines`` numbered lines. Lines per second from the moment the
  first rank began printing to the moment the launcher read the last line (the launch itself
  left out; the note gives the whole call's wall time and the launcher's RSS growth), overall
  and per rank. The arrival times come from a wrapper around the launch's view (``display=
  "none"`` still writes the rank logs; the relay writes each line there just before it hands it
  to the view). Every line is checked in the run's ``rank<N>.log`` files: present, whole and
  in order;
- heartbeat thread CPU: each rank runs a small matmul loop for a fixed wall time (3 s; 1 s with
  ``--quick``) and reads the CPU time of its ``nblaunch-heartbeat`` thread (nblaunch has no
  switch to turn heartbeats off, so their cost is read from the thread's own CPU clock). The
  value is the heartbeat threads' CPU over the wall time, summed over ranks, in % of one core;
  per rank, each rank's share. The note gives it as a share of the rank's own CPU time, and the
  launcher's CPU use during the run (the parent reads every heartbeat);
- launcher RSS growth: the launching process's peak resident memory during a warm launch minus
  its resident memory just before (``VmHWM`` reset through ``/proc/self/clear_refs``, else
  sampled), median over the warm launches, MB; the note gives the first launch's growth.

Second table: multi-node relay, 2 ranks per node, everything on 127.0.0.1. One node:
``notebook_launcher(..., num_nodes=1, rdzv_endpoint=...)``, its 2 ranks print. Two nodes: a
second "node" joins with ``python -m nblaunch join 127.0.0.1:PORT --run-id RUN`` in a
subprocess, and only that node's 2 ranks print: their lines travel through the rendezvous
store. Lines per second as above (first line printed to last line read by the notebook's
launcher, which writes it to ``rank<N>.log`` on the notebook's side), overall and per printing
rank, with every line checked in those log files.

Under the tables, one sentence per scenario says whether the cost per rank stays flat (within
20%), grows or shrinks from the fewest to the most ranks (one node to two), computed from the
numbers above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nblaunch.engine.plan.launch_plan import CPU_RANKS_PER_CORE

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_scale.md"

DEFAULT_RANKS = (2, 4, 8)
LINES = 100_000
QUICK_LINES = 2_000
REPEATS = 5  # warm launches, and runs to a rank's exception
HEARTBEAT_S = 3.0
QUICK_HEARTBEAT_S = 1.0
RANKS_PER_NODE = 2
# A change of the per-rank value within this share counts as flat.
FLAT_TOLERANCE = 0.2
# Bounds on every wait: one launch, one scenario process, a node joining, the join command.
LAUNCH_LIMIT_S = 300.0
SCENARIO_LIMIT_S = 900.0
RDZV_LIMIT_S = 60.0
JOIN_EXIT_LIMIT_S = 30.0
# Values under these are noise for a trend (a launch that grew by a few pages).
NOISE_FLOOR = {"MB": 0.5, "s": 0.002, "% of a core": 0.01}
RESULT_PREFIX = "BENCH-SCALE "
LINE = re.compile(r"rank \d+ line \d+")
MB = 1e6


# --- what the ranks run --------------------------------------------------------------------------


def rank_of() -> int:
    """The trivial task: return this rank's number."""
    import nblaunch

    return nblaunch.rank()


def raise_on_last_rank() -> None:
    """The last rank raises at once; the others wait for it in an all_reduce."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        raise ValueError(f"boom on rank {rank}")
    dist.all_reduce(torch.ones(1))


def print_lines(n: int, node: int | None = None) -> float:
    """Print ``n`` numbered lines (only on node ``node``, when given); return when printing began.

    The start is ``time.time()``: the launcher reads the same clock (one machine).
    """
    started = time.time()
    rank = int(os.environ["RANK"])
    if node is None or int(os.environ["GROUP_RANK"]) == node:
        for i in range(n):
            print(f"rank {rank} line {i}")
        sys.stdout.flush()
    return started


def heartbeat_probe(seconds: float) -> dict[str, float]:
    """Compute for ``seconds`` of wall time; return the CPU the heartbeat thread used meanwhile.

    Returns
    -------
    dict
        ``wall``, ``beat_cpu`` (the heartbeat thread), ``task_cpu`` (this thread) and
        ``process_cpu`` (every thread), in seconds; ``beat_cpu`` is NaN without a heartbeat
        thread.
    """
    import threading

    import torch

    beat = next((t for t in threading.enumerate() if t.name == "nblaunch-heartbeat"), None)
    clock = time.pthread_getcpuclockid(beat.ident) if beat and beat.ident else None

    def beat_cpu() -> float:
        return time.clock_gettime(clock) if clock is not None else float("nan")

    a = torch.randn(64, 64)
    started, beat0 = time.monotonic(), beat_cpu()
    task0, process0 = time.thread_time(), time.process_time()
    while time.monotonic() - started < seconds:
        for _ in range(20):
            a @ a
    return {
        "wall": time.monotonic() - started,
        "beat_cpu": beat_cpu() - beat0,
        "task_cpu": time.thread_time() - task0,
        "process_cpu": time.process_time() - process0,
    }


# --- measuring in the scenario process -----------------------------------------------------------


class PeakRSS:
    """Peak resident memory of this process between ``start`` and ``stop``, in bytes.

    Resets the kernel's high-water mark (``/proc/self/clear_refs``) and reads ``VmHWM``; where
    that is not allowed, samples ``VmRSS`` every 10 ms on a thread.
    """

    def __init__(self) -> None:
        self.before = self.peak = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        self.before = self.peak = self._status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._sampler = None
        except OSError:
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._status("VmRSS"))

    def stop(self) -> int:
        """Growth: the peak since ``start`` minus resident memory at ``start``."""
        if self._sampler is None:
            self.peak = self._status("VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
        return max(0, self.peak - self.before)


class ArrivalClock:
    """Wraps the launch's view: notes when the last workload line of each rank reached the
    launcher (the relay writes a line to ``rank<N>.log`` just before it shows it)."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.last: dict[int, float] = {}

    def handle(self, event: Any) -> None:
        if event["kind"] == "stream" and event["text"].startswith("rank "):
            self.last[event["rank"]] = time.time()
        self.view.handle(event)

    def flush(self) -> None:
        self.view.flush()

    def close(self) -> None:
        self.view.close()


def clocked_views() -> list[ArrivalClock]:
    """Make every later launch's view an :class:`ArrivalClock`; returns the list they go to."""
    import nblaunch.notebook.views.choose as choose

    made: list[ArrivalClock] = []
    make_view = choose.make_view

    def clocked(display: str) -> ArrivalClock:
        made.append(ArrivalClock(make_view(display)))
        return made[-1]

    choose.make_view = clocked
    return made


def check_logs(run_dir: Path, ranks: list[int], n: int) -> dict[str, int]:
    """Count the workload lines of ``ranks`` in ``run_dir/rank<N>.log``.

    Returns
    -------
    dict
        ``good``: lines that are exactly ``rank R line I``, in order, from 0 up; ``missing``: the
        expected lines not found so; ``broken``: lines holding a workload line and more (glued)
        or less.
    """
    good = broken = 0
    for rank in ranks:
        log = run_dir / f"rank{rank}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        expected = 0
        prefix = f"rank {rank} line "
        for line in text.splitlines():
            if line == f"{prefix}{expected}":
                expected += 1
            elif LINE.search(line):
                broken += 1
        good += expected
    return {"good": good, "missing": len(ranks) * n - good, "broken": broken}


def launcher_options(n: int, run_dir: Path | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_processes": n,
        "device_type": "cpu",
        "display": "none",
        "timeout": LAUNCH_LIMIT_S,
    }
    if run_dir is not None:
        options["run_dir"] = run_dir
    return options


def scenario_launch(n: int, repeats: int, **_: Any) -> dict[str, Any]:
    from nblaunch import notebook_launcher

    times: list[float] = []
    growth: list[int] = []
    memory = PeakRSS()
    for _ in range(1 + repeats):
        memory.start()
        started = time.perf_counter()
        results = notebook_launcher(rank_of, **launcher_options(n))
        times.append(time.perf_counter() - started)
        growth.append(memory.stop())
        if results != list(range(n)):
            raise RuntimeError(f"wrong results: {results}")
    return {"times": times, "growth": growth}


def scenario_raise(n: int, repeats: int, **_: Any) -> dict[str, Any]:
    from nblaunch import notebook_launcher

    notebook_launcher(rank_of, **launcher_options(n))  # start the forkserver
    times: list[float] = []
    right = 0
    errors: list[str] = []
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            notebook_launcher(raise_on_last_rank, **launcher_options(n))
        except Exception as exc:  # whatever the launcher raises: checked below
            times.append(time.perf_counter() - started)
            if isinstance(exc, ValueError) and f"boom on rank {n - 1}" in str(exc):
                right += 1
            else:
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        else:
            errors.append("no exception")
    return {"times": times, "right": right, "errors": errors}


def scenario_relay(n: int, lines: int, workdir: Path, **_: Any) -> dict[str, Any]:
    from nblaunch import notebook_launcher

    notebook_launcher(rank_of, **launcher_options(n))  # start the forkserver
    views = clocked_views()
    run_dir = workdir / "relay"
    memory = PeakRSS()
    memory.start()
    started = time.perf_counter()
    starts = notebook_launcher(print_lines, (lines,), **launcher_options(n, run_dir))
    wall = time.perf_counter() - started
    growth = memory.stop()
    last = views[-1].last
    return {
        "wall": wall,
        "span": max(last.values(), default=float("nan")) - min(starts),
        "growth": growth,
        **check_logs(run_dir, list(range(n)), lines),
    }


def scenario_heartbeat(n: int, seconds: float, **_: Any) -> dict[str, Any]:
    from nblaunch import notebook_launcher

    notebook_launcher(rank_of, **launcher_options(n))  # start the forkserver
    started, cpu = time.perf_counter(), time.process_time()
    probes = notebook_launcher(heartbeat_probe, (seconds,), **launcher_options(n))
    wall = time.perf_counter() - started
    return {"probes": probes, "launcher_cpu": time.process_time() - cpu, "wall": wall}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def stop_joiner(process: subprocess.Popen[bytes]) -> None:
    """End a join command we started and the ranks it started (by PID: ours only)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def scenario_nodes(n: int, lines: int, workdir: Path, nodes: int, **_: Any) -> dict[str, Any]:
    """``n`` ranks per node on ``nodes`` loopback nodes; only the last node's ranks print."""
    from nblaunch import notebook_launcher

    views = clocked_views()
    port = free_port()
    run_dir = workdir / f"nodes{nodes}-{os.getpid()}"  # its name is the run id
    joiner = None
    join_log = workdir / "join.log"
    if nodes > 1:  # one join command per other node; it waits for the endpoint to answer
        command = [sys.executable, "-m", "nblaunch", "join", f"127.0.0.1:{port}"]
        command += ["--run-id", run_dir.name, "--connect-timeout", str(RDZV_LIMIT_S)]
        with open(join_log, "wb") as out:
            joiner = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        started = time.perf_counter()
        starts = notebook_launcher(
            print_lines,
            (lines, nodes - 1),
            **launcher_options(n, run_dir),
            num_nodes=nodes,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_timeout=RDZV_LIMIT_S,
        )
        wall = time.perf_counter() - started
        join_code = joiner.wait(JOIN_EXIT_LIMIT_S) if joiner is not None else 0
    finally:
        if joiner is not None:
            stop_joiner(joiner)
    printing = list(range((nodes - 1) * n, nodes * n))
    last = views[-1].last
    return {
        "wall": wall,
        "span": max((last.get(r, float("nan")) for r in printing), default=float("nan"))
        - min(starts[r] for r in printing),
        "join_code": join_code,
        **check_logs(run_dir, printing, lines),
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "launch": scenario_launch,
    "raise": scenario_raise,
    "relay": scenario_relay,
    "heartbeat": scenario_heartbeat,
    "nodes": scenario_nodes,
}


def run_in_this_process(options: argparse.Namespace) -> None:
    """The ``--scenario`` side: measure one scenario, print its numbers as one JSON line."""
    import torch  # noqa: F401  (a notebook has torch imported before it launches)

    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        workdir = Path(tmp)
        os.environ["NBLAUNCH_RUN_DIR"] = str(workdir / "runs")  # keep .nblaunch/ clean
        result = SCENARIOS[options.scenario](
            n=options.n,
            repeats=options.repeats,
            lines=options.lines,
            seconds=options.seconds,
            nodes=options.nodes,
            workdir=workdir,
        )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --- the orchestrating side ----------------------------------------------------------------------


def measure(scenario: str, n: int, options: argparse.Namespace, nodes: int = 1) -> dict[str, Any]:
    """Run one scenario in a fresh process (its own process group); its numbers, or an error."""
    env = dict(os.environ)
    if n > CPU_RANKS_PER_CORE * (os.cpu_count() or 1):
        env["NBLAUNCH_MAX_PROCESSES"] = str(n)
    command = [sys.executable, str(Path(__file__).resolve()), "--scenario", scenario]
    command += ["--n", str(n), "--repeats", str(options.repeats), "--lines", str(options.lines)]
    command += ["--seconds", str(options.seconds), "--nodes", str(nodes)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: we can stop exactly what we started
    )
    try:
        stdout, stderr = process.communicate(timeout=SCENARIO_LIMIT_S)
    except BaseException as exc:  # too slow, or Ctrl-C here: end what we started, by its group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return {"error": f"no result in {SCENARIO_LIMIT_S:.0f} s (killed)"}
    found = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not found:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit code {process.returncode}: {last[:150]}"}
    return json.loads(found[-1][len(RESULT_PREFIX) :])


@dataclass
class Row:
    """One line of a table: a value for ``ranks`` ranks, and the same per rank."""

    scenario: str
    ranks: int
    value: float
    per_rank: float
    unit: str
    note: str
    rate: bool = False  # higher is better (lines per second)
    label: str = ""  # the ranks column, when not just the number


def fmt(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "-"
    if unit == "lines/s":
        return f"{value:,.0f} lines/s"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "MB":
        return f"{value:.1f} MB"
    if unit == "% of a core":
        return f"{value:.2f}% of a core"
    return f"{value:g} {unit}"


def error_row(scenario: str, n: int, result: dict[str, Any], label: str = "") -> Row:
    return Row(
        scenario, n, float("nan"), float("nan"), "", f"error: {result['error']}", False, label
    )


def lines_note(result: dict[str, Any], expected: int) -> str:
    if result["missing"] == 0 and result["broken"] == 0:
        return f"all {expected:,} lines in the rank logs, whole and in order"
    return (
        f"LINES LOST: {result['good']:,} of {expected:,} in order in the rank logs, "
        f"{result['missing']:,} missing, {result['broken']:,} broken"
    )


def rows_for(n: int, options: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    repeats = options.repeats
    launch = measure("launch", n, options)
    warm_median = float("nan")
    if "error" in launch:
        rows.append(error_row("first launch", n, launch))
    else:
        first, *warm = launch["times"]
        warm_median = statistics.median(warm)
        rows.append(Row("first launch", n, first, first / n, "s", "starts the forkserver"))
        spread = f"{min(warm):.3f}-{max(warm):.3f} s" if len(warm) > 1 else "1 run"
        rows.append(
            Row(f"warm launch, median of {repeats}", n, warm_median, warm_median / n, "s", spread)
        )

    result = measure("raise", n, options)
    if "error" in result or not result["times"]:
        rows.append(error_row(f"time to a rank's exception, median of {repeats}", n, result))
    else:
        median = statistics.median(result["times"])
        note = f"right root cause (rank {n - 1}'s ValueError) {result['right']}/{repeats}"
        if warm_median == warm_median:
            note += f"; {median - warm_median:+.3f} s against the warm launch median"
        if result["errors"]:
            note += f"; got {result['errors'][0]}"
        rows.append(
            Row(
                f"time to a rank's exception, median of {repeats}", n, median, median / n, "s", note
            )
        )

    result = measure("relay", n, options)
    label = f"relay, {options.lines:,} lines per rank"
    if "error" in result:
        rows.append(error_row(label, n, result))
    else:
        rate = n * options.lines / result["span"]
        note = (
            f"{lines_note(result, n * options.lines)}; call {result['wall']:.2f} s; "
            f"launcher RSS +{result['growth'] / MB:.1f} MB"
        )
        rows.append(Row(label, n, rate, rate / n, "lines/s", note, rate=True))

    result = measure("heartbeat", n, options)
    label = "heartbeat thread CPU"
    probes = result.get("probes") or []
    if "error" in result or any(p["beat_cpu"] != p["beat_cpu"] for p in probes):
        rows.append(error_row(label, n, result if "error" in result else {"error": "no thread"}))
    else:
        shares = [p["beat_cpu"] / p["wall"] * 100 for p in probes]
        of_task = statistics.mean(p["beat_cpu"] / p["process_cpu"] * 100 for p in probes)
        launcher = result["launcher_cpu"] / result["wall"] * 100
        note = (
            f"{of_task:.2f}% of the rank's CPU time (all its threads); "
            f"{options.seconds:g} s of matmuls; "
            f"launcher {launcher:.1f}% of a core during the run"
        )
        rows.append(Row(label, n, sum(shares), sum(shares) / n, "% of a core", note))

    label = f"launcher RSS growth, warm launch, median of {repeats}"
    if "error" in launch:
        rows.append(error_row(label, n, launch))
    else:
        first_growth, *warm_growth = (g / MB for g in launch["growth"])
        median = statistics.median(warm_growth)
        note = f"first launch +{first_growth:.1f} MB"
        rows.append(Row(label, n, median, median / n, "MB", note))
    return rows


def node_rows(options: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    n = RANKS_PER_NODE
    for nodes in (1, 2):
        label = f"{nodes} node{'s' if nodes > 1 else ''} x {n} ranks"
        scenario = "multi-node relay"
        result = measure("nodes", n, options, nodes=nodes)
        if "error" in result:
            rows.append(error_row(scenario, nodes, result, label))
            continue
        rate = n * options.lines / result["span"]
        where = "the notebook's node (local pipes)" if nodes == 1 else "the joined node (store)"
        note = f"ranks of {where} print; {lines_note(result, n * options.lines)}"
        note += f"; call {result['wall']:.2f} s"
        if nodes > 1 and result["join_code"] != 0:
            note += f"; join exit code {result['join_code']}"
        rows.append(Row(scenario, nodes, rate, rate / n, "lines/s", note, rate=True, label=label))
    return rows


def trend(first: float, last: float, unit: str) -> str:
    """``flat``, ``grows x1.8`` or ``shrinks x0.50``: ``last`` against ``first``.

    Two values both under the unit's noise floor (``NOISE_FLOOR``) count as flat: a ratio of
    two near-zero numbers says nothing.
    """
    if not (first == first and last == last):
        return "not measured"
    floor = NOISE_FLOOR.get(unit, 0.0)
    if abs(first) < floor and abs(last) < floor:
        return f"flat (both under {fmt(floor, unit)})"
    if first <= 0:
        return f"grows from {fmt(first, unit)}"
    ratio = last / first
    if abs(ratio - 1) <= FLAT_TOLERANCE:
        return f"flat (x{ratio:.2f})"
    return f"grows x{ratio:.1f}" if ratio > 1 else f"shrinks x{ratio:.2f}"


def trend_sentences(rows: list[Row], unit_word: str) -> list[str]:
    """One sentence per scenario: the per-rank value at the most ranks against the fewest."""
    sentences = []
    for scenario in dict.fromkeys(row.scenario for row in rows):
        mine = [row for row in rows if row.scenario == scenario and row.value == row.value]
        if len(mine) < 2:
            sentences.append(f"- {scenario}: fewer than two measured points, no trend.")
            continue
        low, high = min(mine, key=lambda r: r.ranks), max(mine, key=lambda r: r.ranks)
        sentence = (
            f"- {scenario}: per rank {trend(low.per_rank, high.per_rank, low.unit)} from "
            f"{low.ranks} to {high.ranks} {unit_word} ({fmt(low.per_rank, low.unit)} -> "
            f"{fmt(high.per_rank, high.unit)}); in all {trend(low.value, high.value, low.unit)}"
        )
        if low.rate:
            sentence += " (a rate: higher is better, so the cost per line moves the other way)"
        sentences.append(sentence + ".")
    return sentences


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(rank_rows: list[Row], nodes_rows: list[Row], ranks: list[int], lines: int) -> str:
    cores = os.cpu_count() or 1
    over = [n for n in ranks if n > cores]
    crowd = (
        f"; {', '.join(map(str, over))} ranks are oversubscribed "
        f"({', '.join(f'{n / cores:g}' for n in over)} per core)"
        if over
        else ""
    )
    body = [
        f'## Cost by number of CPU ranks (gloo, display="none"), {cores} cores{crowd}',
        "",
        table(
            ["scenario", "ranks", "value", "per rank", "note"],
            [
                [r.scenario, str(r.ranks), fmt(r.value, r.unit), fmt(r.per_rank, r.unit), r.note]
                for r in rank_rows
            ],
        ),
        "",
        *trend_sentences(rank_rows, "ranks"),
        "",
        f"## Multi-node relay on loopback: {RANKS_PER_NODE} ranks per node, {lines:,} lines per "
        "printing rank",
        "",
        table(
            ["nodes", "ranks", "value", "per printing rank", "note"],
            [
                [str(r.ranks), r.label, fmt(r.value, r.unit), fmt(r.per_rank, r.unit), r.note]
                for r in nodes_rows
            ],
        ),
        "",
        *trend_sentences(nodes_rows, "nodes"),
    ]
    return "\n".join(body) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="e.g. 2,4")
    parser.add_argument("--quick", action="store_true", help="small and short, for development")
    parser.add_argument("--lines", type=int, default=None, help="lines per printing rank")
    parser.add_argument("--out", type=Path, default=None, help="where to write the tables")
    # The scenario process's side (this file runs itself once per measurement).
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.lines is None:
        options.lines = QUICK_LINES if options.quick else LINES
    if options.repeats is None:
        options.repeats = 1 if options.quick else REPEATS
    if options.seconds is None:
        options.seconds = QUICK_HEARTBEAT_S if options.quick else HEARTBEAT_S
    if options.scenario:
        run_in_this_process(options)
        return

    started = time.perf_counter()
    ranks = sorted({int(part) for part in options.ranks.split(",") if part.strip()})
    rank_rows = [row for n in ranks for row in rows_for(n, options)]
    order = list(dict.fromkeys(row.scenario for row in rank_rows))
    rank_rows.sort(key=lambda row: (order.index(row.scenario), row.ranks))
    nodes_rows = node_rows(options)
    text = report(rank_rows, nodes_rows, ranks, options.lines)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    partial = options.quick or tuple(ranks) != DEFAULT_RANKS or options.lines != LINES
    header = (
        f"# bench_scale\n\n{stamp}, {time.perf_counter() - started:.0f} s, load average "
        f"{os.getloadavg()[0]:.1f} at the end"
        + (" (partial run: --quick, --ranks or --lines)" if partial else "")
        + ".\n\n"
    )
    print(header + text)
    out = options.out if options.out is not None else (None if partial else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + text)
        print(f"written to {out}")
    else:
        print("partial run: nothing written (pass --out PATH to keep it)")


if __name__ == "__main__":
    main()
