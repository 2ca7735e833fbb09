"""Runs whose other nodes a real Slurm places: a step of the notebook's allocation, or a job.

One Slurm for the session (``tests/slurm.py``): slurmctld and a slurmd in each of 3 network
namespaces, each namespace its own host name and address; munge for auth; no cgroups. Two
notebooks, each a real IPython kernel on node 0:

- ``allocation``: the kernel is a step of ``salloc -N 3`` on the first node, as Jupyter under
  ``salloc``/``srun`` or Open OnDemand runs; ``cluster="slurm"`` (or ``start_nodes="srun"``)
  starts the other nodes' joins with srun, through the other nodes' slurmd;
- ``login``: the kernel on node 0 outside any job, as on a login node; ``SlurmCluster`` submits
  the other nodes as a batch job on the ``compute`` partition (nodes 1 and 2).

Faults are Slurm's own: ``scancel`` of the joins' step, a job preempted by a job of a partition
of a higher tier, a job pending behind another. Run alone with ``make test-slurm`` (``pytest -m
slurm``); skipped, saying why, where Slurm is not installed or namespaces cannot be made.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until
from netns import Network
from slurm import NodeKernel, Slurm, skip_reason

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
_reason = skip_reason() if sys.platform == "linux" else "Slurm's test cluster is Linux only"
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))

# Every cell's function: each rank's rank, host name and Slurm job and step.
WHERE = """
import os, socket, time
import nblaunch

def where():
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    env = os.environ
    return (dist.get_rank(), socket.gethostname(), env.get("SLURM_JOB_ID"),
            env.get("SLURM_STEP_ID"), float(total))

def fails_on_rank_2():
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise ValueError("boom on rank 2")
    dist.barrier()

def trains(seconds=120):
    import torch
    import torch.distributed as dist

    for step in range(int(seconds * 20)):
        dist.all_reduce(torch.ones(1))
        if step == 5:
            print(f"rank {dist.get_rank()} training", flush=True)
        time.sleep(0.05)
"""


# Module-scoped: its daemons are children of this test process, and the tests that follow in
# it check that no child of theirs is left (conftest.rank_children).
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    network = Network(3)
    try:
        cluster = Slurm(network, folder)
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        network.close()


@pytest.fixture(scope="class")
def allocation(slurm, tmp_path_factory):
    """A kernel as a step of ``salloc -N 3`` on its first node; the job id beside it. Given
    back after the class's tests: the job tests need the nodes whole."""
    salloc = slurm.command(0, "salloc", "--no-shell", "-p", "all", "-N", "3", "--no-kill")
    said = subprocess.run(salloc, capture_output=True, text=True, env=slurm.env, timeout=30)
    job = re.search(r"Granted job allocation (\d+)", said.stderr)
    assert job, said.stderr
    job_id = job.group(1)
    step = ["srun", f"--jobid={job_id}", "--nodes=1", "--ntasks=1", "--input=none"]
    step.append(f"--nodelist={slurm.nodes[0]}")
    folder = tmp_path_factory.mktemp("alloc")
    kernel = NodeKernel(folder, folder, slurm.command(0, *step), slurm.env, True)
    try:
        assert kernel.run(WHERE)["error"] is None
        yield kernel, job_id
    finally:
        kernel.close()
        slurm.run(0, "scancel", job_id)


@pytest.fixture(scope="class")
def login(slurm, tmp_path_factory):
    """A kernel on node 0, outside any job (a login node's notebook)."""
    folder = tmp_path_factory.mktemp("login")
    kernel = NodeKernel(folder, folder, slurm.command(0), slurm.env)
    try:
        assert kernel.run(WHERE)["error"] is None
        yield kernel
    finally:
        kernel.close()


def steps(slurm: Slurm, job_id: str) -> list[str]:
    """The job's running steps (``1234.0``), the kernel's included."""
    out = slurm.run(0, "squeue", "-h", "-s", "-j", job_id, "-o", "%i")
    return [line.strip() for line in out.splitlines() if line.strip()]


def job_field(slurm: Slurm, job_id: str, name: str) -> str:
    line = slurm.run(0, "scontrol", "-o", "show", "job", job_id)
    found = re.search(rf"\b{name}=(\S*)", line)
    return found.group(1) if found else ""


