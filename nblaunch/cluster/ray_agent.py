"""The agent actor Ray places on each of a run's other nodes: it starts that node's ``join``.

It runs on the other node, in a Ray worker process; :mod:`nblaunch.cluster.ray_nodes`, in the
notebook's process, places the agents and talks to them. The join is a child process rather than
code in the actor: Ray's actor threads own the signals, and a join needs SIGTERM and a session of
its own. It dies with the agent (``PR_SET_PDEATHSIG``), and its output goes to a file on its node,
never to Ray's log forwarding.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nblaunch.cluster.trust import SECRET_ENV

# PR_SET_PDEATHSIG, from <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1
# Set for the join an agent starts: a SIGTERM it gets then comes from its agent's end.
RAY_AGENT_ENV = "NBLAUNCH_RAY_AGENT"


def versions() -> dict[str, str]:
    """What must match between the notebook and every node (read from the installed packages'
    metadata: an agent that imported torch to say its version would take seconds more)."""
    from importlib import metadata

    return {
        "Python": platform.python_version(),
        "Ray": metadata.version("ray"),
        "torch": metadata.version("torch"),
        "nblaunch": metadata.version("nblaunch"),
    }


class JoinAgent:
    """An actor on one node: its ``nblaunch join``, started as a child that dies with the agent.

    Its output goes to a file of the node's (``tail`` reads it): nothing reaches Ray's log
    forwarding, so the notebook shows the ranks' lines once, through nblaunch's relay.
    """

    def __init__(self, log_name: str) -> None:
        folder = Path(tempfile.gettempdir()) / f"nblaunch-ray-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        self.log = folder / log_name
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, command: list[str], secret: str) -> int:
        """Start the join (once every node is placed and checked: it looks for the run at
        once); its pid."""
        env = {**os.environ, SECRET_ENV: secret, RAY_AGENT_ENV: "1"}
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # Its own session (the agent's signals are Ray's), and SIGTERM when the agent dies.
            self.process = subprocess.Popen(
                [sys.executable, *command],
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            os.close(fd)
        return self.process.pid

    def ended(self) -> int:
        """Wait for the join to end; its exit code. The notebook keeps this call pending: an
        agent lost with its node never answers, and Ray says so at once."""
        assert self.process is not None
        return self.process.wait()

    def where(self) -> dict[str, Any]:
        """This node: Ray's id and address, the host name, and its versions."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "log": str(self.log),
            "versions": versions(),
        }

    def tail(self) -> str:
        """The join's last line of output."""
        with contextlib.suppress(OSError):
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line]
            if lines:
                return lines[-1].strip()
        return "no output"

    def stop(self, wait_s: float) -> int | None:
        """Wait up to ``wait_s`` for the join to end with its run, then stop it (SIGTERM: it
        stops its ranks and tells the notebook)."""
        if self.process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(wait_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(5.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def _die_with_parent() -> None:
    """In the join's process before it runs: SIGTERM when the agent that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
