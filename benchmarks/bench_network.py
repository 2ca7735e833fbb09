"""Multi-node faults on a real network: how long until each side says so, and the relay's rate.

Two hosts are Linux network namespaces joined by a veth pair (``tests/netns.py``; needs root and
``ip``): the notebook's side (``tests/netns_notebook.py``, 1 CPU rank, DDP on gloo) on one,
``python -m nblaunch join`` on the other. Each fault is made for real, and timed from the moment
it was made (one clock: both namespaces run on this machine):

- a partition: the joined host's link taken down while DDP trains;
- a blip: the link down for 2 s, then up again (the run must go on);
- the join SIGKILLed; the notebook's process SIGKILLed;
- the notebook's run failing after the start (rank 0 raises), and before it (interrupted while
  the nodes gather): from the notebook's end to the join's.

Then the relay: the joined node's rank prints ``--lines`` lines, across the veth and, for
comparison, on loopback (both sides in this namespace, on 127.0.0.2).

Then Slurm (``tests/slurm.py``: slurmctld and a slurmd in each of 3 namespaces; skipped, saying
why, without Slurm): the time from the cell's call to every rank running (each rank's function
began; one clock), 3 nodes of 1 CPU rank, the notebook's process on node 0 and new each time
(its first cell: the forkserver and every join import torch) then its second cell:

- inside an allocation (``salloc -N 3``, the notebook a step on its first node): ``cluster="slurm"``
  starts the other nodes' joins as an srun step;
- from outside one (a login node's notebook): ``SlurmCluster(partition="compute")`` submits
  them as a batch job, on an idle cluster.

Prints one markdown table per part.

    sudo python benchmarks/bench_network.py [--repeat 3] [--lines 50000] [--slurm-only]

``--ray-only`` measures runs whose other nodes a Ray cluster places instead (no root needed): a
``ray.cluster_utils.Cluster`` of 3 nodes on this machine (a head and two workers, each its own
raylet with 1 CPU), 1 rank per node, ``cluster="ray"``: the launch from the call to every
value (the first of the process, then the next ones), to a rank's own error from another node,
and to a lost node (its raylet removed while the ranks run) named, counted from the removal.

    python benchmarks/bench_network.py --ray-only [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from netns import Network, Side, alive, skip_reason  # noqa: E402
from slurm import Slurm  # noqa: E402
from slurm import skip_reason as slurm_skip_reason  # noqa: E402

PORT = 29400
NOTEBOOK = str(REPO / "tests" / "netns_notebook.py")


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class Trial:
    """One notebook and one join, on two namespaces (or on loopback, ``net=None``)."""

    def __init__(self, tmp: Path, net: Network | None, function: str, num_nodes: int = 2) -> None:
        host = net.addresses[0] if net else "127.0.0.2"
        self.endpoint = f"{host}:{PORT if net else free_port(host)}"
        self.run_id = f"bench{os.getpid()}{int(time.time() * 1000) % 100000}"
        self.net = net
        argv = [sys.executable, NOTEBOOK, self.endpoint, self.run_id, str(tmp / self.run_id)]
        self.notebook = Side(self._on(0, [*argv, function, str(num_nodes)]), tmp / "nb.log")
        join = [sys.executable, "-m", "nblaunch", "join", self.endpoint, "--run-id", self.run_id]
        self.join = Side(self._on(1, join), tmp / "join.log")

    def _on(self, host: int, argv: list[str]) -> list[str]:
        return self.net.command(host, *argv) if self.net else argv

    def until(self, predicate, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.notebook.first(predicate)
            if found:
                return found
            time.sleep(0.02)
        return None

    def training(self) -> None:
        if not self.until(lambda r: r.get("line") == "training", 90):
            raise RuntimeError(f"never trained:\n{self.notebook.output()[-2000:]}")

    def end(self, timeout: float) -> dict:
        found = self.until(lambda r: "end" in r, timeout)
        if found is None:
            raise RuntimeError(f"the notebook did not end:\n{self.notebook.output()[-2000:]}")
        return found

    def close(self) -> list[str]:
        """Stop what is left; return what was still running 15 s after the fault's outcome."""
        pids = self.notebook.tree() | self.join.tree()
        deadline = time.monotonic() + 15
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(pids)
        for side in (self.notebook, self.join):
            side.kill()
        return left


def partition(trial: Trial) -> dict:
    trial.training()
    fault = time.time()
    trial.net.link(1, up=False)
    end = trial.end(30)
    trial.join.wait(30)
    return {
        "notebook": end["t"] - fault,
        "join": (trial.join.ended_at or float("nan")) - fault,
        "ok": end.get("type") == "RankFailedError"
        and trial.join.line_with("lost the notebook") is not None,
    }


def blip(trial: Trial) -> dict:
    trial.training()
    trial.net.link(1, up=False)
    time.sleep(2.0)
    trial.net.link(1, up=True)
    end = trial.end(60)
    return {"notebook": None, "join": None, "ok": end["end"] == "returned"}


