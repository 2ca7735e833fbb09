"""Starting the other nodes' ``join`` from the notebook, over ssh or Slurm's srun (opt-in).

``start_nodes="ssh"`` with a ``hostfile`` runs ``python -m nblaunch join`` on the first
``num_nodes - 1`` hosts of the file that are not this machine; every host is first checked for
passwordless ssh (:func:`nblaunch.cluster.hosts.check_each`), and one that fails stops the launch
before anything starts, with the fix. The run's secret goes down ssh's stdin
(``--secret-file -``), so it is on no command line. ``start_nodes="srun"``, inside a Slurm
allocation, runs one ``join`` on each of ``num_nodes - 1`` other nodes of the job; the secret
travels in the environment, which srun passes on.

What each started command prints goes to ``join-<host>.log`` in the run directory. A command
that ends badly before every node joined fails the launch with its last line, instead of a
rendezvous timeout minutes later. The commands are not killed when the run ends: each ``join``
ends with its run (or, for a pool, when the pool is closed); they get a while to, then are
stopped.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nblaunch.cluster.trust import SECRET_ENV
from nblaunch.engine.output.log_files import open_private
from nblaunch.errors import LaunchError

# How long the started commands get to end by themselves after the run, before they are stopped.
END_WAIT_S = 15.0


class JoinStarter(abc.ABC):
    """What started the other nodes' ``join`` from the notebook: commands over ssh or srun
    (:class:`NodeStarter`), a Slurm job (:class:`~nblaunch.cluster.slurm_nodes.SlurmJob`), or
    Ray's agents (:class:`~nblaunch.cluster.ray_nodes.RayStarter`)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the joins run and where their output goes."""

    @abc.abstractmethod
    def problem(self, nodes: int) -> str | None:
        """What ended badly before every node joined (None: all well so far)."""

    def note(self) -> str | None:
        """For a run that failed: what this starter knows of how the joins ended (None:
        nothing more than the nodes' own news)."""
        return None

    def lost(self) -> dict[int, str]:
        """The joins known lost while the ranks run, by pid, with why (none: a lost node is
        known by its silence)."""
        return {}

    @abc.abstractmethod
    def renew(self, nodes: int) -> None:
        """Before a pool's next start on ``nodes`` other nodes."""

    @abc.abstractmethod
    def close(self, wait_s: float = END_WAIT_S) -> None:
        """Wait (bounded) for the joins to end with their run; stop those that do not."""


@dataclass
class StartedJoin:
    """One started command: ``host`` (or "srun"), its process and its log file, and how it
    was started (to start it again)."""

    host: str
    process: subprocess.Popen
    log: Path
    command: list[str]
    stdin: str | None
    env: dict[str, str] | None
    fresh: bool = True  # started for the start under way (not kept from a pool's earlier one)

    def start_again(self) -> StartedJoin:
        return _start(self.host, self.command, self.stdin, self.env, self.log.parent)


