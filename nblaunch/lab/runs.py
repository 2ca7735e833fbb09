"""The runs the panel lists: the user's detached runs and pools, and the runs under the root folder.

:class:`RunsIndex` is the server extension's one object. It reads the user's registry of
detached runs (:mod:`nblaunch.engine.detached.registry`) and the run directories under the server's
root folder (``.nblaunch/runs/*`` there and up to two folders down), keeps a live
:class:`RunWatch` on each detached run it is asked about while that run goes, and stops runs as
``nblaunch runs stop`` does. Everything it lists belongs to the server's own user: an entry or a
run directory owned by another uid is skipped, whatever the permissions would allow (a server
run as root reads every file).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any

from nblaunch.engine.detached import host_files, pool_holder, wire
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.run_dirs import is_live
from nblaunch.errors import LaunchError
from nblaunch.events import Lifecycle
from nblaunch.lab.summary import RunSummary, from_files

# Where runs of a kernel leave their directories, relative to the root folder (the default
# NBLAUNCH_RUN_DIR next to a notebook), down to two folders under the root.
RUN_DIR_PATTERNS = (".nblaunch/runs/*", "*/.nblaunch/runs/*", "*/*/.nblaunch/runs/*")
# Most run directories listed from the root folder (the newest).
MAX_LISTED = 200
# How long a new watch waits for the host's history, so a first answer is not a blank picture
# (the host sends it at once; this bounds a host that hangs).
WATCH_PRIME_S = 1.0
# An ended run's picture is kept while its files do not change; this many at most.
MAX_CACHED = 64


def owned(path: Path) -> bool:
    """True when ``path`` exists and belongs to the user the server runs as."""
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


class RunWatch:
    """A live connection to a detached run's host, folding its events into a summary.

    The host gives a new client the run's history first, then its events; the watch ends when
    the host closes the connection (the run ended, or the host died).
    """

    def __init__(self, entry: detached.Entry) -> None:
        self.entry = entry
        self.summary = RunSummary()
        self.done = threading.Event()
        self.primed = threading.Event()  # the host's history came (or the connection ended)
        self._sock = wire.connect(entry.socket)
        wire.send(self._sock, wire.WATCH, None)  # a notebook, not the panel, takes the outcome
        thread = threading.Thread(target=self._read, name=f"nblaunch-lab-{entry.run_id}")
        thread.daemon = True
        thread.start()

    def _read(self) -> None:
        try:
            while (message := wire.receive(self._sock)) is not None:
                kind, body = message
                if kind == wire.EVENTS:
                    self.summary.handle_many(body)
                    self.primed.set()
                elif kind == wire.CLOSED:
                    break
                # wire.OUTCOME is a cloudpickle the server need not open: the registry's state
                # and the history say how the run ended.
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            pass  # the host went away
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()
            self.primed.set()
            self.done.set()

    def stop(self) -> None:
        """Ask the host to stop the run, as the view's Stop button does."""
        with contextlib.suppress(OSError):
            wire.send(self._sock, wire.STOP, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class RunsIndex:
    """The runs of this user that the panel shows, found afresh at each request.

    Parameters
    ----------
    root_dir
        The server's root folder, where notebooks leave ``.nblaunch/runs``.
    """

    def __init__(self, root_dir: str | os.PathLike[str]) -> None:
        self.root_dir = Path(root_dir).expanduser().resolve()
        self._lock = threading.Lock()
        self._watches: dict[str, RunWatch] = {}
        self._ended: dict[Path, tuple[float, RunSummary]] = {}
        self._dir_records: dict[Path, tuple[float, dict[str, Any]]] = {}

    # --- finding ---------------------------------------------------------------------------------

    def entries(self) -> list[detached.Entry]:
        """The user's detached runs and pools: entries and directories of this uid only."""
        try:
            registry = detached.registry_dir()
            found = detached.entries()
        except LaunchError:
            return []  # a registry that is not ours lists nothing
        return [
            entry
            for entry in found
            if owned(registry / f"{entry.run_id}.json") and owned(entry.run_dir)
        ]

    def run_dirs(self) -> list[Path]:
        """Run directories of this uid under the root folder, newest first."""
        found: list[Path] = []
        for pattern in RUN_DIR_PATTERNS:
            found.extend(path for path in self.root_dir.glob(pattern) if path.is_dir())
        found.sort(key=lambda path: path.name, reverse=True)  # the names sort by time
        return [path for path in found[: MAX_LISTED * 2] if owned(path)][:MAX_LISTED]

    def records(self) -> list[dict[str, Any]]:
        """Every run and pool, as the list shows them: detached ones first, newest first."""
        records, seen = [], set()
        entries = self.entries()
        self._forget_unlisted({entry.run_id for entry in entries})
        for entry in entries:
            records.append(self._entry_record(entry))
            seen.add(entry.run_dir.resolve())
        for run_dir in self.run_dirs():
            if not seen or run_dir.resolve() not in seen:
                records.append(self._dir_record(run_dir))
        return records

    def find(self, run_id: str) -> tuple[detached.Entry | None, Path] | None:
        """The entry (None for a run of a kernel) and directory of ``run_id``, if it is listed."""
        for entry in self.entries():
            if entry.run_id == run_id:
                return entry, entry.run_dir
        for run_dir in self.run_dirs():
            if run_dir.name == run_id:
                return None, run_dir
        return None

    # --- records ---------------------------------------------------------------------------------

    def _entry_record(self, entry: detached.Entry) -> dict[str, Any]:
        state = entry.live_state
        summary = self.summary_of(entry, entry.run_dir) if entry.kind == "run" else None
        return {
            **self._base(entry.run_id, entry.run_dir, summary),
            "kind": entry.kind,
            "detached": True,
            "state": state,
            "ranks": entry.world_size,
            "pid": entry.pid,
            "function": entry.function,
            "started": entry.started_at,
            "ended": self._ended_at(entry.run_dir) if state != Lifecycle.RUNNING else None,
            "holder": _holder(entry) if state == Lifecycle.RUNNING else None,
        }

    def _dir_record(self, run_dir: Path) -> dict[str, Any]:
        live = is_live(run_dir)
        try:
            stamp = run_dir.stat().st_mtime
        except OSError:
            stamp = -1.0
        cached = self._dir_records.get(run_dir)
        if not live and cached is not None and cached[0] == stamp:
            return cached[1]  # an ended run's directory does not change
        record = self._new_dir_record(run_dir, live)
        if not live:
            if len(self._dir_records) >= MAX_LISTED * 2:
                self._dir_records.pop(next(iter(self._dir_records)))
            self._dir_records[run_dir] = (stamp, record)
        return record

    def _new_dir_record(self, run_dir: Path, live: bool) -> dict[str, Any]:
        history = run_dir / host_files.HISTORY_FILE
        summary = self.summary_of(None, run_dir) if history.exists() else None
        if live:
            state = Lifecycle.RUNNING
        elif summary is not None and summary.ended is not None:
            state = "done" if summary.ended["ok"] else "failed"
        else:
            state = "ended"  # a kernel's run: its logs say how it went, nothing else does
        ranks = len([path for path in run_dir.glob("rank*.log") if path.stem[4:].isdigit()])
        return {
            **self._base(run_dir.name, run_dir, summary),
            "kind": "run",
            "detached": False,
            "state": state,
            "ranks": ranks,
            "pid": None,
            "function": "",
            "started": _started_at(run_dir),
            "ended": None if live else self._ended_at(run_dir),
            "holder": None,
        }

    def _base(self, run_id: str, run_dir: Path, summary: RunSummary | None) -> dict[str, Any]:
        return {
            "id": run_id,
            "run_dir": str(run_dir),
            "devices": summary.devices() if summary else [],
            "cause": summary.root_cause() if summary else "",
            "last_step": summary.last_step if summary else None,
        }

    def _ended_at(self, run_dir: Path) -> float | None:
        times = [
            path.stat().st_mtime
            for path in (run_dir / host_files.RESULT_FILE, *run_dir.glob("rank*.log"))
            if path.exists()
        ]
        return max(times, default=None)

    # --- pictures --------------------------------------------------------------------------------

    def summary_of(self, entry: detached.Entry | None, run_dir: Path) -> RunSummary:
        """The run's picture: live from its host while it goes, else from its directory."""
        with self._lock:
            watch = self._watches.get(entry.run_id) if entry else None
            live = (
                entry is not None and entry.kind == "run" and entry.live_state == Lifecycle.RUNNING
            )
            if watch is None and live:
                assert entry is not None
                with contextlib.suppress(OSError):
                    watch = self._watches[entry.run_id] = RunWatch(entry)
                    watch.primed.wait(WATCH_PRIME_S)
            if watch is None:
                return self._from_disk(run_dir)
            # The host writes the history before the registry says the run ended, and sends
            # the last events after: once it says so, the history is the whole picture.
            ended = watch.done.is_set() or not live
            if ended and (run_dir / host_files.HISTORY_FILE).exists():
                assert entry is not None
                del self._watches[entry.run_id]
                watch.close()
                return self._from_disk(run_dir)
            return watch.summary  # live; or a host that died: what it sent is all there is

    def _from_disk(self, run_dir: Path) -> RunSummary:
        history = run_dir / host_files.HISTORY_FILE
        source = history if history.exists() else run_dir
        try:
            stamp = max(
                [source.stat().st_mtime, *(p.stat().st_mtime for p in run_dir.glob("*.log*"))]
            )
        except OSError:
            stamp = time.time()
        cached = self._ended.get(run_dir)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        summary = RunSummary()
        if history.exists() and owned(history):
            # The host's pickle of plain event dicts, in a directory of this user's (checked).
            try:
                summary.handle_many(pickle.loads(history.read_bytes()))
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
                summary = from_files(run_dir)
        else:
            summary = from_files(run_dir)
        if len(self._ended) >= MAX_CACHED:
            self._ended.pop(next(iter(self._ended)))
        self._ended[run_dir] = (stamp, summary)
        return summary

    def detail(self, run_id: str) -> dict[str, Any] | None:
        """What the run's panel shows: its list record and its picture; None if not listed."""
        found = self.find(run_id)
        if found is None:
            return None
        entry, run_dir = found
        record = self._entry_record(entry) if entry else self._dir_record(run_dir)
        if entry is not None and entry.kind == "pool":
            # Its host serves one kernel at a time: read from its files (kept while unchanged).
            with self._lock:
                summary = self._from_disk(run_dir)
        else:
            summary = self.summary_of(entry, run_dir)
        return {**record, "view": summary.to_json()}

    # --- stopping --------------------------------------------------------------------------------

    def stop(self, run_id: str) -> dict[str, Any] | None:
        """Stop a detached run or pool as ``nblaunch runs stop`` does; None if not listed.

        Returns ``{"stopped": bool, "state": ...}``: False when it was not running.
        """
        found = self.find(run_id)
        if found is None:
            return None
        entry = found[0]
        if entry is None:
            state = Lifecycle.RUNNING if is_live(found[1]) else "ended"
            return {"stopped": False, "state": state, "why": _KERNEL_RUN}
        if entry.live_state != Lifecycle.RUNNING or not _host_is_ours(entry.pid):
            return {"stopped": False, "state": entry.live_state}  # ended, or ending
        return {"stopped": detached.stop_host(entry), "state": entry.live_state}

    def _forget_unlisted(self, listed: set[str]) -> None:
        """Let go of the watches of runs no longer listed (their directory was removed): a
        watch of a host that died keeps what it sent for as long as the run is listed."""
        with self._lock:
            for run_id in [run_id for run_id in self._watches if run_id not in listed]:
                self._watches.pop(run_id).close()

    def close(self) -> None:
        with self._lock:
            for watch in self._watches.values():
                watch.close()
            self._watches.clear()


_KERNEL_RUN = (
    "this run belongs to a kernel, not to a run host: stop it from its notebook "
    "(the view's Stop button, or interrupt the kernel)"
)


def _holder(entry: detached.Entry) -> dict[str, Any] | None:
    """The process a detached pool's host serves now (a kernel), while it lives."""
    if entry.kind != "pool":
        return None
    holder = pool_holder.holder_of(entry.run_dir)
    if holder is None or not os.path.exists(f"/proc/{holder['pid']}"):
        return None
    return {"pid": holder["pid"], "since": holder.get("since")}


def _host_is_ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _started_at(run_dir: Path) -> float | None:
    """When nblaunch named the directory (``20261203-084512-123456-3fa9``), else its mtime."""
    try:
        return time.mktime(time.strptime(run_dir.name[:15], "%Y%m%d-%H%M%S"))
    except ValueError:
        try:
            return run_dir.stat().st_mtime
        except OSError:
            return None
