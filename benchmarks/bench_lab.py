"""The runs panel's server: list reads against many ended runs, a line's way to the panel, leaks.

Run: ``.venv/bin/python benchmarks/bench_lab.py`` (about two minutes on 2 cores). The table is
printed and written to ``benchmarks/results/bench_lab.md`` (``--out PATH`` elsewhere, ``--out -``
nowhere). ``PYTHONPATH=<another checkout>`` measures that checkout's server with the same script
(the "before" of a change).

- **list read**: ``RunsIndex(root).records()`` in this process (the server's time, without HTTP)
  with N ended detached runs in the registry and N ended kernel runs under the root, each a copy
  of one real 2-rank run of 1,000 steps (its ``history.pkl``, rank logs, ``metrics.jsonl``): the
  first read, the time until a read lists every run whole (reads 0.5 s apart), and the median
  and the worst of the next five.
- **a line's way**: a detached run prints a line with its time every 0.05 s; a real Jupyter
  server's event stream (``/nblaunch/api/runs/<id>/events``) is read as the panel reads it, and
  each line's time from the rank's print to its arrival here is taken (median, p90).
- **leaks**: the server's open fds and threads before and after 100 views of that run opened
  (the stream's first event read) and closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_lab.md"
COUNTS = (10, 100, 400)
# The steps of the run every planted run copies (a line and a metric each, on 2 ranks).
MODEL_STEPS = 1000

TRAIN = """
import sys, time, nblaunch
def train(steps, pause_s):
    import torch.distributed as dist
    for step in range(steps):
        nblaunch.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        print(f"LINE {time.time():.6f} step {step} " + "x" * 60, flush=True)
        time.sleep(pause_s)
    return dist.get_rank()
