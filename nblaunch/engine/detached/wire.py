"""The messages between a detached run's host and the notebooks watching it, on a Unix socket.

Each message is a length (8 bytes, big-endian) and a pickle. The socket is the user's own (0600
in a 0700 directory), so what it carries is as trusted as the user's files; the run's outcome
is a cloudpickle, because the exception a rank raised may be of a class the notebook defined.

The host sends, in order: ``("events", [event, ...])`` batches (the history first, then what
comes live), then once the run ended ``("outcome", bytes)`` and ``("closed", None)``. A notebook
sends ``("stop", None)``, and ``("quiet", None)`` when it wants only the outcome (a handle
that shows no view: each view has a connection of its own).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("!Q")
# The largest message read (a push or pull of a big value is one message).
MAX_MESSAGE = 1 << 36
EVENTS, OUTCOME, CLOSED, STOP, QUIET = "events", "outcome", "closed", "stop", "quiet"
# A client that only watches (the runs panel): its taking the outcome is no notebook's having it.
WATCH = "watch"


# The longest path bind and connect take for a Unix socket (108 bytes with its NUL, on Linux).
MAX_SOCKET_PATH = 107


def listen(path: str, backlog: int) -> socket.socket:
    """A Unix socket listening at ``path`` (a file left there is replaced), 0600 from the start."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old_mask = os.umask(0o177)  # not after a chmod: no moment others may connect
    try:
        sock = _unix_socket(path, socket.socket.bind)
    finally:
        os.umask(old_mask)
    sock.listen(backlog)
    return sock


def connect(path: str) -> socket.socket:
    """A connection to the Unix socket at ``path``; OSError when nothing listens there."""
    return _unix_socket(path, socket.socket.connect)


def _unix_socket(path: str, bind_or_connect: Any) -> socket.socket:
    """A Unix socket bound or connected to ``path``; a path longer than AF_UNIX takes (a deep
    run directory, a test's temporary one) through its folder opened here
    (``/proc/self/fd/N/stream.sock``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    folder = -1
    try:
        name = path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
            name = f"/proc/self/fd/{folder}/{os.path.basename(path)}"
        bind_or_connect(sock, name)
    except BaseException:
        sock.close()
        raise
    finally:
        if folder >= 0:
            os.close(folder)
    return sock


def send(sock: socket.socket, kind: str, body: Any) -> None:
    """Send one message (blocking until the kernel took it all)."""
    data = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket) -> tuple[str, Any] | None:
    """The next message, or None when the other side closed the connection."""
    header = _exactly(sock, _LENGTH.size)
    if header is None:
        return None
    size = _LENGTH.unpack(header)[0]
    if size > MAX_MESSAGE:  # not this protocol's peer (or a corrupt stream): no 2**64 buffer
        raise ValueError(f"a message of {size} bytes is past the {MAX_MESSAGE}-byte limit")
    data = _exactly(sock, size)
    if data is None:
        return None
    kind, body = pickle.loads(data)
    return kind, body


def _exactly(sock: socket.socket, size: int) -> bytearray | None:
    """``size`` bytes, read into one buffer made at once (a 50 MB push is neither grown chunk by
    chunk nor copied again at the end)."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        if not n:
            return None
        got += n
    return data
