"""What ``cluster="slurm"`` decides before anything runs, as pure functions (no Slurm needed):
the options, which way the nodes start, the job's script and options, what the doctor says.

The runs themselves, against a real Slurm, are in ``test_slurm.py``.
"""

from __future__ import annotations

import shlex
import time

import pytest

from nblaunch import LaunchError, SlurmCluster
from nblaunch.cluster import node_start, placement, slurm_nodes
from nblaunch.engine.plan import slurm_env


def test_slurm_cluster_options_are_checked_when_made():
    with pytest.raises(LaunchError, match="nodes=0"):
        SlurmCluster(nodes=0)
    with pytest.raises(LaunchError, match="gpus_per_node='4'"):
        SlurmCluster(gpus_per_node="4")
    with pytest.raises(LaunchError, match="partition=''"):
        SlurmCluster(partition="")
    assert SlurmCluster(sbatch_args="--qos=debug --constraint=a100").sbatch_args == (
        "--qos=debug",
        "--constraint=a100",
    )


def test_the_job_asks_for_the_other_nodes_and_their_gpus():
    job = SlurmCluster(partition="gpu", time="1:00:00", account="lab", sbatch_args=("--qos=hi",))
    assert job.sbatch_options(2, "cuda", 4) == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--partition=gpu",
        "--time=1:00:00",
        "--account=lab",
        "--gpus-per-node=4",
        "--qos=hi",
    ]
    assert "--gpus-per-node" not in " ".join(SlurmCluster().sbatch_options(2, "cpu", 1))
    assert "--gpus-per-node=1" in SlurmCluster(gpus_per_node=1).sbatch_options(2, "cuda", 8)


def test_the_job_s_script_is_one_step_of_one_join_per_node():
    script = slurm_nodes.batch_script(2, "10.0.0.1:29500", "run-1")
    step = shlex.split(script.splitlines()[-1])
    assert step[:5] == ["exec", "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert step[-5:] == ["nblaunch", "join", "10.0.0.1:29500", "--run-id", "run-1"]
    assert "SECRET" not in script  # the secret travels in the job's environment


def test_slurm_inside_an_allocation_is_a_step_and_outside_a_job(monkeypatch, tmp_path):
    # Stand-ins: srun and sbatch are only looked for; scontrol knows the job and no config.
    scontrol = 'case "$*" in *"show job 12") echo "JobId=12 NumNodes=3"; exit 0;; esac; exit 1'
    for tool, script in (("srun", "exit 1"), ("sbatch", "exit 1"), ("scontrol", scontrol)):
        (tmp_path / tool).write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    given = "10.0.0.1:29500"
    assert placement.placed_by("slurm", 3, None, given)[:3] == (given, "slurm", 3)
    assert placement.placed_by(SlurmCluster(nodes=2), 1, None, given)[:3] == (given, "slurm", 3)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert placement.placed_by("slurm", 3, None, given)[:3] == (given, "srun", 3)
    # A SlurmCluster is a job of its own, even inside an allocation.
    assert placement.placed_by(SlurmCluster(), 3, None, given)[1] == "slurm"
    with pytest.raises(LaunchError, match=r"has 3 node\(s\).*salloc -N 4"):
        placement.placed_by("slurm", 4, None, given)
    with pytest.raises(LaunchError, match="num_nodes is nodes \\+ 1 = 3"):
        placement.placed_by(SlurmCluster(nodes=2), 4, None, given)
    with pytest.raises(LaunchError, match="pass num_nodes=N"):
        placement.placed_by("slurm", 1, None, given)
    with pytest.raises(LaunchError, match="leave start_nodes='ssh' out"):
        placement.placed_by("slurm", 3, "ssh", given)
    with pytest.raises(LaunchError, match="'slurm' or nblaunch.SlurmCluster"):
        placement.placed_by("kubernetes", 3, None, given)
    # Without an address given, it is this machine's toward slurmctld; no scontrol answers here.
    with pytest.raises(LaunchError, match="pass rdzv_endpoint="):
        placement.placed_by("slurm", 3, None, None)


def test_the_joins_srun_drops_the_notebook_step_s_slurm_variables():
    step = {
        "SLURM_JOB_ID": "12",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "n0",
        "SLURM_STEP_ID": "0",
        "PATH": "/usr/bin",
    }
    assert node_start.step_free_env(step) == {
        "SLURM_JOB_ID": "12",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "PATH": "/usr/bin",
    }


def test_a_job_s_state_reads_as_squeue_says_it():
    assert (
        slurm_nodes.JobState("PENDING", "Resources").describe("12") == "job 12 PENDING (Resources)"
    )
    running = slurm_nodes.JobState("RUNNING", "None", "n[1-2]")
    assert running.describe("12") == "job 12 RUNNING on n[1-2]"
    assert not running.ended and slurm_nodes.JobState("PREEMPTED").ended


def test_the_doctor_describes_the_allocation_from_slurm_s_environment():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_CPUS_PER_NODE": "8(x3)",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_STEP_NODELIST": "n1",
    }
    asked = []

    def slurm(argv: list[str]) -> str:
        asked.append(argv)
        if argv[0] == "scontrol":  # inside a step, the job's nodes are slurmctld's to say
            return "JobId=7 JobState=RUNNING Partition=gpu NodeList=n[1-3] NumNodes=3 NumCPUs=24"
        return "1:59:00"

    env["SLURM_JOB_NODELIST"] = "n1"  # the step's
    lines = slurm_env.report_lines(env, run=slurm)
    assert lines == [
        "  Slurm       job 7 (partition gpu): 3 node(s), n[1-3]",
        "    per node: 8(x3) CPU(s), 4 GPU(s) allocated",
        "    this process: step 7.0, 1 task(s) on n1",
        "    time left: 1:59:00",
        "    num_nodes up to 3 with cluster='slurm' (this node is node 0)",
    ]
    assert asked[1] == ["squeue", "-h", "-j", "7", "-o", "%L"]


