"""Named semaphores that a stopped rank leaves behind, released by its supervisor.

Every ``multiprocessing`` lock, semaphore and queue is a named POSIX semaphore whose name is
registered with the *resource tracker*, a helper process that the launcher and all its ranks
share (forkserver and spawn children inherit its pipe). A process unregisters its names when it
exits normally, in multiprocessing's exit handlers. A rank that nblaunch stops with SIGTERM or
SIGKILL (a peer failed, a timeout, an interrupt that got no answer) never runs them, so when the
launching process exits, the tracker unlinks the names and warns "There appear to be N leaked
semaphore objects to clean up at shutdown". tqdm makes such a lock the first time it draws a
bar: every failed run whose ranks showed a progress bar ended with that warning.

So each rank notes, in a file of its own, the semaphores it registers and unregisters
(:func:`track`), and once a rank has ended, the supervisor unlinks and unregisters what it left
(:func:`release`). Only semaphores: multiprocessing unlinks a semaphore at every normal exit, so
one left registered can only belong to a process that was killed, never to code that forgot to
release it. Shared memory a rank leaves registered is still reported by the tracker, since that
can be a real leak.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

SEMAPHORE = "semaphore"  # the resource tracker's name for the type

_fd: int | None = None  # the rank's record file, opened at the first semaphore
_path: Path | None = None
_tracker_fd: int | None = None  # the tracker pipe this rank shares with its supervisor
_open_lock = threading.Lock()  # any thread may make the first semaphore
_directory: str | None = None  # in the launcher: see directory()


def directory() -> str:
    """In the launcher: the private directory its ranks note their semaphores in (made once).

    It holds a file only while a rank that made a semaphore runs; it is removed at exit.
    """
    global _directory
    if _directory is None:
        import atexit
        import tempfile

        _directory = tempfile.mkdtemp(prefix="nblaunch-semaphores-")
        atexit.register(_remove_directory, _directory, os.getpid())
    return _directory


def _remove_directory(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a child that inherited the exit handler
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def track(directory: str | os.PathLike[str] | None) -> None:
    """In a rank: record semaphore (un)registrations in ``directory/<pid>``.

    Does nothing when ``directory`` is None, or when this process does not share its parent's
    resource tracker (then the parent could not unregister the names anyway).
    """
    global _path, _tracker_fd
    from multiprocessing import resource_tracker

    tracker_fd = resource_tracker._resource_tracker._fd
    if directory is None or tracker_fd is None:
        return
    _path = Path(directory) / str(os.getpid())
    _tracker_fd = tracker_fd
    original_register = resource_tracker.register
    original_unregister = resource_tracker.unregister

    def register(name: str, rtype: str) -> None:
        original_register(name, rtype)
        if rtype == SEMAPHORE:
            _note("+", name)  # after the tracker has it: never release what it does not know

    def unregister(name: str, rtype: str) -> None:
        if rtype == SEMAPHORE:
            _note("-", name)  # before: killed in between, the tracker still reports it
        original_unregister(name, rtype)

    resource_tracker.register = register
    resource_tracker.unregister = unregister


def release(directory: str | os.PathLike[str] | None, pid: int | None) -> list[str]:
    """In the supervisor: unlink and unregister what the ended rank ``pid`` left registered.

    Returns the names released.
    """
    if directory is None or pid is None:
        return []
    path = Path(directory) / str(pid)
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    live: dict[str, None] = {}
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # cut short by the kill: the name may not have reached the tracker
        sign, name = line[:1], line[1:-1]
        if sign == "+":
            live[name] = None
        else:
            live.pop(name, None)
    if live:
        import _multiprocessing
        from multiprocessing import resource_tracker

        for name in live:
            with contextlib.suppress(OSError):
                _multiprocessing.sem_unlink(name)
            resource_tracker.unregister(name, SEMAPHORE)
    with contextlib.suppress(OSError):
        path.unlink()
    return list(live)


def _note(sign: str, name: str) -> None:
    global _fd
    from multiprocessing import resource_tracker

    if _path is None or resource_tracker._resource_tracker._fd != _tracker_fd:
        return  # the tracker was relaunched here: it is no longer the supervisor's
    with contextlib.suppress(OSError):
        with _open_lock:
            if _fd is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                _fd = os.open(_path, flags, 0o600)
        os.write(_fd, f"{sign}{name}\n".encode("ascii", "replace"))  # one write: one line
