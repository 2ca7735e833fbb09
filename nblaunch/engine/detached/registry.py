"""Detached runs: the ranks under a run host of nblaunch's own, so the run outlives the kernel.

``notebook_launcher(..., detach=True)`` plans the run here (a bad argument is the cell's error),
writes the plan and payload into the run directory and starts ``python -m nblaunch.host`` in a
session of its own, handing it the run directory's lease. The host runs the engine
(:mod:`nblaunch.host.main`) and serves the run's events on a Unix socket
(:mod:`nblaunch.engine.detached.wire`); the notebook is one of its clients (:class:`AttachedRun`),
and any later kernel of the same user can be another (``nblaunch.attach``).

Every detached run has an entry, ``<id>.json``, in the user's registry of this machine
(``NBLAUNCH_DETACHED_DIR``, default ``$TMPDIR/nblaunch-<uid>``, 0700): where its directory and
socket are, its host's pid and its state. The host keeps it up to date.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nblaunch.engine.detached.host_files import (
    HOST_LOG,
    LAUNCH_FILE,
    SOCKET_FILE,
)
from nblaunch.engine.plan.launch_plan import LaunchPlan
from nblaunch.engine.plan.run_dirs import RunLease
from nblaunch.errors import LaunchError
from nblaunch.events import Lifecycle
from nblaunch.options import NodeOptions

# The state of an entry whose host is being started (its id is taken).
# How long the host may take to start (it imports torch and starts a forkserver).
HOST_START_LIMIT_S = 60.0


def registry_dir() -> Path:
    """The user's registry of detached runs on this machine, made private if missing.

    Raises
    ------
    LaunchError
        It belongs to another user or others may read it: naming the fix.
    """
    chosen = os.environ.get("NBLAUNCH_DETACHED_DIR")
    path = Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"nblaunch-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise LaunchError(
            f"cannot use {path} as the registry of detached runs ({exc.strerror or exc}); "
            "set NBLAUNCH_DETACHED_DIR to a directory of your own"
        ) from None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LaunchError(
            f"{path} (the registry of detached runs) must be yours and private (0700); "
            "fix its owner or mode, or set NBLAUNCH_DETACHED_DIR to another directory"
        )
    return path


@dataclasses.dataclass
class Entry:
    """A detached run as its registry entry describes it."""

    run_id: str
    run_dir: Path
    pid: int
    socket: str
    kind: str  # "run" or "pool"
    started_at: float
    world_size: int
    state: Lifecycle
    function: str = ""
    start_limit_s: float = HOST_START_LIMIT_S  # a pool's host starts its ranks first
    origin: str = ""  # what started it: the notebook (a kernel's session) or the script

    @classmethod
    def read(cls, path: Path) -> Entry | None:
        try:
            data = json.loads(path.read_text())
            data["run_dir"] = Path(data["run_dir"])
            data["state"] = Lifecycle(data["state"])
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None  # half written, or not ours

    def write(self) -> None:
        """Replace the entry in one step (readers never see half of it)."""
        data = dataclasses.asdict(self)
        data["run_dir"] = str(self.run_dir)
        path = registry_dir() / f"{self.run_id}.json"
        partial = path.with_suffix(".tmp")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(data, file)
        os.replace(partial, path)

    @property
    def live_state(self) -> Lifecycle:
        """The state, with a host that died without saying so as ``lost``."""
        if self.state == Lifecycle.RUNNING and not host_alive(self.pid):
            return Lifecycle.LOST
        if self.state == Lifecycle.STARTING and time.time() - self.started_at > self.start_limit_s:
            return Lifecycle.LOST  # the kernel that claimed the id died before its host started
        return self.state


def host_alive(pid: int) -> bool:
    """True when ``pid`` is a run host of nblaunch (a reused pid is not)."""
    try:
        return b"nblaunch.host" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def stop_host(entry: Entry) -> bool:
    """Ask a detached run's host to stop the run (SIGTERM); False when it is not running."""
    if not host_alive(entry.pid):
        return False
    os.kill(entry.pid, signal.SIGTERM)
    return True


def entries() -> list[Entry]:
    """Every detached run in the registry whose directory still exists, newest first."""
    found = []
    for path in registry_dir().glob("*.json"):
        entry = Entry.read(path)
        if entry is not None and entry.run_dir.is_dir():
            found.append(entry)
    return sorted(found, key=lambda e: e.started_at, reverse=True)


def find(run_id: str | None, kind: str | None = None) -> Entry:
    """The entry of ``run_id`` (a prefix will do); default: the newest run still going.
    ``kind``: only runs (``"run"``) or only pools (``"pool"``).

    Raises
    ------
    LaunchError
        No such run, or several match: listing what there is.
    """
    known = [e for e in entries() if kind is None or e.kind == kind]
    what = {"pool": "detached pool", "run": "detached run"}.get(kind or "", "detached run")
    if run_id is None:
        live = [e for e in known if e.live_state == Lifecycle.RUNNING]
        if not live:
            raise LaunchError(
                f"no {what} is going on this machine; nblaunch.runs() (or the command "
                "nblaunch runs) lists the ended ones"
            )
        return live[0]
    matches = [e for e in known if e.run_id == run_id] or [
        e for e in known if e.run_id.startswith(run_id)
    ]
    if len(matches) != 1:
        ids = ", ".join(e.run_id for e in known[:10]) or "none"
        count = "no" if not matches else "more than one"
        raise LaunchError(f"{count} {what} matches {run_id!r}; known: {ids}")
    return matches[0]