def join_killed(trial: Trial) -> dict:
    trial.training()
    ranks = trial.join.tree() - {trial.join.process.pid}
    fault = time.time()
    os.kill(trial.join.process.pid, signal.SIGKILL)
    end = trial.end(30)
    gone = time.monotonic() + 10
    while alive(ranks) and time.monotonic() < gone:
        time.sleep(0.05)
    return {"notebook": end["t"] - fault, "join": None, "ok": "node 1" in end.get("message", "")}


def notebook_killed(trial: Trial) -> dict:
    trial.training()
    fault = time.time()
    os.kill(trial.notebook.process.pid, signal.SIGKILL)  # its ranks follow (containment)
    trial.join.wait(30)
    return {
        "notebook": None,
        "join": (trial.join.ended_at or float("nan")) - fault,
        "ok": trial.join.line_with("lost the notebook") is not None,
    }


def fails_after_start(trial: Trial) -> dict:
    end = trial.end(120)
    trial.join.wait(30)
    return {
        "notebook": None,
        "join": (trial.join.ended_at or float("nan")) - end["t"],
        "ok": trial.join.line_with("stopped by the notebook: rank 0 raised ValueError") is not None,
    }


def fails_before_start(trial: Trial) -> dict:
    if not trial.until(lambda r: r.get("title", "").endswith(" joined"), 60):
        raise RuntimeError("the join never arrived")
    trial.notebook.process.send_signal(signal.SIGINT)
    end = trial.end(30)
    trial.join.wait(30)
    return {
        "notebook": None,
        "join": (trial.join.ended_at or float("nan")) - end["t"],
        "ok": trial.join.line_with("before it started: interrupted") is not None,
    }


FAULTS = [
    ("a partition (link down)", "ddp", 2, partition, "10 s", "15 s"),
    ("a 2 s blip (down, then up)", "short_ddp", 2, blip, "goes on", "goes on"),
    ("the join SIGKILLed", "ddp", 2, join_killed, "5 s", "-"),
    ("the notebook SIGKILLed", "ddp", 2, notebook_killed, "-", "15 s"),
    ("the run fails after the start", "fail_on_rank_0", 2, fails_after_start, "-", "5 s"),
    ("the run fails before the start", "short_ddp", 3, fails_before_start, "-", "5 s"),
]


def relay(tmp: Path, net: Network | None, count: int) -> float:
    trial = Trial(tmp, net, "lines")
    try:
        end = trial.end(300)
        began = end["results"][1][0]
        return count / (end["t"] - began)
    finally:
        trial.close()


def seconds(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return f"{statistics.median(known):.1f} s" + (
        f" ({min(known):.1f}-{max(known):.1f})" if len(known) > 1 else ""
    )


def ray_values():
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)


def ray_fails():
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise ValueError("rank 2 fails")
    dist.barrier()


def ray_waits(folder):
    import pathlib

    import torch.distributed as dist

    pathlib.Path(folder, f"{dist.get_rank()}.up").touch()
    time.sleep(600)


def ray_part(repeat: int) -> None:
    """The Ray rows (see the module's doc)."""
    import threading

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every daemon on 127.0.0.1
    import cloudpickle
    import ray
    from ray.cluster_utils import Cluster

    import nblaunch

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # no checkout on the nodes
    began = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    started = time.monotonic() - began
    launch = {"cluster": "ray", "num_processes": 1, "num_nodes": 3, "display": "none"}
    cold: list[float | None] = []
    warm: list[float | None] = []
    failed: list[float | None] = []
    lost: list[float | None] = []
    try:
        for attempt in range(repeat + 1):
            t = time.monotonic()
            assert nblaunch.notebook_launcher(ray_values, **launch) == [3.0] * 3
            (cold if attempt == 0 else warm).append(time.monotonic() - t)
        for _ in range(repeat):
            t = time.monotonic()
            try:
                nblaunch.notebook_launcher(ray_fails, **launch)
            except ValueError:
                failed.append(time.monotonic() - t)
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as folder:
                worker = next(iter(cluster.worker_nodes))
                removed: list[float] = []

                def remove(folder: str = folder, worker=worker, removed=removed) -> None:
                    deadline = time.monotonic() + 120
                    while len(os.listdir(folder)) < 3 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    removed.append(time.monotonic())
                    cluster.remove_node(worker)

                threading.Thread(target=remove, daemon=True).start()
                try:
                    nblaunch.notebook_launcher(ray_waits, (folder,), **launch)
                except (nblaunch.RankFailedError, nblaunch.LaunchError) as exc:
                    named = "node" in str(exc) and removed
                    lost.append(time.monotonic() - removed[0] if named else None)
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"Ray cluster of 3 nodes started in {started:.1f} s (not counted below)\n")
    print("| Ray, 3 nodes x 1 CPU rank | seconds |")
    print("|---|---|")
    print(f"| launch, first of the process (call to every value) | {seconds(cold)} |")
    print(f"| launch, the next ones | {seconds(warm)} |")
    print(f"| a rank's error on another node, from the call | {seconds(failed)} |")
    print(f"| a lost node (raylet removed) named, from the removal | {seconds(lost)} |")


