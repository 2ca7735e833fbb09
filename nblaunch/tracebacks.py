"""Tracebacks from ranks that read like local ones in the notebook.

A rank's exception arrives pickled with its traceback (tblib). tblib rebuilds each frame from a
stub whose code object starts at the failing line; IPython then takes the stub for a function
that begins there and shows the wrong source lines (the ``def`` line of a cell instead of the line
that raised). Here each frame is rebuilt from a stub compiled under the frame's file name that
starts at line 1 and raises at the frame's line, so IPython, ``traceback`` and pytest show the
user's own line, with the cell's line numbers.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

# Frames from these files are the launcher's own plumbing, not the user's code.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _TracebackMaker(Exception):
    pass


def rebuild(entries: list[tuple[str, str, int, dict[str, Any]]]) -> types.TracebackType | None:
    """A real traceback through ``(file name, function name, line, globals)`` frames."""
    top: types.TracebackType | None = None
    previous: types.TracebackType | None = None
    for filename, name, lineno, frame_globals in entries:
        stub = compile("\n" * (max(lineno, 1) - 1) + "raise __traceback_maker", filename, "exec")
        changes = {"co_name": name}
        if sys.version_info >= (3, 11):  # tracebacks name frames by their qualified name
            changes["co_qualname"] = name
        stub = stub.replace(**changes)
        namespace = {k: frame_globals[k] for k in ("__name__", "__file__") if k in frame_globals}
        namespace["__traceback_maker"] = _TracebackMaker()  # fresh: a raised one keeps its tb
        made = None
        try:
            exec(stub, namespace)
        except _TracebackMaker:
            made = sys.exc_info()[2]
            made = made.tb_next if made is not None else None
        if made is None:  # pragma: no cover - exec always adds the stub's frame
            continue
        if previous is None:
            top = made
        else:
            previous.tb_next = made
        previous = made
    return top


def frames(tb: types.TracebackType | None) -> list[tuple[str, str, int, dict[str, Any]]]:
    """``(file name, function name, line, globals)`` of every frame of ``tb``."""
    entries = []
    while tb is not None:
        code = tb.tb_frame.f_code
        entries.append((code.co_filename, code.co_name, tb.tb_lineno, tb.tb_frame.f_globals))
        tb = tb.tb_next
    return entries


def make_readable(exc: BaseException) -> BaseException:
    """Rebuild the tracebacks of ``exc`` and the exceptions chained to it; return ``exc``.

    The rank's own plumbing (the leading frames from nblaunch's files, such as the worker's task
    loop) is left out, so the traceback starts at the user's function.
    """
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        entries = frames(current.__traceback__)
        while len(entries) > 1 and entries[0][0].startswith(_PACKAGE_DIR):
            entries.pop(0)
        current.__traceback__ = rebuild(entries)
        pending += [current.__cause__, current.__context__]
    return exc