def our_jobs(slurm: Slurm) -> list[tuple[str, str, str]]:
    """``(id, state, reason)`` of the jobs nblaunch submitted that Slurm still holds."""
    out = slurm.run(0, "squeue", "-h", "-o", "%i|%T|%r|%j")
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return [(row[0], row[1], row[2]) for row in rows if row[3].startswith("nblaunch-")]


def runs(kernel: NodeKernel) -> set[Path]:
    """The kernel's run directories."""
    return set((kernel.cwd / ".nblaunch" / "runs").glob("*"))


def training(kernel: NodeKernel, before: set[Path]) -> bool:
    """Whether every rank of the kernel's run started since ``before`` (its run directories
    then) said it trains (every rank's log is in the notebook's run directory)."""
    new = runs(kernel) - before
    logs = [run / f"rank{rank}.log" for run in new for rank in range(3)]
    return bool(logs) and all(log.exists() and "training" in log.read_text() for log in logs)


def later(delay_until, action) -> threading.Thread:
    """Run ``action`` on a thread once ``delay_until()`` is true (within 60 s)."""

    def go() -> None:
        if wait_until(delay_until, 60):
            action()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


# --- inside an allocation ------------------------------------------------------------------------


class TestInsideAnAllocation:
    """A notebook inside ``salloc -N 3``: the other nodes are a step of its job."""

    def test_inside_an_allocation_srun_starts_every_other_node_and_each_rank_returns(
        self, slurm, allocation
    ):
        kernel, job_id = allocation
        cell = kernel.run(
            "print(nblaunch.notebook_launcher(where, num_processes=1, num_nodes=3, "
            "cluster='slurm', display='text'))",
            timeout=90,
        )
        assert cell["error"] is None, cell["message"] + cell["out"]
        values = eval(cell["out"].strip().splitlines()[-1])
        assert [(r, host, job, total) for r, host, job, _, total in values] == [
            (0, slurm.nodes[0], job_id, 6.0),
            (1, slurm.nodes[1], job_id, 6.0),
            (2, slurm.nodes[2], job_id, 6.0),
        ]
        # Nodes 1 and 2 ran in one step of their own, which slurmd started; the kernel in another.
        kernel_step, join_step = values[0][3], values[1][3]
        assert values[2][3] == join_step and join_step != kernel_step
        assert "srun started join on the other node(s)" in cell["out"]
        for node in slurm.nodes[1:]:
            log = (slurm.folder / "log" / f"slurmd-{node}.log").read_text()
            assert f"launch task StepId={job_id}.{join_step} " in log
        # The step ends with the run.
        assert wait_until(lambda: steps(slurm, job_id) == [f"{job_id}.{kernel_step}"], 15)

    def test_a_rank_s_error_on_another_node_of_the_allocation_is_that_rank_s_own(
        self, slurm, allocation
    ):
        kernel, _ = allocation
        endpoint = f"{slurm.network.addresses[0]}:29431"
        cell = kernel.run(
            "nblaunch.notebook_launcher(fails_on_rank_2, num_processes=1, num_nodes=3, "
            f"start_nodes='srun', rdzv_endpoint='{endpoint}', display='text')",
            timeout=90,
        )
        assert cell["error"] == "ValueError" and cell["message"] == "boom on rank 2"
        assert "rank 2" in "\n".join(cell["traceback"])
        assert cell["seconds"] < 40

    def test_a_step_cancelled_mid_run_names_the_nodes_it_took(self, slurm, allocation):
        kernel, job_id = allocation
        before = steps(slurm, job_id)
        cancelled: dict[str, float] = {}

        def cancel() -> None:
            step = next(s for s in steps(slurm, job_id) if s not in before)
            cancelled["at"] = time.monotonic()
            slurm.run(0, "scancel", step)

        old = runs(kernel)
        thread = later(lambda: training(kernel, old), cancel)
        cell = kernel.run(
            "nblaunch.notebook_launcher(trains, num_processes=1, num_nodes=3, cluster='slurm', "
            "display='text', hang_timeout=60)",
            timeout=120,
        )
        thread.join(5)
        assert "at" in cancelled, cell["out"]
        said = cell["message"] + "\n".join(cell["traceback"]) + cell["out"]
        assert cell["error"] == "RankFailedError", said[-3000:]
        # scancel of a step SIGKILLs its tasks: the nodes go silent (found by their silence, or
        # sooner by a rank's lost connection), and the notebook says which and, from srun, how
        # their step ended.
        hosts = f"(?:{slurm.nodes[1]}|{slurm.nodes[2]})"
        lost = rf"node [12] \({hosts} at [\d.]+\), rank [12], (?:sent nothing|went silent)"
        assert re.search(lost, said), said[-3000:]
        assert re.search(rf"srun step ended .*STEP {job_id}\.\d+ ON \S+ CANCELLED", said), said[
            -3000:
        ]
        assert time.monotonic() - cancelled["at"] < 25

    def test_the_interrupt_button_ends_the_run_and_its_step(self, slurm, allocation):
        kernel, job_id = allocation
        before = steps(slurm, job_id)
        pressed: dict[str, float] = {}

        def press() -> None:
            pressed["at"] = time.monotonic()
            kernel.manager.interrupt_kernel()

        old = runs(kernel)
        thread = later(lambda: training(kernel, old), press)
        cell = kernel.run(
            "nblaunch.notebook_launcher(trains, num_processes=1, num_nodes=3, cluster='slurm', "
            "display='text')",
            timeout=120,
        )
        thread.join(5)
        assert "at" in pressed and cell["error"] == "KeyboardInterrupt", cell["out"][-2000:]
        assert wait_until(lambda: steps(slurm, job_id) == before, 20), steps(slurm, job_id)
        assert time.monotonic() - pressed["at"] < 30

    def test_the_doctor_says_what_it_sees_of_the_allocation(self, slurm, allocation):
        kernel, job_id = allocation
        cell = kernel.run("from nblaunch.engine.plan import doctor\nprint(doctor.report())")
        assert cell["error"] is None, cell["message"]
        nodes = f"{slurm.nodes[0][:-2]}h[0-2]"
        assert f"Slurm       job {job_id} (partition all): 3 node(s), {nodes}" in cell["out"]
        assert "per node: 1(x3) CPU(s), no GPU(s) allocated" in cell["out"]
        assert f"this process: step {job_id}.0, 1 task(s) on {slurm.nodes[0]}" in cell["out"]
        assert "time left: " in cell["out"] and "num_nodes up to 3" in cell["out"]


