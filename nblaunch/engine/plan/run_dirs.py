"""Run directories: named by time, held by their run while it lives, pruned only once finished.

Every launch writes into a directory of its own (rank logs, ``metrics.jsonl``). Under the default
base, nblaunch names it (``20261203-084512-123456-3fa9``: date, time, microseconds, a random
part) so that names sort by time, and prunes the oldest so the base does not grow forever.

A run *leases* its directory: it holds an exclusive ``flock`` on ``<run dir>/.lease`` from the
moment the directory is made until the run ends (a one-shot launch) or the pool closes. Pruning,
in this process or any other (a second notebook in the same folder), tries that lock first and
leaves a directory whose lock is held: a live run's logs are never deleted, and only finished
runs count towards ``NBLAUNCH_KEEP_RUNS``. The operating system drops the lock when the process
dies, so a crashed kernel's runs become finished runs, prunable like any other.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

from nblaunch.errors import LaunchError
from nblaunch.options import keep_runs_from_env

LEASE_FILE = ".lease"
# A run directory nblaunch named itself: "20261203-084512-123456-3fa9", or the older
# "20261203-084512-3fa9c1" (same second: not ordered by time).
_RUN_DIR_NAME = re.compile(r"^\d{8}-\d{6}-(\d{6}-[0-9a-f]{4}|[0-9a-f]{6})$")


class RunLease:
    """The run's hold on its directory: an exclusive ``flock`` while the run lives.

    ``release()`` when the run ends; a lease that is never released ends with the object or the
    process, so nothing is held forever.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        # Under nblaunch's base: (base, keep), pruned again once this run finished, so the base
        # holds the newest ``keep`` finished runs, not one more (it was live at its launch).
        self.prune_to: tuple[Path, int] | None = None
        self._fd: int | None = os.open(run_dir / LEASE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    @classmethod
    def adopt(cls, run_dir: Path, fd: int) -> RunLease:
        """The lease another process took and handed down with ``fd`` (a detached run's host
        inherits it from the notebook: the lock never lapses between the two)."""
        lease = cls.__new__(cls)
        lease.run_dir, lease._fd, lease.prune_to = run_dir, fd, None
        return lease

    @property
    def fd(self) -> int | None:
        """The locked descriptor, to hand to a process that takes the run over."""
        return self._fd

    def release(self) -> None:
        """The run is over: its directory may be pruned from now on (and the oldest finished
        ones are, under nblaunch's base)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
            if self.prune_to is not None:  # this run counts first: it just finished
                prune_runs(*self.prune_to, finished=self.run_dir)

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_live(run_dir: Path) -> bool:
    """Whether a run still holds ``run_dir`` (in this process or another)."""
    try:
        fd = os.open(run_dir / LEASE_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False  # a run of an older nblaunch, or one whose directory was half made
    except OSError:
        return True  # unreadable: leave it alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def new_run_dir(run_dir: str | os.PathLike[str] | None) -> tuple[Path, RunLease]:
    """Make the run's directory now, so a bad one fails before any rank starts, and lease it.

    Under the default base (``NBLAUNCH_RUN_DIR``, else ``.nblaunch/runs``) the name is made
    here and the oldest finished runs are pruned.

    Raises
    ------
    LaunchError
        The directory cannot be made or written, naming it and how to choose another; or a
        bad ``NBLAUNCH_KEEP_RUNS``.
    """
    base = None
    if run_dir is not None:
        path, chosen_by = Path(run_dir), "run_dir="
    else:
        base = Path(os.environ.get("NBLAUNCH_RUN_DIR") or ".nblaunch/runs")
        now = datetime.datetime.now()
        path = base / f"{now:%Y%m%d-%H%M%S}-{now.microsecond:06d}-{secrets.token_hex(2)}"
        chosen_by = "NBLAUNCH_RUN_DIR" if os.environ.get("NBLAUNCH_RUN_DIR") else "the default"
    keep = keep_runs_from_env() if base is not None else 0
    try:
        # Private: the logs hold whatever the ranks print, tokens included.
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = None if os.access(path, os.W_OK) else "it is not writable"
        lease = RunLease(path) if problem is None else None
    except OSError as exc:
        problem, lease = f"{type(exc).__name__}: {exc.strerror or exc}", None
    if problem or lease is None:
        raise LaunchError(
            f"cannot use {path} (from {chosen_by}) for the run's logs: {problem}. Pass "
            "run_dir= a directory you can write to (or set NBLAUNCH_RUN_DIR)."
        )
    if base is not None:
        prune_runs(base, keep)
        lease.prune_to = (base, keep)
    return path, lease


def prune_runs(base: Path, keep: int, finished: Path | None = None) -> list[Path]:
    """Remove the oldest finished run directories nblaunch named under ``base``, keeping the
    newest ``keep`` finished ones (0 keeps every one); a live run's is never touched.
    ``finished``: a run that just ended, counted as the newest and never removed (a long run
    must not lose its logs at its end to runs that started after it).

    Best effort; returns what was removed.
    """
    if keep <= 0:
        return []
    try:
        with os.scandir(base) as entries:  # no stat per entry: this runs at every launch
            names = sorted(e.name for e in entries if _RUN_DIR_NAME.match(e.name) and e.is_dir())
    except OSError:
        return []
    counted = 0 if finished is None else 1
    removed = []
    for name in reversed(names):  # newest first: keep the first ``keep`` finished ones
        path = base / name
        if (finished is not None and path.name == finished.name) or is_live(path):
            continue
        counted += 1
        if counted > keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
