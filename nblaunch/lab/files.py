"""A run's files as the server reads them: this user's only, never through a symlink.

The server lists runs from folders other users may write into (a group-writable project, a
``root_dir=/home``), and a server run as root could open any file. So every directory on the way
from the root folder to a run's files is opened with ``O_NOFOLLOW`` relative to the one above
it, every file is opened with ``O_NOFOLLOW`` relative to its run directory's descriptor, and each
must belong to the server's uid (``fstat`` on what was opened, so nothing can be swapped between
a check and a read). Nothing is opened for writing: whether a run still holds its lease is asked
with a shared ``flock`` on a read-only descriptor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from nblaunch.engine.plan.run_dirs import LEASE_FILE

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a file's name must not hang the server (it is refused after).
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _ours(info: os.stat_result) -> bool:
    return info.st_uid == os.getuid()


def open_dir(parts: list[str], dir_fd: int, owned: int) -> int | None:
    """A descriptor of ``parts`` below ``dir_fd``, each reached without a symlink, the last
    ``owned`` of them directories of this uid; None otherwise."""
    fd = os.dup(dir_fd)
    try:
        for number, part in enumerate(parts):
            if part in ("", ".", ".."):
                return None
            inner = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = inner
            if number >= len(parts) - owned and not _ours(os.fstat(fd)):
                return None
        found, fd = fd, -1
        return found
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def owned_file(path: Path) -> bool:
    """A regular file of this uid at ``path`` itself (not through a link)."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def real_dir(path: Path) -> bool:
    """A directory at ``path`` itself (not through a link)."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


class RunFiles:
    """An open run directory of this uid; a context manager that closes it.

    ``RunFiles.open(path, under=root)`` opens every folder from ``root`` down without following
    a link, and ``.nblaunch``, ``runs`` and the run's own must be this uid's (a kernel's run under
    the server's root folder: a folder above them may be a group's); without ``under`` the run
    directory itself is opened so and checked (a detached run, whose path the user's private
    registry names).
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: Path, under: Path | None = None) -> RunFiles | None:
        if under is not None:
            try:
                parts = list(path.relative_to(under).parts)
            except ValueError:
                return None
            base = os.open(under, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            parts = [path.name]
            try:
                base = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            fd = open_dir(parts, base, owned=3 if under is not None else 1) if parts else None
        finally:
            os.close(base)
        return None if fd is None else cls(fd, path)

    def __enter__(self) -> RunFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- reading ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, os.stat_result]:
        """The regular files of this uid in the directory (not following links), by name."""
        found = {}
        with contextlib.suppress(OSError), os.scandir(self.fd) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and _ours(info):
                        found[entry.name] = info
        return found

    @contextlib.contextmanager
    def _file(self, name: str) -> Iterator[int | None]:
        try:
            fd = os.open(name, _FILE, dir_fd=self.fd)
        except OSError:
            yield None
            return
        try:
            info = os.fstat(fd)
            yield fd if stat.S_ISREG(info.st_mode) and _ours(info) else None
        finally:
            os.close(fd)

    def read(self, name: str, tail: int | None = None) -> bytes | None:
        """The file's bytes (its last ``tail`` bytes), or None: absent, a link, not ours."""
        with self._file(name) as fd:
            if fd is None:
                return None
            try:
                if tail is not None:
                    os.lseek(fd, max(0, os.fstat(fd).st_size - tail), os.SEEK_SET)
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                return b"".join(chunks)
            except OSError:
                return None

    def text_tail(self, name: str, size: int) -> str:
        """The last ``size`` bytes of a log as text, without its first, cut, line."""
        data = self.read(name, tail=size)
        if data is None:
            return ""
        if len(data) >= size:
            data = data.split(b"\n", 1)[-1]
        return data.decode(errors="replace")

    def is_live(self) -> bool:
        """Whether a run still holds the directory's lease (read-only: a shared ``flock`` is
        refused while the run holds its exclusive one)."""
        with self._file(LEASE_FILE) as fd:
            if fd is None:
                return False  # no lease (an older run), or one that is not a file of ours
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            except OSError:
                return False
            return False  # closing the descriptor drops the shared lock
