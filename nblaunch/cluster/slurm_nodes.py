"""The other nodes of a run, placed by Slurm: a step of this allocation, or a job of their own.

``cluster="slurm"`` (or ``start_nodes="srun"``) inside an allocation (``salloc -N 3``, a batch
job, Open OnDemand: ``SLURM_JOB_ID`` is set) runs one ``nblaunch join`` on each of the other
nodes of the allocation, as one ``srun`` step (:mod:`nblaunch.cluster.node_start`).

``cluster=SlurmCluster(...)`` (or ``"slurm"`` outside an allocation, on a login node) submits the
other ``num_nodes - 1`` nodes as a batch job whose one step runs their joins: :class:`SlurmJob`.
While the notebook waits for them, the job's state is shown as it changes ("job 1234 PENDING
(Resources)"); a job that ends before every node joined fails the launch with Slurm's state,
reason and the job's log; the job is cancelled when the cell is interrupted, and when the run
ends the joins end with it (the job then completes) or are cancelled after a while. A pool
keeps its job across cells and cancels it when the pool stops.

Why ``sbatch`` rather than submitit: the job is one shell line (``srun ... nblaunch join``), the
state is one ``scontrol`` call, cancelling is ``scancel``; submitit would add a dependency (and
pickles on a shared folder) for none of that. Placement is Slurm's; everything else (the store,
the view, the root cause, hang proofs, the checks) is nblaunch's, as on any network.

Slurm's commands are called as a person would type them; they are on ``PATH`` and read the
cluster's ``slurm.conf`` (``SLURM_CONF``) as they do for that person.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nblaunch.cluster.network import route_to
from nblaunch.cluster.node_start import JoinStarter
from nblaunch.cluster.trust import SECRET_ENV
from nblaunch.engine.plan.launch_plan import choose_port
from nblaunch.errors import LaunchError

# How often the job's state is read while the notebook waits for its nodes.
POLL_S = 1.0
# How long the joins get to end with their run (the job then completes) before it is cancelled.
END_WAIT_S = 15.0
# How long a failed run waits for its job, on its way out, to say how it ended.
NOTE_WAIT_S = 10.0
# How long one Slurm command may take (a busy slurmctld answers within MessageTimeout, 10 s).
COMMAND_TIMEOUT_S = 30.0
# Job states after which the job holds no node any more (squeue's long names).
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "GONE",  # no longer known to slurmctld (purged after MinJobAge)
    }
)


@dataclass(frozen=True)
class SlurmCluster:
    """Run the other nodes of a multi-node launch as a Slurm job (``cluster=`` of
    :func:`~nblaunch.notebook_launcher`, ``%%distributed --cluster slurm``, pools).

    Node 0 (its ranks too) is the notebook's machine, as in every multi-node run; the job holds
    the other nodes, one ``nblaunch join`` on each.

    Parameters
    ----------
    partition
        ``sbatch --partition``; default: the cluster's default partition.
    nodes
        How many nodes the job asks for: the other nodes. Default ``num_nodes - 1``; given
        alone, ``num_nodes`` is ``nodes + 1``.
    time
        ``sbatch --time`` (``"30"``, ``"1:00:00"``, ``"1-0"``): Slurm ends the job then.
    gpus_per_node
        ``sbatch --gpus-per-node``; default: the ranks' count per node on a CUDA run, none
        otherwise.
    account
        ``sbatch --account``.
    sbatch_args
        Any other ``sbatch`` options, as on its command line (``("--qos=debug",
        "--constraint=a100")``).
    """

    partition: str | None = None
    nodes: int | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise LaunchError(f"{name}={value!r}: give a whole number, or leave it out")
        if self.nodes is not None and self.nodes < 1:
            raise LaunchError(f"nodes={self.nodes}: the job needs at least one node")
        for name in ("partition", "time", "account"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise LaunchError(f"{name}={value!r}: give Slurm's text (a string), or leave out")
        if isinstance(self.sbatch_args, str):
            object.__setattr__(self, "sbatch_args", tuple(shlex.split(self.sbatch_args)))
        object.__setattr__(self, "sbatch_args", tuple(str(a) for a in self.sbatch_args))
        if self.time is not None:
            object.__setattr__(self, "time", str(self.time))

    def sbatch_options(self, count: int, device_type: str, nproc_per_node: int) -> list[str]:
        """The job's ``sbatch`` options for ``count`` nodes of ``nproc_per_node`` ranks each."""
        options = [f"--nodes={count}", "--ntasks-per-node=1", f"--cpus-per-task={nproc_per_node}"]
        gpus = self.gpus_per_node
        if gpus is None and device_type == "cuda":
            gpus = nproc_per_node
        for flag, value in (
            ("--partition", self.partition),
            ("--time", self.time),
            ("--account", self.account),
            ("--gpus-per-node", gpus),
        ):
            if value is not None:
                options.append(f"{flag}={value}")
        return [*options, *self.sbatch_args]


