"""Which process holds a detached pool now: the host writes it, the runs panel reads it."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from nblaunch.engine.detached.host_files import HOLDER_FILE


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (as it connected), if known."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # AttributeError: no SO_PEERCRED off Linux
        return None
    return struct.unpack("3i", creds)[0] or None


def write_holder(run_dir: Path, pid: int | None) -> None:
    """Say which process holds a detached pool now (None: none), for the runs panel."""
    path = run_dir / HOLDER_FILE
    if pid is None:
        path.unlink(missing_ok=True)
        return
    partial = path.with_suffix(".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump({"pid": pid, "since": time.time()}, file)
    os.replace(partial, path)


def holder_of(run_dir: Path) -> dict[str, Any] | None:
    """What :func:`write_holder` last wrote, or None."""
    try:
        found = json.loads((run_dir / HOLDER_FILE).read_text())
        return found if isinstance(found.get("pid"), int) else None
    except (OSError, ValueError, AttributeError):
        return None
