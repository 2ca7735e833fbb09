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

import collections
import contextlib
import dataclasses
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from nblaunch.engine.detached import host_files
from nblaunch.engine.detached import registry as detached
from nblaunch.errors import LaunchError
from nblaunch.events import Lifecycle
from nblaunch.lab.files import RunFiles, owned_file, real_dir
from nblaunch.lab.summary import (
    LOST_TITLE,
    RunSummary,
    from_files,
    from_history,
    lost_view,
    pool_holder,
    pool_summary,
)
from nblaunch.lab.watch import RunWatch

# Where runs of a kernel leave their directories (the default NBLAUNCH_RUN_DIR next to a
# notebook): in the root folder and down to two folders under it.
RUN_BASE = Path(".nblaunch/runs")
# Most run directories listed from the root folder (the newest).
MAX_LISTED = 200
# How long a new watch waits for the host's history, so a first answer is not a blank picture
# (the host sends it at once; this bounds a host that hangs).
WATCH_PRIME_S = 1.0
# What the list shows of an ended run is kept while its files do not change, for this many
# runs at most (each a few hundred bytes); the whole pictures of this many (each up to ~1 MB).
MAX_RECORDS = 4096
MAX_PICTURES = 16
# How long a stop waits for the host to say the run ended, so its reply is the state after.
STOP_WAIT_S = 10.0
# How long a list read makes the records of runs it has not read before (the rest: a thread).
LIST_BUDGET_S = 1.0
# The end of a log the panel's links show.
LOG_BYTES = 1 << 20
HISTORY, RESULT = host_files.HISTORY_FILE, host_files.RESULT_FILE
_RANK_LOG = re.compile(r"^rank\d+\.log$")


@dataclasses.dataclass
class Found:
    """A run the list shows: its id and directory, and its registry entry if it is detached."""

    run_id: str
    run_dir: Path
    entry: detached.Entry | None

    def open(self, root: Path) -> RunFiles | None:
        """Its directory, opened as :mod:`nblaunch.lab.files` allows (None: gone, not ours)."""
        return RunFiles.open(self.run_dir, under=None if self.entry else root)


