"""A rank's whole process tree ends with the rank and with the run.

Ranks start children of their own: a data loader's workers, a tool run with ``subprocess``,
wandb's or tensorboard's service, a daemon that calls ``setsid``. Left alone they outlive the
run, re-parented to init, and keep what they inherited open (the resource tracker's pipe, the
caller's output), so a script's harness waiting for the end of its output hangs. Three layers:

- each rank is a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a descendant whose parent
  exits (the double fork of a daemon) is re-parented to the rank instead of init, so every
  descendant stays in the rank's tree while the rank lives;
- a rank ends its descendants itself when it leaves (its task loop ended, or the launcher died),
  before multiprocessing's exit handler would wait for its non-daemon children;
- the supervisor ends the descendants of a rank it stops with a signal (taken just before), and
  after a rank died abruptly, every process that carries the run's marker variable
  (``TREE_ENV``, inherited by whatever a rank starts).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import sys
import threading
import time

import psutil

# Environment variable every rank and its descendants carry: this run's marker.
TREE_ENV = "NBLAUNCH_PROCESS_TREE"
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux only).

    Returns whether it worked.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """The live descendants of ``pid`` (default: this process)."""
    pids = _descendant_pids(os.getpid() if pid is None else pid)
    if pids is None:  # no /proc/PID/task/TID/children here: ask psutil (reads every process)
        try:
            return [p for p in psutil.Process(pid).children(recursive=True) if _running(p)]
        except psutil.Error:
            return []
    found = []
    for child in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(child)
            if _running(process):
                found.append(process)
    return found


def _descendant_pids(pid: int) -> list[int] | None:
    """Descendants from Linux's per-thread ``children`` files: a few reads however many
    processes the machine runs (psutil scans all of /proc). None where the files are missing."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            if parent == pid:
                return None
            continue  # it just exited
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as file:
                    children = [int(child) for child in file.read().split()]
            except FileNotFoundError:
                if parent == pid:
                    return None  # a kernel without CONFIG_PROC_CHILDREN
                continue
            except OSError:
                continue
            found += children
            stack += children
    return found


def marked(marker: str) -> list[psutil.Process]:
    """Processes of this user whose environment holds ``TREE_ENV=marker``."""
    found = []
    me = os.getuid()
    for process in psutil.process_iter(["uids"]):
        try:
            if process.info["uids"] is None or process.info["uids"].real != me:
                continue
            if process.environ().get(TREE_ENV) == marker and _running(process):
                found.append(process)
        except psutil.Error:
            continue
    return found


def end(processes: list[psutil.Process], grace: float) -> None:
    """SIGTERM ``processes``, wait up to ``grace`` seconds, then SIGKILL what is left."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    deadline = time.monotonic() + grace
    left = processes
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        for process in left:
            _reap(process)
        left = [p for p in left if _running(p)]
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    for process in left:
        _reap(process)


def end_descendants(grace: float = 1.0) -> None:
    """In a rank that is leaving: end everything it started, and whatever that started."""
    end(descendants(), grace)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(process: psutil.Process) -> None:
    """Collect ``process`` if it is an exited child of this one (a subreaper inherits orphans);
    never ``waitpid(-1)``, which would steal other code's children."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(process.pid, os.WNOHANG)


def watch_launcher(launcher_pid: int) -> None:
    """Exit this rank when the launching process dies, whatever killed it.

    The rank's parent may be a forkserver, not the launcher, so parent-death signals do not
    help; a pidfd becomes readable when the launcher exits.
    """

    def watch() -> None:
        try:
            pidfd = os.pidfd_open(launcher_pid)
        except ProcessLookupError:
            _leave()
        except (AttributeError, OSError):
            while _pid_alive(launcher_pid):  # no pidfd (old kernel): poll
                time.sleep(0.5)
            _leave()
        select.select([pidfd], [], [])
        _leave()

    def _leave() -> None:
        end_descendants(grace=0.5)
        os._exit(1)

    threading.Thread(target=watch, name="nblaunch-launcher-watch", daemon=True).start()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
