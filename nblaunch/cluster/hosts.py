"""The hosts of an MPI hostfile, checked over ssh before a multi-host run.

:func:`check_hosts` checks a hostfile for MPI or multi-host CPU runs: passwordless SSH to each
host, the name it answers with, and whether ``mpirun`` is here. ``nblaunch env --hostfile`` and
``%dist env HOSTFILE`` print its report after the environment report
(:mod:`nblaunch.engine.plan.doctor`); ``start_nodes="ssh"`` (:mod:`nblaunch.cluster.node_start`)
reads the hostfile and checks its hosts with :func:`check_each` before it starts anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from nblaunch.engine.plan.doctor import mpirun_version

SSH_TIMEOUT_S = 5.0


def read_hostfile(path: str | os.PathLike[str]) -> list[str]:
    """Host names from an MPI hostfile (``host slots=4``, ``host:4``, ``# comments``), in order."""
    hosts: list[str] = []
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0]
        if ":" in host and host.count(":") == 1:  # MPICH's host:slots (not an IPv6 address)
            host = host.split(":", 1)[0]
        if host not in hosts:
            hosts.append(host)
    return hosts


@dataclasses.dataclass
class HostCheck:
    """What one host said to ``ssh -o BatchMode=yes host hostname``."""

    host: str
    ok: bool
    answered: str  # the host name it answered with
    problem: str  # what went wrong, in words
    fix: str  # what to do about it
    seconds: float


@dataclasses.dataclass
class HostsReport:
    hostfile: str
    hosts: list[HostCheck]
    mpirun: str | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(h.ok for h in self.hosts)

    def text(self) -> str:
        lines = [f"hosts in {self.hostfile}:"]
        if self.error:
            lines.append(f"  {self.error}")
        for check in self.hosts:
            if check.ok:
                note = ""
                if check.answered.split(".")[0] != check.host.split(".")[0]:
                    note = f" (it calls itself {check.answered!r})"
                lines.append(f"  ok    {check.host}: passwordless SSH works{note}")
            else:
                lines.append(f"  FAIL  {check.host}: {check.problem}")
                lines.append(f"        fix: {check.fix}")
        lines.append(f"  mpirun: {self.mpirun or 'not found on PATH; install Open MPI or MPICH'}")
        good = sum(h.ok for h in self.hosts)
        lines.append(f"  {good} of {len(self.hosts)} host(s) reachable")
        return "\n".join(lines) + "\n"


# ssh's stderr -> (what went wrong, what to do). The first pattern that matches wins.
_SSH_PROBLEMS = (
    (
        r"permission denied",
        "SSH asks for a password or key passphrase (BatchMode refuses to prompt)",
        "set up key login: ssh-keygen, then ssh-copy-id {host}; use an agent for passphrases",
    ),
    (
        r"host key verification failed",
        "the host key is not in known_hosts",
        "connect once by hand (ssh {host}) to accept its key, or ssh-keyscan {host} >> "
        "~/.ssh/known_hosts",
    ),
    (
        r"could not resolve hostname|name or service not known|nodename nor servname",
        "the name does not resolve",
        "fix the name in the hostfile, or add it to /etc/hosts or DNS",
    ),
    (
        r"connection refused",
        "nothing listens for SSH there",
        "start sshd on {host}, or check the port",
    ),
    (
        r"timed out|no route to host|network is unreachable",
        "the host does not answer",
        "check that {host} is up and reachable from here (firewall, VPN, address)",
    ),
)


def check_each(hosts: list[str], ssh: str, timeout: float = SSH_TIMEOUT_S) -> list[HostCheck]:
    """Check every host in parallel (see :func:`_check_host`), so one dead host costs
    ``timeout`` seconds, not one per host."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(lambda host: _check_host(host, timeout, ssh), hosts))


def _check_host(host: str, timeout: float, ssh: str) -> HostCheck:
    """Ask ``host`` for its name over ``ssh`` without prompting; say what failed and the fix."""
    import time

    command = [
        ssh,
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={max(1, int(timeout))}",
        host,
        "hostname",
    ]
    started = time.monotonic()
    # Own session, so a timeout can stop ssh and anything it started (a ProxyCommand, say).
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout + 2)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return HostCheck(
            host,
            False,
            "",
            f"no answer within {timeout + 2:g} s",
            f"check that {host} is up and reachable from here (firewall, VPN, address)",
            time.monotonic() - started,
        )
    seconds = time.monotonic() - started
    answered = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
    if process.returncode == 0 and answered:
        return HostCheck(host, True, answered, "", "", seconds)
    err = stderr.strip()
    for pattern, problem, fix in _SSH_PROBLEMS:
        if re.search(pattern, err, re.IGNORECASE):
            return HostCheck(host, False, "", problem, fix.format(host=host), seconds)
    detail = err.splitlines()[-1] if err else f"exit code {process.returncode}, no output"
    return HostCheck(
        host,
        False,
        "",
        f"ssh failed: {detail}",
        f"run `ssh -o BatchMode=yes {host} hostname` by hand to see why",
        seconds,
    )


def check_hosts(hostfile: str | os.PathLike[str], *, timeout: float = SSH_TIMEOUT_S) -> HostsReport:
    """Check every host of an MPI hostfile: passwordless SSH, the name it answers with.

    Hosts are checked in parallel, each with its own ``timeout``, so one dead host costs
    ``timeout`` seconds, not one per host.
    """
    path = str(hostfile)
    mpirun = mpirun_version()
    try:
        hosts = read_hostfile(path)
    except OSError as exc:
        return HostsReport(path, [], mpirun, f"cannot read the hostfile: {exc.strerror or exc}")
    if not hosts:
        return HostsReport(path, [], mpirun, "the hostfile lists no hosts")
    ssh = shutil.which("ssh")
    if ssh is None:
        return HostsReport(
            path, [], mpirun, "ssh is not on PATH; install an OpenSSH client (openssh-client)"
        )
    return HostsReport(path, check_each(hosts, ssh, timeout), mpirun)