def claim_id(run_dir: Path, kind: str, start_limit_s: float = HOST_START_LIMIT_S) -> str:
    """The run's id in the registry: its directory's name, or ``<name>-2``, ``-3``, ... when
    another directory of that name has it (``run_dir=.../expA/out`` and ``.../expB/out``).

    The entry is made here at once (state ``starting``), so two starts never claim one id; a
    later run in the same directory takes its id over, as does one whose directory is gone.
    """
    registry = registry_dir()
    for number in itertools.count(1):
        run_id = run_dir.name if number == 1 else f"{run_dir.name}-{number}"
        path = registry / f"{run_id}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            held = Entry.read(path)
            if held is not None and (held.run_dir == run_dir or not held.run_dir.is_dir()):
                return run_id
            continue
        os.close(fd)
        Entry(
            run_id, run_dir, 0, "", kind, time.time(), 0, Lifecycle.STARTING, "", start_limit_s
        ).write()
        return run_id
    raise AssertionError("unreachable")


def socket_path(run_dir: Path) -> str:
    """The run directory's ``stream.sock`` (of any length: see ``wire.listen``)."""
    return str(run_dir.resolve() / SOCKET_FILE)


def start_host(run_dir: Path, lease: RunLease, launch: dict[str, Any]) -> Entry:
    """Start a run host for ``run_dir`` and return its entry once it serves.

    ``launch`` is what the host runs: ``{"kind": "run", "plan": ..., "payload": ...}`` or
    ``{"kind": "pool", "pool": {...}}``; it is written to the run directory (0600) with the
    notebook's ``sys.path`` and registry. The lease on the run directory goes to the host with
    its descriptor, so nothing can prune the directory between the two.

    Raises
    ------
    LaunchError
        The host did not start, with the end of its log.
    """
    run_dir = run_dir.resolve()
    # A pool's host writes its entry once its ranks are up: their start_timeout counts too.
    limit_s = HOST_START_LIMIT_S + launch.get("pool", {}).get("start_timeout", 0.0)
    run_id = claim_id(run_dir, launch["kind"], limit_s)
    launch = {
        **launch,
        "run_id": run_id,
        "sys_path": list(sys.path),
        "registry": str(registry_dir()),
        "origin": origin(),
    }
    entry_path = registry_dir() / f"{run_id}.json"
    try:
        fd = os.open(run_dir / LAUNCH_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:
            pickle.dump(launch, file, protocol=pickle.HIGHEST_PROTOCOL)
        log = os.open(run_dir / HOST_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:  # a full or read-only disk: the host could not read its launch
        _free_id(entry_path)
        raise LaunchError(
            f"cannot start a detached run in {run_dir}: writing its launch file failed "
            f"({exc.strerror or exc}). Free the disk, or pass run_dir= a directory you can "
            "write to"
        ) from None
    lease_fd = lease.fd
    try:
        host = subprocess.Popen(
            [sys.executable, "-m", "nblaunch.host", str(run_dir), str(lease_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(lease_fd,),
            start_new_session=True,  # a kernel restart signals the kernel's group, not this one
        )
    finally:
        os.close(log)
    # Reaped when it exits, or the ended host stays a zombie child of the kernel until it does
    # (no SIGCHLD handler: that is the user's process to set up).
    reaper = threading.Thread(target=host.wait, name=f"nblaunch-reap-{host.pid}", daemon=True)
    reaper.start()
    lease.release()  # the host holds the lock now
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        entry = Entry.read(entry_path)
        if entry is not None and entry.pid == host.pid:
            return entry
        if not reaper.is_alive():  # the host exited (poll() would wait on the reaper's lock)
            break
        time.sleep(0.02)
    else:
        host.kill()
    _free_id(entry_path)
    code = host.wait()
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    try:
        tail = (run_dir / HOST_LOG).read_text(errors="replace")[-2000:]
    except OSError:
        tail = ""
    raise LaunchError(f"the run host did not start ({how}; see {run_dir / HOST_LOG}):\n{tail}")


def origin() -> str:
    """What starts a run here: the notebook of a Jupyter kernel (its session's path), else the
    script's name; "" for ``python -c`` or an interactive interpreter."""
    notebook = os.environ.get("JPY_SESSION_NAME", "")
    if notebook:
        return notebook
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""
    return os.path.basename(script) if script.endswith(".py") else ""


def _free_id(entry_path: Path) -> None:
    """Give back an id claimed for a host that did not start."""
    left = Entry.read(entry_path)
    if left is not None and left.state == Lifecycle.STARTING:
        entry_path.unlink(missing_ok=True)


def start_run_host(
    plan: LaunchPlan, payload: bytes, function: str = "", nodes: NodeOptions | None = None
) -> Entry:
    """Start the run host of a detached one-shot run (``notebook_launcher(detach=True)``); with
    ``nodes``, of a multi-node run (the host is its notebook node: it hosts the rendezvous and
    starts the other nodes' joins, if asked)."""
    assert plan.run_dir is not None and plan.run_lease is not None
    launch = {"kind": "run", "plan": dataclasses.replace(plan, run_lease=None)}
    launch.update(payload=payload, function=function, nodes=nodes)
    return start_host(plan.run_dir, plan.run_lease, launch)