class RunsIndex:
    """The runs of this user that the panel shows, found afresh at each request.

    What a list shows of an ended run is made once and kept while its files' modification
    times and sizes stay the same (up to ``MAX_RECORDS`` runs, the least recently listed
    forgotten first); a run's whole picture, for its view, is kept for ``MAX_PICTURES`` runs.

    Parameters
    ----------
    root_dir
        The server's root folder, where notebooks leave ``.nblaunch/runs``.
    """

    def __init__(self, root_dir: str | os.PathLike[str]) -> None:
        self.root_dir = Path(root_dir).expanduser().resolve()
        self._lock = threading.Lock()
        self._watches: dict[str, RunWatch] = {}
        self._records: collections.OrderedDict[Path, tuple[Any, dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self._pictures: collections.OrderedDict[Path, tuple[Any, RunSummary]] = (
            collections.OrderedDict()
        )
        self._later: list[Found] = []  # runs whose records a thread makes
        self._maker: threading.Thread | None = None

    # --- finding ---------------------------------------------------------------------------------

    def entries(self) -> list[detached.Entry]:
        """The user's detached runs and pools: entries of this uid, not links, only."""
        try:
            registry = detached.registry_dir()
            found = detached.entries()
        except LaunchError:
            return []  # a registry that is not ours lists nothing
        return [entry for entry in found if owned_file(registry / f"{entry.run_id}.json")]

    def run_dirs(self) -> list[Path]:
        """Run directories under the root folder, newest first (what they hold is checked as
        they are opened: :class:`~nblaunch.lab.files.RunFiles`)."""
        found: list[Path] = []
        for base in self._run_bases():
            with contextlib.suppress(OSError), os.scandir(base) as entries:
                found.extend(
                    base / entry.name for entry in entries if entry.is_dir(follow_symlinks=False)
                )
        found.sort(key=lambda path: path.name, reverse=True)  # nblaunch's names sort by time
        return found[:MAX_LISTED]

    def _run_bases(self) -> list[Path]:
        """``.nblaunch/runs`` in the root folder and up to two folders down, no link followed."""
        bases, folders = [], [self.root_dir]
        for depth in range(3):
            below = []
            for folder in folders:
                base = folder / RUN_BASE
                if real_dir(folder / RUN_BASE.parts[0]) and real_dir(base):
                    bases.append(base)
                if depth < 2:
                    with contextlib.suppress(OSError), os.scandir(folder) as entries:
                        below.extend(
                            folder / e.name
                            for e in entries
                            if e.name != RUN_BASE.parts[0] and e.is_dir(follow_symlinks=False)
                        )
            folders = below
        return bases

    def found(self) -> list[Found]:
        """Every run and pool the list shows: detached ones first, then the root's, newest
        first (a detached run under the root is listed once)."""
        entries = self.entries()
        runs = [Found(entry.run_id, entry.run_dir, entry) for entry in entries]
        seen = {str(entry.run_dir) for entry in entries}
        runs += [Found(d.name, d, None) for d in self.run_dirs() if str(d) not in seen]
        return runs

    def find(self, run_id: str) -> Found | None:
        """The run the list shows as ``run_id``, if it does (its directory one of ours)."""
        found = next(
            (Found(run_id, e.run_dir, e) for e in self.entries() if e.run_id == run_id), None
        )
        if found is None:
            dirs = (Found(run_id, d, None) for d in self.run_dirs() if d.name == run_id)
            found = next(dirs, None)
        files = found.open(self.root_dir) if found is not None else None
        if files is None:
            return None
        files.close()
        return found

    def records(self) -> list[dict[str, Any]]:
        """Every run and pool, as the list shows them.

        A read makes what it shows of runs it has not read before for ``LIST_BUDGET_S`` at
        most (hundreds of ended runs after the server started take seconds: each history is
        unpickled once); the others are listed from their entry and files (``"pending"``) and
        made by a thread meanwhile, for the next read.
        """
        found = self.found()
        self._forget_unlisted({run.run_id for run in found if run.entry is not None})
        records, later = [], []
        deadline = time.monotonic() + LIST_BUDGET_S
        for run in found:
            files = run.open(self.root_dir)
            if files is not None:
                with files:
                    record = self._record(run, files, files.stats(), time.monotonic() < deadline)
                records.append(record)
                if record.get("pending"):
                    later.append(run)
        if later:
            self._make_later(later)
        return records

    def _make_later(self, runs: list[Found]) -> None:
        """Make the records of ``runs`` on a thread (one at a time), for the next read."""
        with self._lock:
            self._later = runs
            if self._maker is not None and self._maker.is_alive():
                return  # it takes the new list when it is done with its run
            self._maker = threading.Thread(target=self._make_records, name="nblaunch-lab-list")
            self._maker.daemon = True
            self._maker.start()

    def _make_records(self) -> None:
        while True:
            with self._lock:
                if not self._later:
                    return
                run = self._later.pop(0)
            files = run.open(self.root_dir)
            if files is not None:
                with files:
                    self._record(run, files, files.stats())

    # --- records ---------------------------------------------------------------------------------

    def _record(
        self,
        run: Found,
        files: RunFiles,
        stats: dict[str, os.stat_result],
        make: bool = True,
    ) -> dict[str, Any]:
        """What the list shows of ``run``; ``make=False``: only if it is kept, else a pending
        record (from its entry and files only)."""
        entry = run.entry
        state = entry.live_state if entry else (Lifecycle.RUNNING if files.is_live() else "")
        key = (state, sorted((name, s.st_mtime_ns, s.st_size) for name, s in stats.items()))
        cached = self._records.get(run.run_dir)
        if state != Lifecycle.RUNNING and cached is not None and cached[0] == key:
            with contextlib.suppress(KeyError):  # another thread may have let it go
                self._records.move_to_end(run.run_dir)
            return cached[1]
        if state != Lifecycle.RUNNING and not make:
            return {
                **_fields(self.root_dir, run, files, stats, state or "ended", None),
                "pending": True,
            }
        summary = self._summary(run, files, stats, state, brief=True)
        if not state:
            ended = summary.ended
            state = "ended" if ended is None else "done" if ended["ok"] else "failed"
        record = _fields(self.root_dir, run, files, stats, state, summary)
        if state != Lifecycle.RUNNING:
            self._records[run.run_dir] = (key, record)
            while len(self._records) > MAX_RECORDS:
                with contextlib.suppress(KeyError):
                    self._records.popitem(last=False)
        return record

    # --- pictures --------------------------------------------------------------------------------

    def _summary(
        self,
        run: Found,
        files: RunFiles,
        stats: dict[str, os.stat_result],
        state: str,
        brief: bool,
    ) -> RunSummary:
        """The run's picture: live from its host while it goes, else from its directory.
        ``brief``: what a list needs only (no lines of a history)."""
        entry = run.entry
        if entry is not None and entry.kind == "run":
            watch = self._watch(entry, state == Lifecycle.RUNNING, HISTORY in stats)
            if watch is not None:
                return watch.summary
            if HISTORY in stats:
                return from_history(files, brief) or from_files(files)
        if entry is not None and entry.kind == "pool" and state == Lifecycle.RUNNING:
            return pool_summary(files)
        return from_files(files, "RUNNING" if state == Lifecycle.RUNNING else "ENDED", brief)

    def _watch(self, entry: detached.Entry, live: bool, has_history: bool) -> RunWatch | None:
        """The live watch of a detached run, made while it goes; None once its history is on
        disk (the host writes it before the registry says the run ended, and sends the last
        events after: once it says so, the history is the whole picture)."""
        with self._lock:
            watch = self._watches.get(entry.run_id)
            if watch is None and live:
                try:
                    watch = self._watches[entry.run_id] = RunWatch(entry)
                except OSError:
                    return None
                watch.primed.wait(WATCH_PRIME_S)
            if watch is None:
                return None
            if (watch.done.is_set() or not live) and has_history:
                del self._watches[entry.run_id]
                watch.close()
                return None
            return watch  # live; or a host that died: what it sent is all there is

    def detail(self, run_id: str) -> dict[str, Any] | None:
        """What the run's panel shows: its list record and its picture; None if not listed."""
        run = self.find(run_id)
        files = run.open(self.root_dir) if run is not None else None
        if run is None or files is None:
            return None
        with files:
            stats = files.stats()
            record = self._record(run, files, stats)
            state = record["state"]
            key = (state, sorted((n, s.st_mtime_ns, s.st_size) for n, s in stats.items()))
            cached = self._pictures.get(run.run_dir)
            if state != Lifecycle.RUNNING and cached is not None and cached[0] == key:
                summary = cached[1]
            else:
                live = state if run.entry is not None or state == Lifecycle.RUNNING else ""
                summary = self._summary(run, files, stats, live, brief=False)
                if state != Lifecycle.RUNNING:
                    self._pictures[run.run_dir] = (key, summary)
                    while len(self._pictures) > MAX_PICTURES:
                        self._pictures.popitem(last=False)
            view = summary.to_json()
            if state == Lifecycle.LOST and run.entry is not None:
                view = lost_view(view, run.entry, files)
        return {**record, "view": view}

    def log(self, run_id: str, name: str) -> str | None:
        """The last ``LOG_BYTES`` of a run's log (``rank<N>.log``, ``host.log``,
        ``metrics.jsonl``); None if the run is not listed or has no such file of ours."""
        if not (_RANK_LOG.match(name) or name in (host_files.HOST_LOG, "metrics.jsonl")):
            return None
        run = self.find(run_id)
        files = run.open(self.root_dir) if run is not None else None
        if files is None:
            return None
        with files:
            data = files.read(name, tail=LOG_BYTES)
        return None if data is None else data.decode(errors="replace")

    # --- stopping and clearing -------------------------------------------------------------------

    def stop(self, run_id: str) -> dict[str, Any] | None:
        """Stop a detached run or pool as ``nblaunch runs stop`` does; None if not listed.

        Returns ``{"stopped": bool, "state": ...}``: False when it was not running; the state
        after the stop (its host is waited for ``STOP_WAIT_S`` at most: ``stopping`` past it).
        """
        run = self.find(run_id)
        if run is None:
            return None
        entry = run.entry
        if entry is None:
            files = run.open(self.root_dir)
            live = files is not None and files.is_live()
            if files is not None:
                files.close()
            return {
                "stopped": False,
                "state": Lifecycle.RUNNING if live else "ended",
                "why": _KERNEL_RUN,
            }
        if entry.live_state != Lifecycle.RUNNING or not _host_is_ours(entry.pid):
            return {"stopped": False, "state": entry.live_state}  # ended, or ending
        if not detached.stop_host(entry):
            return {"stopped": False, "state": entry.live_state}
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            now = next((e for e in self.entries() if e.run_id == run_id), None)
            if now is None or now.live_state != Lifecycle.RUNNING:
                return {"stopped": True, "state": now.live_state if now else "ended"}
            time.sleep(0.05)
        return {"stopped": True, "state": "stopping"}

    def clear(self, run_id: str) -> dict[str, Any] | None:
        """Remove an ended run's directory (and its registry entry); None if not listed.

        Returns ``{"cleared": bool, ...}``: False, and why, for a run that still goes.
        """
        run = self.find(run_id)
        if run is None:
            return None
        files = run.open(self.root_dir)
        if files is None:
            return None
        with files:
            state = (
                run.entry.live_state if run.entry else Lifecycle.RUNNING if files.is_live() else ""
            )
            if state in (Lifecycle.RUNNING, Lifecycle.STARTING) or files.is_live():
                return {"cleared": False, "why": "it is still running: stop it first"}
            if run.entry is not None and detached.host_alive(run.entry.pid):
                # A stopped run's host still writes its outcome: without its directory it
                # would keep the outcome for a notebook that never comes.
                return {"cleared": False, "why": "its host is still ending: try again"}
        parent = RunFiles.open(run.run_dir.parent, under=None)
        if parent is None:
            return {"cleared": False, "why": f"cannot open {run.run_dir.parent}"}
        with parent:
            # fd-based: a link put in its place is refused, nothing outside it is removed
            shutil.rmtree(run.run_dir.name, dir_fd=parent.fd, ignore_errors=True)
        if run.entry is not None:
            with contextlib.suppress(OSError):
                (detached.registry_dir() / f"{run.run_id}.json").unlink()
        with self._lock:
            self._records.pop(run.run_dir, None)
            self._pictures.pop(run.run_dir, None)
        return {"cleared": True, "run_dir": str(run.run_dir)}

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


def _fields(
    root: Path,
    run: Found,
    files: RunFiles,
    stats: dict[str, os.stat_result],
    state: str,
    summary: RunSummary | None,
) -> dict[str, Any]:
    """What the list shows of a run (``summary``: None for a pending one)."""
    entry = run.entry
    ranks = [name for name in stats if _RANK_LOG.match(name)]
    pool = entry is not None and entry.kind == "pool"
    return {
        "id": run.run_id,
        "kind": entry.kind if entry else "run",
        "detached": entry is not None,
        "state": state,
        "ranks": entry.world_size if entry else len(ranks),
        "devices": summary.devices() if summary else [],
        "cause": LOST_TITLE if state == Lifecycle.LOST else summary.root_cause() if summary else "",
        "last_step": summary.last_step if summary else None,
        "pid": entry.pid if entry else None,
        "function": entry.function if entry else "",
        "name": _name(run),
        "origin": entry.origin if entry else _notebook_folder(root, run.run_dir),
        "run_dir": str(run.run_dir),
        "folder": _folder(root, run.run_dir),
        "logs": sorted(ranks, key=lambda name: int(name[4:-4])),
        "started": entry.started_at if entry else _started_at(run.run_dir, files),
        "ended": None if state == Lifecycle.RUNNING else _ended_at(stats),
        "holder": pool_holder(files) if pool and state == Lifecycle.RUNNING else None,
    }


def _name(run: Found) -> str:
    """What the run runs, as the list names it first."""
    if run.entry is not None and run.entry.kind == "pool":
        return "pool"
    if run.entry is not None and run.entry.function:
        return run.entry.function
    return "a kernel's run" if run.entry is None else "a detached run"


def _notebook_folder(root: Path, run_dir: Path) -> str:
    """Where a kernel's run came from: the folder of its notebook (it holds .nblaunch/runs)."""
    folder = _folder(root, run_dir.parent.parent.parent)
    return f"{folder}/" if folder not in (None, ".") else "the root folder"


def _folder(root: Path, run_dir: Path) -> str | None:
    """The run directory relative to the root folder (where Lab's file browser opens it)."""
    try:
        return run_dir.relative_to(root).as_posix()
    except ValueError:
        return None


_KERNEL_RUN = (
    "this run belongs to a kernel, not to a run host: stop it from its notebook "
    "(the view's Stop button, or interrupt the kernel)"
)


def _ended_at(stats: dict[str, os.stat_result]) -> float | None:
    times = [s.st_mtime for n, s in stats.items() if n == RESULT or _RANK_LOG.match(n)]
    return max(times, default=None)


def _host_is_ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _started_at(run_dir: Path, files: RunFiles) -> float | None:
    """When nblaunch named the directory (``20261203-084512-123456-3fa9``), else its mtime."""
    try:
        return time.mktime(time.strptime(run_dir.name[:15], "%Y%m%d-%H%M%S"))
    except ValueError:
        try:
            return os.fstat(files.fd).st_mtime
        except OSError:
            return None