@pytest.fixture
def scripted_slurm(tmp_path, monkeypatch):
    """Stand-ins for sbatch, scontrol and scancel: the job's state is a file the test writes;
    what sbatch got and scancel's calls are kept."""
    state = tmp_path / "state"
    scripts = {
        "sbatch": f'cat > {tmp_path}/script; echo "$@" > {tmp_path}/sbatch-args; echo 41',
        "scontrol": f"cat {state}",
        "scancel": f"echo \"$@\" >> {tmp_path}/cancelled; echo 'JobState=CANCELLED' > {state}",
    }
    for name, body in scripts.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(slurm_nodes, "POLL_S", 0.0)

    def job_is(text: str) -> None:
        state.write_text(f"JobId=41 {text} ExitCode=0:0 StdOut=/x\n")

    return tmp_path, job_is


def _job(folder, said: list) -> slurm_nodes.SlurmJob:
    return slurm_nodes.start_slurm_job(
        SlurmCluster(partition="gpu"),
        count=2,
        endpoint="10.0.0.1:29500",
        run_id="run-1",
        secret="s" * 32,
        log_dir=folder,
        device_type="cpu",
        nproc_per_node=1,
        news=lambda title, body: said.append(title),
    )


def test_a_job_s_state_is_shown_as_it_changes_and_its_end_before_the_nodes_fails_the_start(
    scripted_slurm,
):
    folder, job_is = scripted_slurm
    said: list[str] = []
    job = _job(folder, said)
    assert "--partition=gpu" in (folder / "sbatch-args").read_text()
    assert said == ["submitted Slurm job 41 for the other node(s)"]
    job_is("JobState=PENDING Reason=Resources")
    assert job.problem(2) is None and job.problem(2) is None
    job_is("JobState=RUNNING Reason=None NodeList=n[1-2]")
    assert job.problem(2) is None
    assert said[1:] == ["job 41 PENDING (Resources)", "job 41 RUNNING on n[1-2]"]
    (folder / "slurm-41.out").write_text("srun: error: n1: task 0: Exited with exit code 2\n")
    job_is("JobState=FAILED Reason=NonZeroExitCode")
    assert job.problem(2) == (
        f"Slurm job 41 FAILED (NonZeroExitCode); its log: {folder / 'slurm-41.out'} "
        "(srun: error: n1: task 0: Exited with exit code 2)"
    )


def test_a_pending_job_is_cancelled_at_once_and_a_pool_s_ended_job_submitted_again(
    scripted_slurm,
):
    folder, job_is = scripted_slurm
    said: list[str] = []
    job = _job(folder, said)
    job_is("JobState=PENDING Reason=Priority")
    began = time.monotonic()
    job.close(wait_s=30)  # pending: nothing to wait for
    assert time.monotonic() - began < 5
    assert (folder / "cancelled").read_text() == "41\n"
    assert said[-1] == "cancelled Slurm job 41"
    # A pool's job that ended between starts is submitted again; a running one is kept.
    job_is("JobState=RUNNING Reason=None")
    job.renew(2)
    assert said.count(said[0]) == 1
    job_is("JobState=TIMEOUT Reason=TimeLimit")
    job.renew(2)
    assert said.count("submitted Slurm job 41 for the other node(s)") == 2 and job.fresh


def test_a_failed_run_names_a_job_that_no_longer_runs(scripted_slurm):
    folder, job_is = scripted_slurm
    job = _job(folder, [])
    job_is("JobState=RUNNING Reason=None")
    assert job.note() is None  # the job is fine: the failure is the run's own
    job_is("JobState=PREEMPTED Reason=None")
    assert job.note().startswith("Slurm job 41 PREEMPTED; its log: ")
