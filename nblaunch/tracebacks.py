"""Tracebacks from ranks that read like local ones in the notebook and in a terminal.

A rank's exception arrives pickled with its traceback (tblib). tblib rebuilds each frame from a
stub whose code object starts at the failing line; IPython then takes the stub for a function
that begins there and shows the wrong source lines (the ``def`` line of a cell instead of the line
that raised). Here each frame is rebuilt from a stub compiled under the frame's file name that
starts at line 1 and raises at the frame's line, so IPython, ``traceback`` and pytest show the
user's own line, with the cell's line numbers.

Since Python 3.11 a traceback also marks the failing expression (``~~~^^^``) from the column
range of the frame's instruction. A stub's own instruction would mark ``raise ...`` at the
start of the line, so each stub gets a line table of its own that carries the frame's real
range. tblib does not send the ranges; they are read back from the traceback text the rank
formatted (``Failure.traceback``), and a range is used only when formatting the frame with it
here gives exactly the rank's text. Otherwise the frame has no range, and shows no markers:
never wrong ones.
"""

from __future__ import annotations

import ast
import functools
import itertools
import linecache
import os
import re
import sys
import traceback
import types
import unicodedata
from typing import Any

# Frames from these files are the launcher's own plumbing, not the user's code.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# (line, end line, first column, end column): a frame's instruction, columns in UTF-8 bytes as
# in ``code.co_positions()``; the columns are None where the range is not known.
Position = tuple[int, int, "int | None", "int | None"]
# (file name, function name, line, globals) and, optionally, the frame's Position.
Entry = tuple[Any, ...]

_HAS_RANGES = sys.version_info >= (3, 11)
_FRAME_LINE = re.compile(
    r'^(?P<margin>[ |]*?)  File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>.+)$'
)


class _TracebackMaker(Exception):
    pass


def rebuild(entries: list[Entry]) -> types.TracebackType | None:
    """A real traceback through ``(file name, function name, line, globals[, position])``."""
    top: types.TracebackType | None = None
    previous: types.TracebackType | None = None
    for entry in entries:
        filename, name, lineno, frame_globals = entry[:4]
        position = entry[4] if len(entry) > 4 else None
        lineno = max(lineno, 1)
        first = _first_line(filename, name, lineno)
        stub = compile("\n" * (lineno - first) + "raise __traceback_maker", filename, "exec")
        changes: dict[str, Any] = {"co_name": name, "co_firstlineno": first}
        if _HAS_RANGES:  # tracebacks name frames by their qualified name, and mark a range
            changes["co_qualname"] = name
            changes["co_linetable"] = _line_table(stub, first, lineno, position)
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


def frames(tb: types.TracebackType | None, *, positions: bool = True) -> list[Entry]:
    """``(file name, function name, line, globals, position)`` of every frame of ``tb``.

    ``positions=False`` leaves the position out (None): a traceback that tblib re-created has
    the position of tblib's own stub, not the frame's.
    """
    entries: list[Entry] = []
    while tb is not None:
        code = tb.tb_frame.f_code
        position = _position(code, tb.tb_lasti) if positions else None
        entries.append(
            (code.co_filename, code.co_name, tb.tb_lineno, tb.tb_frame.f_globals, position)
        )
        tb = tb.tb_next
    return entries


def make_readable(exc: BaseException, remote_traceback: str = "") -> BaseException:
    """Rebuild the tracebacks of ``exc`` and the exceptions chained to it; return ``exc``.

    The rank's own plumbing (the leading frames from nblaunch's files, such as the worker's task
    loop) is left out, so the traceback starts at the user's function. ``remote_traceback`` is
    the traceback text the rank formatted: each frame's markers are taken from it.
    """
    ranges = positions_from_text(remote_traceback) if _HAS_RANGES and remote_traceback else {}
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        entries = [
            (*entry[:4], ranges.get((entry[0], entry[2], entry[1])))
            for entry in frames(current.__traceback__, positions=False)
        ]
        while len(entries) > 1 and entries[0][0].startswith(_PACKAGE_DIR):
            entries.pop(0)
        current.__traceback__ = rebuild(entries)
        pending += [current.__cause__, current.__context__]
    return exc


