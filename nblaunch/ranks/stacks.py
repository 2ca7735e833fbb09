"""Reading a rank's stack: the user's line, and whether it waits inside ``torch.distributed``.

The heartbeat thread (:mod:`nblaunch.ranks.heartbeat`) samples the task's thread with these
functions; they look at frames only and patch nothing. A frame is the user's unless it is in
nblaunch, the standard library, torch or an installed library; ``torch.distributed``'s public
calls that wait for peers count as collectives.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import traceback
from dataclasses import dataclass
from types import CodeType, FrameType

from nblaunch.ranks.checks import debug_mode
from nblaunch.ranks.checks.process_groups import sequence_number
from nblaunch.ranks.checks.waits import posted_in_sequence

# Longest stack text a heartbeat carries (a deep stack of many threads is cut).
MAX_STACK_CHARS = 20_000
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_NBLAUNCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root
_STDLIB_DIRS = tuple(
    {os.path.realpath(sysconfig.get_paths()[name]) for name in ("stdlib", "platstdlib")}
)
_LIBRARY_DIRS = tuple(
    {os.path.realpath(sysconfig.get_paths()[name]) for name in ("purelib", "platlib")}
)


# Kinds of source file, from the point of view of "where is the user's code".
_USER, _LIBRARY, _TORCH, _C10D, _INTERNAL = range(5)
_kinds: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    kind = _kinds.get(filename)
    if kind is None:
        kind = _classify(filename)
        _kinds[filename] = kind
    return kind


def _classify(filename: str) -> int:
    if filename.endswith(_C10D_FILE):
        return _C10D
    if filename.startswith("<") and not filename.startswith("<frozen"):
        return _USER  # notebook cells, <dynamic-code>, <string>
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    if filename.startswith("<frozen") or path.startswith(_NBLAUNCH_DIR):
        return _INTERNAL
    if f"{os.sep}torch{os.sep}" in path:
        return _TORCH
    if path.startswith(_LIBRARY_DIRS) or "site-packages" in path or "dist-packages" in path:
        return _LIBRARY
    if path.startswith(_STDLIB_DIRS):
        return _INTERNAL
    return _USER


def _is_collective_name(name: str) -> bool:
    # Public entry points of distributed_c10d that wait for peers; queries like get_rank() and
    # the local teardown return at once.
    return not name.startswith(("_", "get_", "is_")) and name != "destroy_process_group"


# Where nblaunch calls the user's task (the worker names its function here as it is imported):
# the frames above it are the process bootstrap (the forkserver's ``<string>`` frame) and
# nblaunch's loop, never the user's code.
task_entries: set[CodeType] = set()
# Debug mode's check before a collective (nblaunch.ranks.checks.debug_mode.verify): its frame names
# the operation.
VERIFY_FRAME = ("verify", debug_mode.verify.__code__.co_filename)


@dataclass
class Position:
    """Where a thread is, read from its stack."""

    where: str  # innermost user frame, "file.py:12 in train"
    collective: str | None  # outermost torch.distributed call on the stack, e.g. "all_reduce"
    signature: tuple[tuple[int, int], ...]  # (code id, instruction) of every frame


def read_position(frame: FrameType | None, previous: Position | None = None) -> Position:
    """Find the user's line and the ``torch.distributed`` call (if any) on a stack.

    The user's line is the innermost frame outside the standard library, nblaunch and torch;
    library code counts only when no user frame exists (a function imported from a package),
    and then the innermost library frame, the one that called into torch. Frames above the task
    (the process bootstrap, nblaunch's task loop) never count.
    When the stack is the one ``previous`` was read from, ``previous`` is returned: a stack
    that did not move is recognised at the cost of one walk over it.
    """
    frames = []
    signature = []
    while frame is not None and frame.f_code not in task_entries:
        frames.append(frame)
        signature.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    key = tuple(signature)
    if previous is not None and previous.signature == key:
        return previous
    collective = None
    user = library = None
    for frame in frames:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind == _C10D and _is_collective_name(code.co_name):
            collective = code.co_name  # keep going: the outermost one is what the user called
        elif kind == _USER and user is None:
            user = frame
        elif kind == _LIBRARY and library is None:
            library = frame
    shown = user or library or (frames[0] if frames else None)
    where = "" if shown is None else describe_frame(shown)
    return Position(where, collective, key)


def describe_frame(frame: FrameType) -> str:
    """``"path:line in function"``, the path relative to the working directory when inside it."""
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


_short_paths: dict[str, str] = {}


def _short_path(filename: str) -> str:
    short = _short_paths.get(filename)
    if short is None:
        short = filename
        with contextlib.suppress(ValueError):
            relative = os.path.relpath(filename)
            if not relative.startswith(".."):
                short = relative
        _short_paths[filename] = short
    return short


def format_stacks(frames: dict[int, FrameType], main_ident: int) -> str:
    """Every thread's Python stack, task thread first, like faulthandler but with source lines.

    Threads blocked in C show the Python frames that led there. nblaunch's own threads and the
    frames that lead from the process start to the task are left out.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident in sorted(frames, key=lambda i: i != main_ident):
        name = names.get(ident, f"thread {ident}")
        if name.startswith("nblaunch-"):
            continue
        summary = traceback.extract_stack(frames[ident])
        if ident == main_ident:
            summary = _from_task_start(summary)
        label = "task thread" if ident == main_ident else "thread"
        parts.append(
            f'{label} "{name}" (most recent call last):\n' + "".join(summary.format()).rstrip()
        )
    text = "\n".join(parts)
    if len(text) > MAX_STACK_CHARS:
        text = text[:MAX_STACK_CHARS] + "\n... (cut)"
    return text


def _from_task_start(summary: traceback.StackSummary) -> traceback.StackSummary:
    """Drop the leading frames (process bootstrap, nblaunch's task loop) above the user's code."""
    start = next(
        (i for i, entry in enumerate(summary) if entry.filename.startswith(_NBLAUNCH_DIR)), None
    )
    if start is None:
        return summary
    for index in range(start, len(summary)):
        if _file_kind(summary[index].filename) != _INTERNAL:
            return traceback.StackSummary.from_list(summary[index:])
    return summary


def collective_sequence() -> int | None:
    """How many collectives this rank issued on the default process group, when torch knows.

    The count is taken when a collective is issued, so a rank waiting in its 5th collective
    reports 5. ``None`` without an initialised process group or with a backend that does not
    count.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    except Exception:
        return None
    number = sequence_number(group)
    if number is None:
        return None
    # gloo's number takes in sends and receives: out again (process_groups.group_status)
    return number - posted_in_sequence(group.group_name)
