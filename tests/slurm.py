"""A real Slurm for the tests: slurmctld and one slurmd per network namespace, munge for auth.

``Slurm(network, folder)`` starts, on a :class:`netns.Network` of ``count`` hosts:

- one ``munged`` with its own key and socket in ``folder`` (a Unix socket on the file system,
  so every namespace reaches it);
- ``slurmctld`` in host 0 (the notebook's host), and one ``slurmd`` in every host, each in a
  UTS namespace of its own whose hostname is its node's name (``<tag>h<k>``), so that what a
  step runs there (``socket.gethostname()``) sees that node, as on a real machine;
- no cgroups: ``proctrack/linuxproc`` and ``task/none``; no accounting, no systemd.

Everything reads ``slurm.conf`` in ``folder`` (``SLURM_CONF``), so nothing under /etc is read or
written and the machine's own Slurm and munge (if any) are left alone. Partitions: ``all`` (every
node, for allocations the notebook runs in), ``compute`` (the default: every node but host 0,
where a login node's notebook submits) and ``urgent`` (the same nodes, whose jobs preempt
``compute``'s).

``close`` cancels every job, stops the daemons it started (by PID), then every process left in
the namespaces (a step's slurmstepd and what it ran), by PID.

``skip_reason()`` says why no Slurm can run here (no slurmctld, not root, no namespaces).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from conftest import Kernel
from netns import COMMAND_TIMEOUT_S, Network
from netns import skip_reason as netns_skip_reason

# The ports of the test cluster: each namespace has its own, so they collide with nothing.
CONTROLLER_PORT = 6817
NODE_PORT = 6818
START_TIMEOUT_S = 30.0
TOOLS = (
    "slurmctld",
    "slurmd",
    "munged",
    "srun",
    "sbatch",
    "salloc",
    "squeue",
    "scancel",
)


def skip_reason() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"Slurm is not installed here ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (.ci/run does so on CI)"
        )
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare or nsenter (util-linux) is missing: each node needs a namespace of its own"
    return netns_skip_reason()


class Slurm:
    """slurmctld, a slurmd per host of ``network``, and munged; ``env`` for the clients."""

    def __init__(self, network: Network, folder: Path, cpus: int = 2) -> None:
        self.network = network
        self.folder = folder
        self.nodes = [host for host in network.hosts]  # a node's name is its namespace's
        self.conf = folder / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))]:
            if name != "SLURM_CONF":
                del self.env[name]
        try:
            self._start(cpus)
        except BaseException:
            self.close()
            raise

    # --- start --------------------------------------------------------------------------------

    def _start(self, cpus: int) -> None:
        folder = self.folder
        for sub in ("munge", "state", "spool", "log", *(f"spool/{n}" for n in self.nodes)):
            (folder / sub).mkdir(mode=0o700, exist_ok=True)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = folder / "munge" / "socket"
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={folder / 'munge' / 'munged.pid'}",
                f"--log-file={folder / 'log' / 'munged.log'}",
                f"--seed-file={folder / 'munge' / 'seed'}",
            ],
        )
        _wait_for(self.munge_socket.exists, "munged's socket", folder / "log" / "munged.log")
        self.conf.write_text(self._config(cpus))
        self._daemon(
            "slurmctld",
            self._in_node(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)]),
        )
        for k in range(len(self.nodes)):
            self.start_node(k)
        _wait_for(self._all_idle, "every node idle", folder / "log" / "slurmctld.log")

    def _config(self, cpus: int) -> str:
        folder = self.folder
        head = self.network.addresses[0]
        lines = [
            "ClusterName=nbtest",
            f"SlurmctldHost={self.nodes[0]}({head})",
            f"SlurmctldPort={CONTROLLER_PORT}",
            f"SlurmdPort={NODE_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}/%n",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmdTimeout=10",
            "SlurmctldTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "MessageTimeout=5",
            "SlurmctldDebug=info",
            # A job in `urgent` cancels one in `compute` that holds its nodes: a real
            # preemption (Slurm says PREEMPTED); the allocations of `all` are never preempted.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=CANCEL",
            "SlurmdDebug=info",
        ]
        for name, address in zip(self.nodes, self.network.addresses, strict=True):
            lines.append(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN")
        others = ",".join(self.nodes[1:])
        lines.append(f"PartitionName=all Nodes={','.join(self.nodes)} PreemptMode=OFF State=UP")
        lines.append(f"PartitionName=compute Nodes={others} Default=YES PriorityTier=1 State=UP")
        lines.append(f"PartitionName=urgent Nodes={others} PriorityTier=10 State=UP")
        return "\n".join(lines) + "\n"

    def _in_node(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` in host ``k``'s namespace, under a hostname of its own (node ``k``'s name)."""
        # nsenter, not `ip netns exec`: that mounts a fresh /sys, without the cgroup file
        # systems slurmd reads at start even with proctrack/linuxproc.
        script = f'hostname {self.nodes[k]} && exec "$@"'
        namespace = f"--net=/run/netns/{self.network.hosts[k]}"
        return ["nsenter", namespace, "unshare", "--uts", "sh", "-c", script, "sh", *argv]

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / "log" / f"{name}.out", "ab")  # noqa: SIM115 (kept by the child)
        self.daemons[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
        )
        log.close()

    def start_node(self, k: int) -> None:
        """Start node ``k``'s slurmd (again)."""
        argv = ["slurmd", "-D", "-N", self.nodes[k], "-f", str(self.conf)]
        self._daemon(f"slurmd-{k}", self._in_node(k, argv))

    # --- use ----------------------------------------------------------------------------------

    def command(self, k: int, *argv: str) -> list[str]:
        """``argv`` run on node ``k`` (its namespace and hostname), as a user there would."""
        return self._in_node(k, list(argv))

    def run(self, k: int, *argv: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run a Slurm command on node ``k``; its output (raises on failure)."""
        result = subprocess.run(
            self.command(k, *argv),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=self.folder,  # where a job's slurm-<id>.out goes
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout}")
        return result.stdout

    def _all_idle(self) -> bool:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            states = self.run(0, "sinfo", "-h", "-N", "-p", "all", "-o", "%N %t").split("\n")
            return sum(line.endswith(" idle") for line in states) == len(self.nodes)
        return False

    def idle(self) -> bool:
        """Whether every node is idle again (no job holds any)."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            return self._all_idle()
        return False

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm still holds (pending, running, completing)."""
        out = self.run(0, "squeue", "-h", "-o", "%i")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def kill_node(self, k: int) -> None:
        """Node ``k``'s machine dies: every process in its namespace is SIGKILLed (slurmd,
        slurmstepd, the step's processes)."""
        self.daemons.pop(f"slurmd-{k}", None)
        _kill_namespace(self.network.hosts[k], signal.SIGKILL)

    # --- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job, stop the daemons, then whatever is left in the namespaces."""
        with contextlib.suppress(Exception):
            for job in self.jobs():
                self.run(0, "scancel", job)
        for name in sorted(self.daemons, key=lambda n: n == "munged"):  # munged last
            process = self.daemons[name]
            if process.poll() is None:
                process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
                process.wait(5)
        self.daemons.clear()
        for host in self.network.hosts:
            _kill_namespace(host, signal.SIGKILL)


def _kill_namespace(host: str, sig: signal.Signals) -> None:
    """Send ``sig`` to every process in namespace ``host`` (by PID: ``ip netns pids``)."""
    result = subprocess.run(
        ["ip", "netns", "pids", host], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), sig)


def _wait_for(predicate, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what}: not within {START_TIMEOUT_S:g} s; {log}:\n{tail}")
        time.sleep(0.2)


class NodeKernel(Kernel):
    """A real IPython kernel started by ``prefix`` (on a node of the test cluster: in its
    namespace, or as a step of an allocation), its channels on Unix sockets in ``folder`` (a
    namespace's addresses cannot be reached from the test's own).

    ``interrupt_by_message``: the interrupt button as an ``interrupt_request`` (the kernel
    sends itself SIGINT), for a kernel under srun, which takes SIGINT for itself.
    """

    def __init__(
        self,
        cwd: Path,
        folder: Path,
        prefix: list[str],
        env: dict[str, str],
        interrupt_by_message: bool = False,
    ) -> None:
        from jupyter_client.manager import KernelManager

        class Prefixed(KernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                return [*prefix, *super().format_kernel_cmd(extra_arguments)]

        self.cwd = cwd
        self.manager = Prefixed(kernel_name="python3", transport="ipc", ip=str(folder / "k"))
        if interrupt_by_message:
            self.manager.kernel_spec.interrupt_mode = "message"
        self.manager.start_kernel(cwd=str(cwd), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