@dataclass
class NodeStarter(JoinStarter):
    """The ``join`` commands the notebook started on the other nodes."""

    method: str
    started: list[StartedJoin] = field(default_factory=list)

    def describe(self) -> str:
        """Where the commands run and where their output goes."""
        if self.method == "srun":
            return f"srun started join on the other node(s); output in {self.started[0].log}"
        hosts = ", ".join(join.host for join in self.started)
        return f"started join over ssh on {hosts}; output in join-<host>.log beside the rank logs"

    def problem(self, nodes: int) -> str | None:
        """What went wrong with a command started for this start that already ended badly
        (None: all well so far). A command kept from a pool's earlier start that ended since
        (its node was lost, and it was still on its way out) is started again, while fewer than
        ``nodes`` run."""
        for join in self.started:
            code = join.process.poll()
            if join.fresh and code not in (None, 0):
                return (
                    f"join on {join.host} ({self.method}) ended with exit code {code}: "
                    f"{_telling_line(join.log)} (its output: {join.log})"
                )
        if any(not join.fresh and join.process.poll() is not None for join in self.started):
            self._start_ended_again(nodes)
        return None

    def note(self) -> str | None:
        """For a run that failed: how srun's step of the joins ended, when it ended badly (its
        step cancelled, a node failed), from what srun said; None otherwise (ssh's commands
        say nothing more than the nodes' own news)."""
        if self.method != "srun":
            return None
        for join in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                join.process.wait(2.0)  # srun says how the step ended as it ends
            code = join.process.poll()
            if code not in (None, 0):
                return (
                    f"the joins' srun step ended with exit code {code}: {_telling_line(join.log)} "
                    f"(its output: {join.log})"
                )
        return None

    def renew(self, nodes: int) -> None:
        """Before a pool's next start on ``nodes`` other nodes: the commands still running join
        it by themselves; as many of those that ended as it needs are started again."""
        for join in self.started:
            join.fresh = False
        self._start_ended_again(nodes)

    def _start_ended_again(self, nodes: int) -> None:
        running = [join for join in self.started if join.process.poll() is None]
        ended = [join for join in self.started if join.process.poll() is not None]
        wanted = min(nodes, 1) if self.method == "srun" else nodes  # one srun starts them all
        self.started = running + [
            join.start_again() for join in ended[: max(0, wanted - len(running))]
        ]

    def close(self, wait_s: float = END_WAIT_S) -> None:
        """Wait (bounded) for the commands to end with their run; stop those that do not."""
        deadline = time.monotonic() + wait_s
        for join in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                join.process.wait(max(0.0, deadline - time.monotonic()))
            if join.process.poll() is None:  # its own session: ssh and what it started
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(join.process.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    join.process.wait(5.0)


def start_joins(
    start_nodes: str,
    *,
    count: int,
    endpoint: str,
    run_id: str,
    secret: str,
    log_dir: Path | None,
    hostfile: str | os.PathLike[str] | None = None,
) -> NodeStarter:
    """Start ``join`` for run ``run_id`` at ``endpoint`` on ``count`` other nodes.

    Raises
    ------
    LaunchError
        Too few hosts, a host ssh cannot reach without a prompt, no ``srun``/``ssh`` on PATH.
    """
    join = [sys.executable, "-m", "nblaunch", "join", endpoint, "--run-id", run_id]
    starter = NodeStarter(start_nodes)
    if start_nodes == "srun":
        srun = _tool("srun", "run the notebook inside a Slurm allocation")
        command = [
            srun,
            f"--jobid={os.environ.get('SLURM_JOB_ID', '')}",
            f"--nodes={count}",
            f"--ntasks={count}",
            "--ntasks-per-node=1",
            f"--exclude={socket.gethostname()}",
            *join,
        ]
        env = {**step_free_env(), SECRET_ENV: secret}  # srun passes the environment on
        starter.started.append(_start("srun", command, None, env, log_dir))
        return starter
    ssh = _tool("ssh", "install an OpenSSH client (openssh-client)")
    hosts = _other_hosts(hostfile, count)
    problems = _unreachable(hosts, ssh)
    if problems:
        raise LaunchError(
            "cannot start the other nodes over ssh; nothing was started:\n" + "\n".join(problems)
        )
    for host in hosts:
        remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec " + shlex.join(
            [*join, "--secret-file", "-", "--local-addr", host]
        )
        command = [ssh, "-o", "BatchMode=yes", host, remote]
        starter.started.append(_start(host, command, secret + "\n", None, log_dir))
    return starter


def step_free_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an ``srun`` of the whole allocation: without the ``SLURM_*`` that a
    notebook started by ``srun`` (or a batch script) inherits, which srun reads as its own
    options. A kernel under ``srun`` has ``SLURM_NTASKS=1`` and the step's one node as
    ``SLURM_JOB_NODELIST``: srun then runs one task, on no node ("Hostlist is empty"). The job
    id (passed as ``--jobid`` too) and ``SLURM_CONF`` stay."""
    environ = dict(os.environ if environ is None else environ)
    keep = {"SLURM_CONF", "SLURM_JOB_ID"}
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k in keep}


def _other_hosts(hostfile: str | os.PathLike[str] | None, count: int) -> list[str]:
    from nblaunch.cluster.hosts import read_hostfile  # not at import: ~6 ms with the doctor

    assert hostfile is not None
    try:
        listed = read_hostfile(hostfile)
    except OSError as exc:
        raise LaunchError(f"cannot read hostfile {hostfile}: {exc.strerror or exc}") from None
    here = {"localhost", socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    others = [host for host in listed if host not in here]
    if len(others) < count:
        raise LaunchError(
            f"hostfile {hostfile} names {len(others)} machine(s) other than this one "
            f"({', '.join(others) or 'none'}); the run needs {count}. Add hosts, or lower "
            "num_nodes"
        )
    return others[:count]


def _unreachable(hosts: list[str], ssh: str) -> list[str]:
    """Each host's ssh check, in parallel: one line per host that fails."""
    from nblaunch.cluster.hosts import check_each

    return [f"  {c.host}: {c.problem}; fix: {c.fix}" for c in check_each(hosts, ssh) if not c.ok]


def _start(
    host: str,
    command: list[str],
    stdin: str | None,
    env: dict[str, str] | None,
    log_dir: Path | None,
) -> StartedJoin:
    log = (log_dir or Path.cwd()) / f"join-{host}.log"  # appended to when started again
    with open_private(log, "ab") as out:
        # Its own session: the notebook's interrupt is for the notebook, and the command can
        # be stopped with everything it started.
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    if stdin is not None:
        assert process.stdin is not None
        with contextlib.suppress(OSError):
            process.stdin.write(stdin.encode())
            process.stdin.close()
    return StartedJoin(host, process, log, command, stdin, env)


def _tool(name: str, fix: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"{name} is not on PATH: {fix}, or start the join commands yourself")
    return path


def _telling_line(log: Path) -> str:
    """The line of srun's output that says why its step ended (Slurm's ``*** STEP ...
    CANCELLED ... ***``, ``*** JOB ... DUE TO NODE FAILURE ***``), else its last line."""
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        for line in reversed(lines):
            if "***" in line:
                return line
    return _last_line(log)


def _last_line(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    return "no output"
