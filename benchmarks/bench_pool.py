"""A trivial 2-rank cell on a persistent pool, against nbdistributed, ipyparallel, one-shot.

Run: ``.venv/bin/python benchmarks/bench_pool.py`` (the ``bench`` extra installs nbdistributed
and ipyparallel). Prints one markdown table.

Every row drives a fresh, real IPython kernel through jupyter_client (as nbclient and JupyterLab
do) and times cells from the execute request to the kernel going idle, as a person waits for
them. Per kernel:

- *plain cell*: ``pass`` run by the kernel itself, before the start and after the stop: the
  kernel's own cost, subtracted to give each approach's overhead;
- *start*: the cell that starts the workers (``%dist start -n 2``, ``%dist_init -n 2``, an
  ipyparallel ``Cluster(n=2)``), with the forkserver or engines started from cold;
- *first cell*: the first trivial cell after the start;
- *trivial cell*: the median of ``ROUNDS`` trivial cells (``pass`` on both ranks), live view
  included where the approach has one (nblaunch shows its widget for every cell), run back to
  back as "Run All" does; and again with ``PAUSE_S`` before each, as a person runs cells (what
  an approach does while the notebook is idle counts there: nblaunch's one-shot launch forks
  the next cell's ranks then);
- *printing cell*: ``print(rank)`` on both ranks (median of ``PRINT_ROUNDS``); a pool cell with
  something to show builds nblaunch's live widget, a quick silent one shows nothing;
- *rank error fails the cell*: a cell raising ``ValueError`` on rank 1 ends with an error reply
  (so "Run All" stops there) rather than printing it and succeeding.

The one-shot row runs ``%%distributed -n 2`` without a pool: every cell starts 2 ranks.
"""

from __future__ import annotations

import os
import queue
import shutil
import statistics
import sys
import tempfile
import time

ROUNDS = 30
ONE_SHOT_ROUNDS = 20
PRINT_ROUNDS = 10
PAUSE_S = 0.5
CELL_TIMEOUT_S = 180.0


class Kernel:
    """A real kernel; ``run`` returns (seconds, error name or None, printed text)."""

    def __init__(self, cwd: str) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        env = {**os.environ, "NBLAUNCH_RUN_DIR": os.path.join(cwd, "runs")}
        # nbdistributed starts its workers as "python" from PATH: as in an activated venv.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        self.manager.start_kernel(cwd=cwd, env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = CELL_TIMEOUT_S) -> tuple[float, str | None, str]:
        began = time.perf_counter()
        msg_id = self.client.execute(code)
        error: str | None = None
        text = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text += content["text"]
            elif kind == "error":
                error = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                elapsed = time.perf_counter() - began
                reply = self.client.get_shell_msg(timeout=timeout)
                while reply["parent_header"].get("msg_id") != msg_id:
                    reply = self.client.get_shell_msg(timeout=timeout)
                if reply["content"]["status"] == "error":
                    error = error or reply["content"].get("ename", "error")
                return elapsed, error, text
        raise TimeoutError(f"cell still running after {timeout:g} s: {code[:60]!r}")

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def times_ms(kernel: Kernel, code: str, rounds: int, pause_s: float = 0.0) -> list[float]:
    times = []
    for _ in range(rounds):
        time.sleep(pause_s)
        seconds, error, text = kernel.run(code)
        if error:
            raise RuntimeError(f"{code!r} failed: {error}: {text[-300:]}")
        times.append(seconds * 1000)
    return times


def median_ms(kernel: Kernel, code: str, rounds: int, pause_s: float = 0.0) -> float:
    return statistics.median(times_ms(kernel, code, rounds, pause_s))