def in_allocation(environ: dict[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm allocation (``salloc``, a batch job, a step)."""
    return bool((os.environ if environ is None else environ).get("SLURM_JOB_ID"))


def is_slurm(cluster: Any) -> bool:
    """Whether ``cluster=`` names Slurm."""
    return cluster == "slurm" or isinstance(cluster, SlurmCluster)


def placed_by(
    cluster: Any, num_nodes: int | None, start_nodes: str | None, rdzv_endpoint: str | None
) -> tuple[str, str, int]:
    """The rendezvous endpoint, ``start_nodes`` and ``num_nodes`` of a run whose other nodes
    Slurm places: ``"srun"`` (a step of this allocation) for ``"slurm"`` inside one, else
    ``"slurm"`` (a job of their own).

    Raises
    ------
    LaunchError
        The other options contradict ``cluster``, the allocation is too small, or Slurm's
        commands are missing.
    """
    if start_nodes is not None:
        raise LaunchError(f"cluster= places the other nodes; leave start_nodes={start_nodes!r} out")
    job = cluster if isinstance(cluster, SlurmCluster) else None
    if job is not None and job.nodes is not None:
        if num_nodes in (None, 1):
            num_nodes = job.nodes + 1
        elif num_nodes != job.nodes + 1:
            raise LaunchError(
                f"num_nodes={num_nodes} with SlurmCluster(nodes={job.nodes}): the job holds the "
                f"other nodes, so num_nodes is nodes + 1 = {job.nodes + 1}; give one of them"
            )
    if num_nodes is None or num_nodes < 2:
        raise LaunchError(
            f"cluster={cluster!r} places the other nodes of a run on several machines: pass "
            "num_nodes=N (2 or more), this node included"
        )
    if job is None and in_allocation():
        how = "srun"
        have = allocation_nodes()
        if have is not None and have < num_nodes:
            raise LaunchError(
                f"num_nodes={num_nodes}, but this allocation (job {os.environ['SLURM_JOB_ID']}) "
                f"has {have} node(s): ask for more (salloc -N {num_nodes}), or lower num_nodes"
            )
        tool("srun")
    else:
        how = "slurm"
        tool("sbatch")
    return rdzv_endpoint or default_endpoint(), how, num_nodes


def allocation_nodes() -> int | None:
    """How many nodes this allocation holds, as slurmctld says (None: it did not say). Not
    from the environment: inside a step (a notebook under srun) that has the step's nodes."""
    with contextlib.suppress(LaunchError):
        line = slurm("scontrol", "-o", "show", "job", os.environ["SLURM_JOB_ID"])
        found = re.search(r"\bNumNodes=(\d+)", line)
        if found:
            return int(found.group(1))
    return None


def default_endpoint() -> str:
    """``address:port`` for the rendezvous: this machine's address on the way to slurmctld
    (the network the cluster's nodes share) and a free port there.

    Raises
    ------
    LaunchError
        No address toward slurmctld can be found (then ``rdzv_endpoint=`` says which).
    """
    controller, port = controller_address()
    route = route_to(controller, port) if controller else None
    if route is None:
        raise LaunchError(
            f"cannot find this machine's address toward slurmctld ({controller or 'unknown'}): "
            "pass rdzv_endpoint='<an address of this machine the nodes reach>:<port>'"
        )
    return f"{route.address}:{choose_port(route.address, None)}"


def controller_address() -> tuple[str | None, int]:
    """slurmctld's address and port, as ``scontrol show config`` says them."""
    try:
        config = slurm("scontrol", "show", "config")
    except LaunchError:
        return None, 6817
    host = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", config, re.M)
    port = re.search(r"^SlurmctldPort\s*=\s*(\d+)", config, re.M)
    address = (host.group(2) or host.group(1)) if host else None
    return address, int(port.group(1)) if port else 6817


def tool(name: str) -> str:
    """The path of Slurm's command ``name``.

    Raises
    ------
    LaunchError
        It is not on PATH.
    """
    path = shutil.which(name)
    if path is None:
        raise LaunchError(
            f"{name} is not on PATH: run the notebook on a machine of the Slurm cluster (a login "
            "or compute node), with Slurm's commands on PATH (module load slurm)"
        )
    return path


def slurm(*argv: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """Run one of Slurm's commands; its output.

    Raises
    ------
    LaunchError
        It failed (with what it said) or took over ``COMMAND_TIMEOUT_S``.
    """
    command = [tool(argv[0]), *argv[1:]]
    try:
        result = subprocess.run(
            command,
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{argv[0]} did not answer within {COMMAND_TIMEOUT_S:g} s") from None
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        raise LaunchError(f"{shlex.join(argv[:3])}: {said[-1] if said else 'failed'}")
    return result.stdout


@dataclass
class JobState:
    """What Slurm says of a job: its ``state``, the ``reason`` (why pending, why ended), the
    nodes it holds, its exit code and log."""

    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""
    log: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self, job_id: str) -> str:
        """``job 1234 PENDING (Resources)``, as squeue says it."""
        text = f"job {job_id} {self.state}"
        if self.reason and self.reason != "None":
            text += f" ({self.reason})"
        if self.state == "RUNNING" and self.nodes:
            text += f" on {self.nodes}"
        return text


def job_state(job_id: str) -> JobState:
    """The job's state now (``GONE`` once slurmctld forgot it)."""
    try:
        line = slurm("scontrol", "-o", "show", "job", job_id)
    except LaunchError as exc:
        if "Invalid job id" in str(exc):
            return JobState("GONE")
        raise
    fields = dict(re.findall(r"(\w+)=(\S*)", line))
    return JobState(
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        nodes=fields.get("NodeList", "") if fields.get("NodeList") != "(null)" else "",
        exit_code=fields.get("ExitCode", ""),
        log=fields.get("StdOut", ""),
    )


def batch_script(count: int, endpoint: str, run_id: str) -> str:
    """The job's script: one step, one ``join`` per node."""
    join = [sys.executable, "-m", "nblaunch", "join", endpoint, "--run-id", run_id]
    step = ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", *join]
    return (
        "#!/bin/sh\n"
        f"# nblaunch: the other {count} node(s) of run {run_id}; each runs its join, which ends\n"
        "# with the run (or the pool), and the job with them.\n"
        f"exec {shlex.join(step)}\n"
    )


@dataclass
class SlurmJob(JoinStarter):
    """The batch job that holds a run's other nodes, as the notebook holds it (the ``starter``
    of :meth:`nblaunch.cluster.head.Head.start_joins`).

    ``news(title, body)`` shows a line in the run's view (the job's state as it changes).
    """

    options: list[str]
    script: str
    env: dict[str, str]
    log_dir: Path
    news: Callable[[str, str], None]
    job_id: str = ""
    log: Path = field(default_factory=Path)
    last: JobState | None = None
    polled_at: float = 0.0
    fresh: bool = True  # submitted for the start under way (not kept from a pool's earlier one)

    def submit(self) -> None:
        """Submit the job (``sbatch --parsable``, the script on stdin).

        Raises
        ------
        LaunchError
            sbatch refused it, with what sbatch said (an unknown partition, too many nodes).
        """
        pattern = self.log_dir / "slurm-%j.out"
        argv = ["sbatch", "--parsable", f"--output={pattern}", *self.options]
        try:
            out = slurm(*argv, stdin=self.script, env=self.env)
        except LaunchError as exc:
            raise LaunchError(
                f"Slurm refused the job for the other nodes ({exc}); nothing was started. "
                "Check SlurmCluster's options (sinfo lists partitions and nodes)"
            ) from None
        self.job_id = out.strip().split(";")[0]
        self.log = Path(str(pattern).replace("%j", self.job_id))
        self.last = None
        self.polled_at = 0.0
        self.news(
            f"submitted Slurm job {self.job_id} for the other node(s)",
            f"sbatch {' '.join(self.options)}; its log: {self.log}",
        )

    def describe(self) -> str:
        return (
            f"Slurm job {self.job_id} holds the other node(s): one join on each, its log in "
            f"{self.log}"
        )

    def state(self, now: bool = False) -> JobState | None:
        """The job's state, read at most every ``POLL_S`` (``now``: read it now); its changes
        are shown."""
        if not now and self.last is not None and time.monotonic() - self.polled_at < POLL_S:
            return self.last
        self.polled_at = time.monotonic()
        try:
            state = job_state(self.job_id)
        except LaunchError:
            return self.last  # slurmctld busy: the next poll asks again
        if self.last is None or state.describe(self.job_id) != self.last.describe(self.job_id):
            self.news(state.describe(self.job_id), f"its log: {self.log}" if state.ended else "")
        self.last = state
        return state

    def problem(self, nodes: int) -> str | None:
        """The job ended before every node joined (None: it is pending or running)."""
        state = self.state()
        if state is None or not state.ended:
            return None
        if not self.fresh:  # a pool's job that ended since: the next start submits again
            return None
        return f"Slurm {self.ended_text(state)}"

    def ended_text(self, state: JobState) -> str:
        """What a person needs of an ended job: state, reason, exit code, log and its end."""
        text = state.describe(self.job_id)
        if state.exit_code and state.exit_code != "0:0":
            text += f", exit code {state.exit_code}"
        return f"{text}; its log: {self.log} ({_last_line(self.log)})"

    def note(self) -> str | None:
        """For a run that failed: the job, when it no longer runs (cancelled, preempted, a node
        failed, its time limit), with Slurm's reason and its log; None while it runs."""
        deadline = time.monotonic() + NOTE_WAIT_S
        with contextlib.suppress(LaunchError):
            state = job_state(self.job_id)
            # A job on its way out (preempted, cancelled: its joins told the notebook at the
            # first SIGTERM) says its final state once its steps have ended.
            while state.state == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.2)
                state = job_state(self.job_id)
            if state.state not in ("RUNNING", "COMPLETING"):
                return f"Slurm {self.ended_text(state)}"
        return None

    def renew(self, nodes: int) -> None:
        """Before a pool's next start: a running job's joins join it by themselves; a job that
        ended is submitted again."""
        self.fresh = False
        state = self.state(now=True)
        if state is not None and state.ended:
            self.submit()
            self.fresh = True

    def close(self, wait_s: float = END_WAIT_S) -> None:
        """Give the nodes back: a job still pending is cancelled at once; a running one gets
        ``wait_s`` for its joins to end with their run, then is cancelled."""
        if not self.job_id:
            return
        deadline = time.monotonic() + wait_s
        state = self.state(now=True)
        while state is not None and state.state in ("RUNNING", "COMPLETING"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
            state = self.state(now=True)
        if state is None or not state.ended:
            with contextlib.suppress(LaunchError):
                slurm("scancel", self.job_id)
                self.news(f"cancelled Slurm job {self.job_id}", f"its log: {self.log}")


def start_slurm_job(
    cluster: SlurmCluster,
    *,
    count: int,
    endpoint: str,
    run_id: str,
    secret: str,
    log_dir: Path | None,
    device_type: str,
    nproc_per_node: int,
    news: Callable[[str, str], None],
) -> SlurmJob:
    """Submit the job that runs a ``join`` on each of ``count`` other nodes.

    The run's secret travels in the job's environment (sbatch exports it; Slurm keeps it
    readable by the job's owner and the administrators), never on a command line.

    Raises
    ------
    LaunchError
        sbatch refused the job.
    """
    folder = log_dir or Path.cwd()
    env = {**os.environ, SECRET_ENV: secret}
    options = [
        f"--job-name=nblaunch-{run_id}",
        f"--chdir={os.getcwd()}",
        "--export=ALL",
        *cluster.sbatch_options(count, device_type, nproc_per_node),
    ]
    job = SlurmJob(options, batch_script(count, endpoint, run_id), env, folder, news)
    job.submit()
    return job


def _last_line(log: Path) -> str:
    """The job log's line that says why it ended (Slurm's ``*** JOB ... CANCELLED ... DUE TO
    PREEMPTION ***``), else its last line."""
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        told = [line for line in lines if "***" in line]
        if told or lines:
            return (told or lines)[-1].strip()[:300]
    return "no output yet"