def at_user_frames(exc: BaseException, frames: list[tuple[str, int, str]]) -> BaseException:
    """Give ``exc``, a report made in the notebook (a mismatch, a hang), a traceback through
    the user's frames on the rank it names, ``(file name, line, function)`` outermost first;
    returns ``exc``.

    Raised from the launcher's frames, the report's traceback would end in nblaunch's code
    (IPython shows the innermost frame even when it is hidden); with these frames it ends at
    the user's line, as a rank's own exception does.
    """
    if frames:
        exc.__traceback__ = rebuild([(file, name, line, {}) for file, line, name in frames])
    return exc


def user_frames_of_stack(text: str) -> list[tuple[str, int, str]]:
    """The user's frames, ``(file name, line, function)`` outermost first, of the first
    thread's stack in a heartbeat's stack text (``nblaunch.ranks.stacks.format_stacks``): from
    the task's first frame to the call into torch or nblaunch."""
    found: list[tuple[str, int, str]] = []
    for line in text.splitlines()[1:]:
        if line and not line.startswith(" "):
            break  # the next thread's header
        match = _FRAME_LINE.match(line)
        if match is None:
            continue
        file = match.group("file")
        if file.startswith(_PACKAGE_DIR) or f"{os.sep}torch{os.sep}" in file:
            if found:
                break
            continue
        found.append((file, int(match.group("line")), match.group("name")))
    return found