def measure(
    name: str,
    setup: list[str],
    start: str,
    trivial: str,
    printing: str,
    failing: str,
    stop: str,
    restart: str = "",
) -> dict:
    """One row: plain, start, first, median trivial cell, error behaviour."""
    cwd = tempfile.mkdtemp(prefix="bench_pool_")
    kernel = Kernel(cwd)
    try:
        for code in setup:
            kernel.run(code)
        before = times_ms(kernel, "pass", ROUNDS)
        start_s, error, text = kernel.run(start)
        if error:
            raise RuntimeError(f"{name}: start failed: {error}: {text[-500:]}")
        first_s, error, text = kernel.run(trivial)
        if error:
            raise RuntimeError(f"{name}: first cell failed: {error}: {text[-500:]}")
        notes = ""
        if "rror" in text:  # printed an error, yet the cell "succeeded"
            notes = "first cell printed: " + text.strip().splitlines()[-1][:70]
        cell = median_ms(kernel, trivial, ROUNDS if start else ONE_SHOT_ROUNDS)
        paused = median_ms(kernel, trivial, ROUNDS if start else ONE_SHOT_ROUNDS, PAUSE_S)
        printed = median_ms(kernel, printing, PRINT_ROUNDS if start else ONE_SHOT_ROUNDS)
        _, error, _ = kernel.run(failing)
        if restart:  # a start with the forkserver (or engines) already warm
            restart_s, _, _ = kernel.run(restart)
            notes = f"`{restart}`: {restart_s:.2f} s"
        if stop:
            kernel.run(stop)
        # The kernel's own cost, before the start and after the stop: nbdistributed slows every
        # cell while its workers run (it sends cells without a magic to them, and syncs after).
        plain = statistics.median(before + times_ms(kernel, "pass", ROUNDS))
        return {
            "name": name,
            "start": start_s if start else None,
            "first": first_s * 1000,
            "cell": cell,
            "paused": paused,
            "plain": plain,
            "overhead": cell - plain,
            "printing": printed,
            "fails": "yes" if error else "no (printed, cell succeeds)",
            "notes": notes,
        }
    finally:
        kernel.close()
        shutil.rmtree(cwd, ignore_errors=True)


def available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> None:
    rows = []
    fail_rank_1 = "if rank == 1:\n    raise ValueError('boom on rank 1')"
    rows.append(
        measure(
            "nblaunch pool (`%dist start`, `%%distributed`)",
            ["%load_ext nblaunch"],
            "%dist start -n 2",
            "%%distributed\npass",
            "%%distributed\nprint(rank)",
            "%%distributed\n" + fail_rank_1,
            "%dist stop",
            restart="%dist restart",
        )
    )
    if available("nbdistributed"):
        rows.append(
            measure(
                "nbdistributed 0.1.0 (`%dist_init`, `%%distributed`)",
                ["%load_ext nbdistributed"],
                "%dist_init -n 2",
                "%%distributed\npass",
                "%%distributed\nprint(rank)",
                "%%distributed\n" + fail_rank_1,
                "%dist_shutdown",
            )
        )
    if available("ipyparallel"):
        rows.append(
            measure(
                "ipyparallel (`%%px` on 2 engines, blocking)",
                ["import ipyparallel as ipp"],
                "cluster = ipp.Cluster(n=2, log_level=40)\n"
                "rc = cluster.start_and_connect_sync(activate=True)\n"
                "rc.wait_for_engines(2, timeout=120)\n"
                "rc[:].block = True\n"
                "rc[:].scatter('rank', [0, 1], flatten=True)",
                "%%px\npass",
                "%%px\nprint(rank)",
                "%%px\n" + fail_rank_1,
                "cluster.stop_cluster_sync()",
            )
        )
    rows.append(
        measure(
            "nblaunch one-shot `%%distributed -n 2` (no pool)",
            ["%load_ext nblaunch", "%%distributed -n 2\npass"],  # warm the forkserver
            "",
            "%%distributed -n 2\npass",
            "%%distributed -n 2\nprint(rank)",
            "%%distributed -n 2\n" + fail_rank_1,
            "",
        )
    )
    print(
        f"Trivial 2-rank cell in a real kernel, CPU, median of {ROUNDS} cells "
        f"({ONE_SHOT_ROUNDS} for one-shot); overhead = trivial cell - plain `pass` cell "
        "in the same kernel."
    )
    print()
    print(
        "| approach | start 2 workers (s) | first cell (ms) | plain cell (ms) | trivial cell (ms) "
        f"| trivial cell, {PAUSE_S:g} s apart (ms) | overhead per cell (ms) "
        "| cell printing 1 line per rank (ms) "
        "| rank error fails the cell | notes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        start = "-" if row["start"] is None else f"{row['start']:.2f}"
        print(
            f"| {row['name']} | {start} | {row['first']:.1f} | {row['plain']:.1f} "
            f"| {row['cell']:.1f} | {row['paused']:.1f} "
            f"| {row['overhead']:.1f} | {row['printing']:.1f} | {row['fails']} | {row['notes']} |"
        )
    print()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