# --- from outside an allocation: a job ------------------------------------------------------------


class TestAJobOfTheirOwn:
    """A login node's notebook: the other nodes are a batch job it submits."""

    def test_a_job_holds_the_other_nodes_and_completes_with_the_run(self, slurm, login):
        cell = login.run(
            "print(nblaunch.notebook_launcher(where, num_processes=1, num_nodes=3, display='text', "
            "cluster=nblaunch.SlurmCluster(partition='compute', time='5')))",
            timeout=90,
        )
        assert cell["error"] is None, cell["message"] + cell["out"]
        values = eval(cell["out"].strip().splitlines()[-1])
        job_id = values[1][2]
        assert [(r, host, job, total) for r, host, job, _, total in values] == [
            (0, slurm.nodes[0], None, 6.0),
            (1, slurm.nodes[1], job_id, 6.0),
            (2, slurm.nodes[2], job_id, 6.0),
        ]
        assert f"submitted Slurm job {job_id}" in cell["out"]
        assert re.search(rf"job {job_id} RUNNING on {slurm.nodes[0][:-2]}h\[1-2\]", cell["out"])
        assert job_field(slurm, job_id, "TimeLimit") == "00:05:00"
        # The joins end with the run; so does the job, by itself.
        assert wait_until(lambda: job_field(slurm, job_id, "JobState") == "COMPLETED", 15)

    def test_a_pending_job_is_shown_while_it_waits_and_cancelled_by_the_interrupt(
        self, slurm, login
    ):
        blocker = slurm.run(
            0, "sbatch", "--parsable", "-N", "2", "--exclusive", "--wrap", "sleep 300"
        )
        try:
            pressed: dict[str, float] = {}

            def pending() -> bool:
                return any(
                    state == "PENDING" for _, state, _ in our_jobs(slurm)
                ) and not time.sleep(2)

            def press() -> None:
                pressed["at"] = time.monotonic()
                login.manager.interrupt_kernel()

            thread = later(pending, press)
            cell = login.run(
                "nblaunch.notebook_launcher(where, num_processes=1, num_nodes=3, display='text', "
                "cluster='slurm')",
                timeout=90,
            )
            thread.join(5)
            assert "at" in pressed and cell["error"] == "KeyboardInterrupt", cell["out"][-2000:]
            found = re.search(r"job (\d+) PENDING \((Resources|Priority)\)", cell["out"])
            assert found, cell["out"][-2000:]
            job_id = found.group(1)
            assert f"cancelled Slurm job {job_id}" in cell["out"]
            assert job_field(slurm, job_id, "JobState") == "CANCELLED"
            assert time.monotonic() - pressed["at"] < 15
        finally:
            slurm.run(0, "scancel", blocker.strip())
        assert wait_until(slurm.idle, 20)

    def test_a_job_refused_or_preempted_is_named_with_slurm_s_reason_and_log(self, slurm, login):
        cell = login.run(
            "nblaunch.notebook_launcher(where, num_processes=1, num_nodes=3, display='text', "
            "cluster=nblaunch.SlurmCluster(partition='nosuch'))",
            timeout=60,
        )
        assert cell["error"] == "LaunchError"
        assert "Slurm refused the job" in cell["message"], cell["message"]
        assert "invalid partition" in cell["message"].lower(), cell["message"]
        preempted: dict[str, float] = {}

        def preempt() -> None:  # a job of a higher tier takes the nodes
            preempted["at"] = time.monotonic()
            urgent = ["sbatch", "-p", "urgent", "-N", "2", "--exclusive", "--wrap", "sleep 1"]
            slurm.run(0, *urgent)

        old = runs(login)
        thread = later(lambda: training(login, old), preempt)
        cell = login.run(
            "nblaunch.notebook_launcher(trains, num_processes=1, num_nodes=3, display='text', "
            "cluster='slurm', hang_timeout=60)",
            timeout=120,
        )
        thread.join(5)
        assert "at" in preempted and cell["error"] is not None, cell["out"][-2000:]
        said = cell["message"] + "\n".join(cell["traceback"]) + cell["out"]
        # The nodes' joins say SIGTERM (once, though Slurm sends more), the job its end.
        assert "terminated on this node (SIGTERM: Slurm ended its step or job" in said, said[-3000:]
        ended = r"Slurm job \d+ PREEMPTED.*its log: \S+slurm-\d+\.out \(.*DUE TO PREEMPTION \*\*\*"
        assert re.search(ended, said), said[-3000:]
        assert time.monotonic() - preempted["at"] < 30
        assert wait_until(slurm.idle, 20)

    def test_a_pool_keeps_its_job_across_cells_and_gives_it_back_when_it_stops(self, slurm, login):
        started = login.run(
            "%load_ext nblaunch\n"
            "pool = nblaunch.start_pool(1, num_nodes=3, cluster='slurm', display='text')",
            timeout=90,
        )
        assert started["error"] is None, started["message"] + started["out"]
        [(job_id, state, _)] = our_jobs(slurm)
        assert state == "RUNNING"
        first = login.run(
            "%%distributed\nimport os, socket\nseen = (rank, socket.gethostname(), "
            "os.environ.get('SLURM_JOB_ID'))\nrank",
            timeout=60,
        )
        assert first["error"] is None, first["message"] + first["out"]
        # The next cell reads what the first left on each rank: the same processes, the same job.
        second = login.run(
            "%%distributed\nimport torch.distributed as dist\neveryone = [None] * world_size\n"
            "dist.all_gather_object(everyone, seen)\neveryone",
            timeout=60,
        )
        assert second["error"] is None, second["message"]
        assert eval(second["result"]) == [
            (0, slurm.nodes[0], None),
            (1, slurm.nodes[1], job_id),
            (2, slurm.nodes[2], job_id),
        ]
        pulled = login.run("print(pool.pull('seen', rank=0), pool.pull('seen', rank=2))")
        assert (
            pulled["out"].split("\n")[0]
            == f"(0, {slurm.nodes[0]!r}, None) (2, {slurm.nodes[2]!r}, {job_id!r})"
        )
        assert our_jobs(slurm) == [(job_id, "RUNNING", "None")]  # the same job, across cells
        closed = login.run("pool.close()", timeout=60)
        assert closed["error"] is None, closed["message"]
        assert wait_until(lambda: our_jobs(slurm) == [], 20)
        assert job_field(slurm, job_id, "JobState") == "COMPLETED"

    def test_the_doctor_lists_the_partitions_a_job_can_go_to(self, slurm, login):
        cell = login.run("from nblaunch.engine.plan import doctor\nprint(doctor.report())")
        assert cell["error"] is None, cell["message"]
        assert "Slurm       not in an allocation;" in cell["out"]
        assert re.search(r"compute\* up 2 2 ", cell["out"]), cell["out"]
