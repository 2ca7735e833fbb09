"""What a run host leaves of a run's end: its outcome, pickled, in files only its user reads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from nblaunch.errors import RankFailedError


def pickled(outcome: dict[str, Any], world_size: int) -> bytes:
    """The outcome as a cloudpickle (a rank's exception may be of a class the notebook made);
    one that will not pickle is told in words."""
    import cloudpickle

    try:
        return cloudpickle.dumps(outcome)
    except Exception as exc:
        what = "a value" if "values" in outcome else f"the error {outcome['error']!r}"
        error = RankFailedError(
            f"the run ended, but {what} could not be pickled to send back ({exc})",
            rank=0,
            world_size=world_size,
        )
        return cloudpickle.dumps({"error": error})


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by this user only (0600 from the start), whole or
    not at all: written beside it and renamed over it. A notebook that attaches while the host
    writes (or, on a full disk, retries) its outcome would take a part of it for a lost run."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