def without_launcher_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from its first frame outside nblaunch's files on; None when every frame is one.

    What an exception went through in nblaunch before a handle hands it over (a background
    run's thread, the run host) is plumbing: a blocking launch hides those frames, a handle
    leaves them out.
    """
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return tb


def portable(exc: BaseException) -> BaseException:
    """``exc`` made to pickle with its traceback and chained exceptions (tblib), from its first
    frame outside nblaunch on; returns ``exc``. :func:`make_readable` rebuilds it after."""
    from tblib import pickling_support

    exc.__traceback__ = without_launcher_frames(exc.__traceback__)
    pickling_support.install(exc)
    return exc


def without_launcher_text(text: str) -> str:
    """A traceback text that Python formatted, without the leading frames from nblaunch's files
    in each of its tracebacks (a rank's task loop, ``worker.py _run_task``), as
    :func:`make_readable` leaves them out of the exception: the last one stays when no frame
    of the user's follows."""
    out: list[str] = []
    leading = False  # in a traceback's frames, before the first one of the user's
    dropped: list[str] = []  # the latest nblaunch frame left out, kept if nothing follows
    lines = text.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        line = lines[index]
        match = _FRAME_LINE.match(line.rstrip("\n"))
        if match is None:
            if line.rstrip().endswith("Traceback (most recent call last):"):
                leading = True
            elif leading and not line.startswith(" "):  # the exception's line: no user frame
                out += dropped
                leading = False
            dropped = []
            out.append(line)
            index += 1
            continue
        block = [line]
        index += 1
        margin = match.group("margin")
        while (
            index < len(lines)
            and lines[index].startswith(margin + "    ")
            and not _FRAME_LINE.match(lines[index].rstrip("\n"))
        ):
            block.append(lines[index])
            index += 1
        if leading and match.group("file").startswith(_PACKAGE_DIR):
            dropped = block
            continue
        leading = False
        dropped = []
        out += block
    return "".join(out)


def positions_from_text(text: str) -> dict[tuple[str, int, str], Position | None]:
    """Each frame's position, read back from a traceback text that Python formatted.

    Keyed by ``(file name, line, function name)``. A frame is given a position only when
    formatting it here with that position gives the same lines as the text (the rank runs this
    same Python, and reads the same source files); a frame shown twice with different markers
    (recursion through one line) gets None.
    """
    found: dict[tuple[str, int, str], Position | None] = {}
    lines = text.splitlines()
    for index, header in enumerate(lines):
        match = _FRAME_LINE.match(header)
        if match is None:
            continue
        margin = match.group("margin")
        block = [header[len(margin) :]]
        for following in itertools.islice(lines, index + 1, None):
            if not following.startswith(margin + "    ") or _FRAME_LINE.match(following):
                break
            block.append(following[len(margin) :])
        key = (match.group("file"), int(match.group("line")), match.group("name"))
        position = _position_of_block(key, block)
        if key in found and found[key] != position:
            position = None
        found[key] = position
    return found


# --- internals -----------------------------------------------------------------------------------


def _position_of_block(key: tuple[str, int, str], block: list[str]) -> Position | None:
    """The position whose formatting gives ``block`` (header, source, markers), if any."""
    filename, lineno, name = key
    if len(block) < 3:
        return None  # no markers were shown: show none here either
    source = linecache.getline(filename, lineno)
    markers = block[2].lstrip(" ")
    if not source.strip() or not markers or set(markers) - set("^~"):
        return None
    stripped = source.strip()
    indent = len(source) - len(source.lstrip())
    start = _char_at_width(stripped, len(block[2]) - len(markers) - 4)
    end = _char_at_width(stripped, len(block[2]) - 4)
    if start is None or end is None or end <= start:
        return None
    position = (
        lineno,
        lineno,
        len(source[: indent + start].encode()),
        len(source[: indent + end].encode()),
    )
    expected = "".join(line + "\n" for line in block)
    return position if _formatted(filename, name, position) == expected else None


def _formatted(filename: str, name: str, position: Position) -> str:
    """How this Python's ``traceback`` shows a frame at ``position``."""
    lineno, end_lineno, col, end_col = position
    summary = traceback.FrameSummary(
        filename, lineno, name, end_lineno=end_lineno, colno=col, end_colno=end_col
    )
    try:
        return "".join(traceback.StackSummary.from_list([summary]).format())
    except Exception:  # pragma: no cover - a formatter that differs: no markers then
        return ""


def _char_at_width(text: str, width: int) -> int | None:
    """The index in ``text`` at which it is ``width`` columns wide on a terminal."""
    if width < 0:
        return None
    if text.isascii():
        return width if width <= len(text) else None
    columns = 0
    for index, char in enumerate(text):
        if columns == width:
            return index
        columns += 2 if unicodedata.east_asian_width(char) in "WF" else 1
    return len(text) if columns == width else None


def _position(code: types.CodeType, lasti: int) -> Position | None:
    """The position of the instruction at ``lasti`` in ``code``."""
    if not _HAS_RANGES or lasti < 0:
        return None
    found = next(itertools.islice(code.co_positions(), lasti // 2, None), None)
    if found is None or found[0] is None:
        return None
    lineno, end_lineno, col, end_col = found
    return (lineno, end_lineno if end_lineno is not None else lineno, col, end_col)


def _first_line(filename: str, name: str, lineno: int) -> int:
    """The line a frame's function starts on (its first decorator), 1 for a module.

    IPython reads a cell's lines for a frame (when the cell is not a file on disk) as the block
    that starts at the code's first line; a stub has to start where the function does.
    """
    if name == "<module>":
        return 1
    source = "".join(linecache.getlines(filename))
    tree = _parsed(source) if source else None
    if tree is None:
        return 1
    best: tuple[int, int] | None = None  # (matches the name, start line) of the innermost
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if not node.lineno <= lineno <= (node.end_lineno or node.lineno):
            continue
        decorators = getattr(node, "decorator_list", [])
        start = min([node.lineno, *(d.lineno for d in decorators)])
        named = getattr(node, "name", "<lambda>") == name
        if best is None or (named, start) > best:
            best = (named, start)
    return best[1] if best is not None else 1


@functools.lru_cache(maxsize=32)
def _parsed(source: str) -> ast.AST | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _line_table(stub: types.CodeType, first: int, lineno: int, position: Position | None) -> bytes:
    """A line table giving every instruction of ``stub`` the line ``lineno`` and ``position``.

    The format is CPython's (``Objects/locations.md``, 3.11 and later): entries of up to 8 code
    units; "no columns" entries (code 13) when the range is unknown, else long ones (code 14).
    """
    units = len(stub.co_code) // 2
    columns = position is not None and position[2] is not None and position[3] is not None
    out = bytearray()
    delta = lineno - first
    while units > 0:
        length = min(units, 8)
        if columns:
            assert position is not None
            _, end_lineno, col, end_col = position
            out.append(0x80 | (14 << 3) | (length - 1))
            out += _svarint(delta)
            out += _varint(max(0, end_lineno - lineno))
            out += _varint(col + 1)
            out += _varint(end_col + 1)
        else:
            out.append(0x80 | (13 << 3) | (length - 1))
            out += _svarint(delta)
        delta = 0
        units -= length
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 64:
        out.append(0x40 | (value & 63))
        value >>= 6
    out.append(value)
    return bytes(out)


def _svarint(value: int) -> bytes:
    return _varint((-value << 1) | 1 if value < 0 else value << 1)
