"""Hosts on a real network for the tests: Linux network namespaces joined by veth pairs.

``Network(count)`` makes ``count`` namespaces, each with a veth end on 10.77.<n>.0/24, all
joined to the first one (the notebook's host, ``10.77.<n>.1``; host ``k`` is ``10.77.<n>.k+1``)
through a bridge in that namespace. Each namespace has only its loopback and its veth: the
hostname still resolves to 127.0.x.x, as on a fresh Debian or Ubuntu machine. Every name starts
with ``nb<pid><letter>`` so that concurrent test runs, and the networks of one run, do not
collide; ``close`` removes everything.

``skip_reason()`` says why no namespace can be made here (not root, no ``ip``), for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

COMMAND_TIMEOUT_S = 10.0
REPO = Path(__file__).parent.parent


def skip_reason() -> str | None:
    """Why these tests cannot make namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"nb{os.getpid()}p"
    result = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S
    )
    if result.returncode != 0:
        return f"cannot make a network namespace: {result.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], timeout=COMMAND_TIMEOUT_S, check=False)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)


_made_here = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


class Network:
    """``count`` hosts (network namespaces) on one private subnet."""

    def __init__(self, count: int) -> None:
        # One pytest worker may hold several at once (the Slurm tests keep theirs for the whole
        # session): a letter per network made in this process. The subnets may repeat: each
        # network's hosts see only their own namespaces.
        tag = f"nb{os.getpid() % 100000}{next(_made_here)}"
        self.subnet = f"10.77.{os.getpid() % 250 + 1}"
        self.bridge = f"{tag}br"
        self.hosts = [f"{tag}h{k}" for k in range(count)]
        # Each host's end of its veth; the head's "link" is the bridge.
        self.links = [self.bridge] + [f"{tag}v{k}" for k in range(1, count)]
        self.addresses = [f"{self.subnet}.{k + 1}" for k in range(count)]
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        head = self.hosts[0]
        for host in self.hosts:
            ip("netns", "add", host)
            self._made.append(host)
            ip("-n", host, "link", "set", "lo", "up")
        ip("-n", head, "link", "add", self.bridge, "type", "bridge")
        ip("-n", head, "addr", "add", f"{self.addresses[0]}/24", "dev", self.bridge)
        ip("-n", head, "link", "set", self.bridge, "up")
        for k, host in enumerate(self.hosts[1:], start=1):
            # The pair is made in the head's namespace: its peer end moves to the host.
            peer = f"{self.links[k]}p"
            ip("-n", head, "link", "add", peer, "type", "veth", "peer", "name", self.links[k])
            ip("-n", head, "link", "set", self.links[k], "netns", host)
            ip("-n", head, "link", "set", peer, "master", self.bridge)
            ip("-n", head, "link", "set", peer, "up")
            ip("-n", host, "addr", "add", f"{self.addresses[k]}/24", "dev", self.links[k])
            ip("-n", host, "link", "set", self.links[k], "up")

    def command(self, host: int, *argv: str) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (a partition) or bring it back."""
        ip("-n", self.hosts[host], "link", "set", self.links[host], "up" if up else "down")

    def close(self) -> None:
        """Remove the namespaces (their veths and the bridge go with them)."""
        for host in reversed(self._made):
            subprocess.run(
                ["ip", "netns", "del", host],
                capture_output=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        self._made.clear()


class Side:
    """A process on one host: its output, kept as it comes (JSON lines get their own list)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env["PYTHONFAULTHANDLER"] = "1"  # kill() dumps where a stuck one was
        env.pop("NBLAUNCH_RUN_SECRET", None)
        self.log = log
        self.lines: list[tuple[float, str]] = []  # (time.time(), line)
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        self.ended_at: float | None = None  # when the process ended
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with open(self.log, "w") as log:
            for line in self.process.stdout:
                self.lines.append((time.time(), line.rstrip("\n")))
                log.write(line)

    def _wait(self) -> None:
        self.process.wait()
        self.ended_at = time.time()

    def records(self) -> list[dict]:
        found = []
        for _, line in list(self.lines):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found

    def first(self, predicate) -> dict | None:
        return next((r for r in self.records() if predicate(r)), None)

    def line_with(self, text: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in list(self.lines) if text in line), None)

    def output(self) -> str:
        return "\n".join(line for _, line in list(self.lines))

    def tree(self) -> set[int]:
        """This process and its descendants now (the ranks among them)."""
        try:
            root = psutil.Process(self.process.pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def wait(self, timeout: float) -> int | None:
        """The exit code, once the process ended and its output was read (None: still running)."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        _wait_until(lambda: self.ended_at is not None, 5)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:  # faulthandler's dump: where it was stuck
            self.process.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(2)
        for pid in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        self.process.wait(10)
        self._reader.join(5)


def alive(pids: set[int]) -> list[str]:
    """The processes among ``pids`` still running, described."""
    left = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(predicate())