# The notebook's side of a Slurm trial: two cells, each rank says when its function began.
SLURM_CELLS = """
import json, sys, time
import nblaunch

def began():
    import socket, time
    return time.time(), socket.gethostname()

cluster = eval(sys.argv[1])
for cell in range(2):
    start = time.time()
    ranks = nblaunch.notebook_launcher(began, num_processes=1, num_nodes=3, cluster=cluster,
                                       display="none")
    print(json.dumps({"cell": cell, "start": start, "ranks": ranks}), flush=True)
"""


def slurm_trial(cluster: Slurm, folder: Path, where: str) -> list[float]:
    """The seconds from each of the two cells' call to its last rank running."""
    import json
    import re
    import subprocess

    argv = [sys.executable, "-c", SLURM_CELLS]
    job = None
    if where == "allocation":
        said = subprocess.run(
            cluster.command(0, "salloc", "--no-shell", "-p", "all", "-N", "3"),
            capture_output=True, text=True, env=cluster.env, timeout=60, cwd=folder,
        )  # fmt: skip
        job = re.search(r"allocation (\d+)", said.stderr).group(1)
        step = ["srun", f"--jobid={job}", "-N1", "-n1", f"--nodelist={cluster.nodes[0]}"]
        command = cluster.command(0, *step, *argv, "'slurm'")
    else:
        command = cluster.command(0, *argv, "nblaunch.SlurmCluster(partition='compute')")
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, env=cluster.env, timeout=300, cwd=folder
        )
    finally:
        if job:
            cluster.run(0, "scancel", job)
    cells = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if len(cells) != 2:
        raise RuntimeError(f"the cells did not finish:\n{out.stderr[-3000:]}")
    hosts = [host for _, host in cells[0]["ranks"]]
    assert hosts == cluster.nodes, hosts  # node 0 here, the others where Slurm put them
    return [max(t for t, _ in cell["ranks"]) - cell["start"] for cell in cells]


def bench_slurm(repeat: int) -> None:
    reason = slurm_skip_reason()
    if reason:
        print(f"Slurm: not run ({reason})")
        return
    rows = {("allocation", 0): [], ("allocation", 1): [], ("job", 0): [], ("job", 1): []}
    with tempfile.TemporaryDirectory() as tmp:
        network = Network(3)
        try:
            cluster = Slurm(network, Path(tmp))
            try:
                for _ in range(repeat):
                    for where in ("allocation", "job"):
                        first, second = slurm_trial(cluster, Path(tmp), where)
                        rows[where, 0].append(first)
                        rows[where, 1].append(second)
                        wait = time.monotonic() + 30  # idle again before the next trial
                        while not cluster.idle() and time.monotonic() < wait:
                            time.sleep(0.2)
            finally:
                cluster.close()
        finally:
            network.close()
    print("| Slurm, 3 nodes x 1 CPU rank: from the cell to every rank running | seconds |")
    print("|---|---|")
    names = {
        "allocation": "inside an allocation: `cluster='slurm'` (an srun step)",
        "job": "from a login node: `SlurmCluster(partition=...)` (a batch job, idle cluster)",
    }
    for where, name in names.items():
        print(f"| {name}, first cell | {seconds(rows[where, 0])} |")
        print(f"| {name}, next cell | {seconds(rows[where, 1])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--ray-only", action="store_true", help="only the Ray part")
    parser.add_argument("--slurm-only", action="store_true", help="only the Slurm part")
    args = parser.parse_args()
    if args.ray_only:
        ray_part(args.repeat)
        return
    reason = skip_reason()
    if reason:
        sys.exit(f"bench_network: {reason}")
    os.environ["PYTHONPATH"] = str(REPO)
    if args.slurm_only:
        bench_slurm(args.repeat)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, function, nodes, measure, want_nb, want_join in FAULTS:
            results = []
            for _ in range(args.repeat):
                net = Network(2)
                try:
                    trial = Trial(Path(tmp), net, function, nodes)
                    try:
                        result = measure(trial)
                    finally:
                        result_left = trial.close()
                    result["left"] = result_left
                    results.append(result)
                finally:
                    net.close()
            rows.append(
                (
                    name,
                    seconds([r["notebook"] for r in results]),
                    want_nb,
                    seconds([r["join"] for r in results]),
                    want_join,
                    f"{sum(r['ok'] for r in results)}/{len(results)}",
                    str(sum(len(r["left"]) for r in results)),
                )
            )
        print(
            "| fault | notebook says so after | asked | join ends after | asked | message right"
            " | processes left |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
        net = Network(2)
        try:
            veth = [relay(Path(tmp), net, args.lines) for _ in range(args.repeat)]
        finally:
            net.close()
        loop = [relay(Path(tmp), None, args.lines) for _ in range(args.repeat)]
        print(f"| relay of a joined node's rank ({args.lines} lines) | lines/s |")
        print("|---|---|")
        print(f"| across the veth | {statistics.median(veth):,.0f} |")
        print(f"| on loopback (127.0.0.2) | {statistics.median(loop):,.0f} |")
    print()
    bench_slurm(args.repeat)


if __name__ == "__main__":
    main()