handle = nblaunch.notebook_launcher(
    train, (int(sys.argv[1]), float(sys.argv[2])), 2,
    detach=True, display="none", device_type="cpu",
)
print(handle.id, flush=True)
"""


def start_detached(work: Path, steps: int, pause_s: float) -> str:
    (work / "train.py").write_text(TRAIN)
    done = subprocess.run(
        [sys.executable, "train.py", str(steps), str(pause_s)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def wait_ended(registry: Path, run_id: str, limit_s: float = 120.0) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        entry = json.loads((registry / f"{run_id}.json").read_text())
        if entry["state"] not in ("running", "starting"):
            return entry
        time.sleep(0.2)
    raise AssertionError(f"{run_id} did not end")


def plant(root: Path, registry: Path, model: dict, count: int) -> None:
    """``count`` ended detached runs (copies of ``model``) and ``count`` ended kernel runs."""
    source = Path(model["run_dir"])
    detached_base = root / "detached-runs"
    kernel_base = root / ".nblaunch" / "runs"
    for i in range(count):
        name = (
            f"20261201-{i // 3600 % 24:02d}{i // 60 % 60:02d}{i % 60:02d}-{i:06d}-{i % 65536:04x}"
        )
        run_dir = detached_base / f"d{name}"
        shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns("*.sock", ".lease"))
        entry = dict(model, run_id=f"d{name}", run_dir=str(run_dir), pid=2**22 + i)
        entry["started_at"] = model["started_at"] - i
        (registry / f"d{name}.json").write_text(json.dumps(entry))
        kernel_dir = kernel_base / name
        kernel_dir.mkdir(parents=True)
        for log in (*source.glob("rank*.log"), source / "metrics.jsonl"):
            shutil.copy(log, kernel_dir / log.name)


def list_reads(root: Path) -> tuple[float, float, float, float, int]:
    """The first read; how long until a read shows every run whole (a read may list some
    "pending", made by a thread meanwhile); then the median and worst of five reads."""
    from nblaunch.lab.runs import RunsIndex

    index = RunsIndex(root)
    began = time.perf_counter()
    listed = index.records()
    first = time.perf_counter() - began
    while any(record.get("pending") for record in listed):
        time.sleep(0.5)  # the panel's reads are 2 s apart
        listed = index.records()
    whole = time.perf_counter() - began
    times = []
    for _ in range(5):
        began = time.perf_counter()
        index.records()
        times.append(time.perf_counter() - began)
    index.close()
    return first, whole, statistics.median(times), max(times), len(listed)


def stop_host(pid: int) -> None:
    """End a run host that is still there (one that stopped may still write its outcome):
    SIGTERM, 15 s, SIGKILL. Its directory must not go first: it would wait for a notebook."""

    def alive() -> bool:
        with contextlib.suppress(OSError):
            return b"nblaunch.host" in Path(f"/proc/{pid}/cmdline").read_bytes()
        return False

    if alive():
        os.kill(pid, 15)
    deadline = time.monotonic() + 15
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive():
        os.kill(pid, 9)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(base: Path, root: Path) -> tuple[subprocess.Popen, str, str]:
    config = base / "config" / "jupyter_server_config.d"
    config.mkdir(parents=True)
    (config / "nblaunch.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"nblaunch.lab": True}}})
    )
    port, token = free_port(), secrets.token_hex(8)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
         "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(base / "server.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).close()
            return server, url, token
        except OSError:
            time.sleep(0.3)
    raise AssertionError("the server did not start")


def counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def line_way(url: str, token: str, run_id: str, seconds: float) -> list[float]:
    """Each new line's delay from the rank's print to its arrival through the event stream."""
    request = urllib.request.Request(
        f"{url}/nblaunch/api/runs/{run_id}/events", headers={"Authorization": f"token {token}"}
    )
    delays, seen = [], set()
    deadline = time.monotonic() + seconds
    with urllib.request.urlopen(request, timeout=30) as stream:
        while time.monotonic() < deadline and (line := stream.readline()):
            if not line.startswith(b"data: "):
                continue
            now = time.time()
            for _, text in json.loads(line[6:])["view"]["lines"]:
                if text.startswith("LINE ") and text not in seen:
                    seen.add(text)
                    delays.append(now - float(text.split()[1]))
    return delays[20:]  # the first picture holds the lines before the stream opened


def open_and_close(url: str, token: str, run_id: str, times: int) -> None:
    headers = {"Authorization": f"token {token}"}
    for _ in range(times):
        request = urllib.request.Request(f"{url}/nblaunch/api/runs/{run_id}/events", None, headers)
        with urllib.request.urlopen(request, timeout=30) as stream:
            while not stream.readline().startswith(b"data: "):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    args = parser.parse_args()
    import nblaunch

    base = Path(tempfile.mkdtemp(prefix="bench-lab-"))
    registry, work = base / "detached", base / "work"
    work.mkdir()
    os.environ["NBLAUNCH_DETACHED_DIR"] = str(registry)
    os.environ.pop("NBLAUNCH_RUN_DIR", None)
    rows = [f"nblaunch from {Path(nblaunch.__file__).parent}", ""]
    try:
        model = wait_ended(registry, start_detached(work, MODEL_STEPS, 0.002))
        rows += [
            "| ended runs (detached + kernel) | listed | first read | all whole after "
            "| median of 5 | worst |"
        ]
        rows += ["|---|---|---|---|---|---|"]
        for count in map(int, args.counts.split(",")):
            root = base / f"root{count}"
            root.mkdir()
            for stale in registry.glob("d*.json"):
                stale.unlink()
            plant(root, registry, model, count)
            first, whole, median, worst, listed = list_reads(root)
            rows.append(
                f"| {count} + {count} | {listed} | {first * 1e3:.0f} ms | {whole * 1e3:.0f} ms "
                f"| {median * 1e3:.1f} ms | {worst * 1e3:.1f} ms |"
            )
            print(rows[-1], flush=True)
        for stale in registry.glob("d*.json"):
            stale.unlink()
        server, url, token = start_server(base, work)
        try:
            run_id = start_detached(work, 100_000, 0.05)
            time.sleep(3)
            delays = sorted(line_way(url, token, run_id, 15.0))
            median = statistics.median(delays)
            p90 = delays[int(len(delays) * 0.9)]
            rows += ["", f"a line from a rank to the panel's stream: median {median * 1e3:.0f} ms, "
                     f"p90 {p90 * 1e3:.0f} ms ({len(delays)} lines)"]  # fmt: skip
            print(rows[-1], flush=True)
            before = counts(server.pid)
            open_and_close(url, token, run_id, 100)
            time.sleep(2)
            after = counts(server.pid)
            rows.append(
                f"server fds {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]} "
                "after 100 views opened and closed"
            )
            print(rows[-1], flush=True)
            with urllib.request.urlopen(
                urllib.request.Request(
                    f"{url}/nblaunch/api/runs/{run_id}/stop",
                    b"",
                    {"Authorization": f"token {token}"},
                ),
                timeout=30,
            ):
                pass
        finally:
            server.terminate()
            server.wait(15)
    finally:
        for path in registry.glob("*.json"):  # no host outlives the benchmark (nor its dir)
            with contextlib.suppress(OSError, ValueError, KeyError):
                stop_host(json.loads(path.read_text())["pid"])
        shutil.rmtree(base, ignore_errors=True)
    text = "\n".join(rows) + "\n"
    if args.out != "-":
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
