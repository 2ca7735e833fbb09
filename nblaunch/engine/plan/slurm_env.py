"""What the doctor sees of Slurm: the allocation this process runs in, or the cluster it can
submit to (``nblaunch env``, ``%dist env``).

Inside an allocation (``SLURM_JOB_ID`` set: ``salloc``, a batch job, a step, Open OnDemand) it
asks ``scontrol`` for the job's partition and nodes (inside a step the environment's
``SLURM_JOB_NODELIST`` is the step's), reads the CPUs and GPUs of each node and the step this
process is from the environment, and asks ``squeue`` how long the job has left. Outside one, it
says whether Slurm's commands are here and which partitions ``sinfo`` lists: ``cluster="slurm"``
would submit a job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable

Runner = Callable[[list[str]], str]


def _run(argv: list[str]) -> str:
    """A Slurm command's output; empty when it fails or takes over 10 s."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout if result.returncode == 0 else ""


def report_lines(environ: dict[str, str] | None = None, run: Runner = _run) -> list[str]:
    """The report's Slurm lines (none where Slurm is neither here nor around this process)."""
    env = dict(os.environ if environ is None else environ)
    job = env.get("SLURM_JOB_ID")
    if job:
        return _allocation(job, env, run)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        return []
    partitions = run(["sinfo", "-h", "-o", "%P %a %D %c %G %l"]).strip().splitlines()
    lines = [f"  Slurm       not in an allocation; {sbatch} is here: cluster='slurm' submits a job"]
    if partitions:
        lines.append("    partition avail nodes cpus/node gres timelimit (sinfo):")
        lines += [f"      {line}" for line in partitions[:12]]
    else:
        lines.append("    sinfo answered nothing: is slurmctld reachable (SLURM_CONF)?")
    return lines


def _allocation(job: str, env: dict[str, str], run: Runner) -> list[str]:
    # The job as slurmctld holds it: inside a step, SLURM_JOB_NODELIST is the step's nodes.
    known = dict(re.findall(r"(\w+)=(\S*)", run(["scontrol", "-o", "show", "job", job])))
    nodes = known.get("NodeList") or env.get("SLURM_NODELIST") or "?"
    count = known.get("NumNodes") or env.get("SLURM_JOB_NUM_NODES") or "?"
    partition = known.get("Partition") or env.get("SLURM_JOB_PARTITION", "?")
    lines = [f"  Slurm       job {job} (partition {partition}): {count} node(s), {nodes}"]
    # A step's environment has its own counts; the job's are in its _PACK_GROUP_0 or scontrol's.
    cpus = env.get("SLURM_JOB_CPUS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0")
    if not cpus and known.get("NumCPUs"):
        cpus = f"{known['NumCPUs']} in all:"
    in_tres = re.search(r"gres/gpu=(\d+)", known.get("TRES", ""))
    gpus = (
        env.get("SLURM_GPUS_PER_NODE")
        or env.get("SLURM_GPUS_ON_NODE")
        or (str(len(env["SLURM_JOB_GPUS"].split(","))) if env.get("SLURM_JOB_GPUS") else None)
        or (f"{in_tres.group(1)} in all:" if in_tres else None)
    )
    lines.append(
        f"    per node: {cpus or '?'} CPU(s), {gpus or 'no'} GPU(s) allocated"
        + (
            f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})"
            if "CUDA_VISIBLE_DEVICES" in env
            else ""
        )
    )
    step = env.get("SLURM_STEP_ID")
    if step is not None:
        tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "?")
        where = env.get("SLURM_STEP_NODELIST", "?")
        # Its SLURM_NTASKS and nodes would bind an srun started from here: the joins' srun
        # leaves them out (nblaunch.cluster.node_start.step_free_env).
        lines.append(f"    this process: step {job}.{step}, {tasks} task(s) on {where}")
    else:
        lines.append("    this process: the job's shell or batch script (no step)")
    left = run(["squeue", "-h", "-j", job, "-o", "%L"]).strip()
    if left:
        lines.append(f"    time left: {left}")
    if count.isdigit():
        lines.append(f"    num_nodes up to {count} with cluster='slurm' (this node is node 0)")
    return lines
