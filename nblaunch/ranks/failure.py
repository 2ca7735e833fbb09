"""How a rank describes an exception for the notebook: type, message, traceback, the pickled
exception itself (so the notebook can raise the rank's own), and the user's line it came from.
"""

from __future__ import annotations

import os
import traceback

from nblaunch.errors import safe_str
from nblaunch.events import Failure


def failure_event(rank: int, exc: BaseException) -> Failure:
    """Describe ``exc`` for the parent: type, message, traceback text and the exception itself."""
    exc_type = type(exc)
    return {
        "kind": "failure",
        "rank": rank,
        "exc_type": f"{exc_type.__module__}.{exc_type.__qualname__}",
        "message": safe_str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, exc.__traceback__)),
        "exception_bytes": _pickle_exception(exc),
        "where": _innermost_user_frame(exc),
    }


def _pickle_exception(exc: BaseException) -> bytes | None:
    import cloudpickle
    from tblib import pickling_support

    try:
        pickling_support.install(exc)
        return cloudpickle.dumps(exc)
    except Exception:
        return None


def _innermost_user_frame(exc: BaseException) -> str:
    """The deepest traceback frame outside nblaunch, torch and the standard library."""
    nblaunch_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    skip = (nblaunch_dir, os.path.dirname(os.__file__))
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(skip) and "/torch/" not in frame.filename:
            where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return where
