"""Heartbeats: each rank tells the notebook, once a second, where it is and what it waits in.

Every task runs with a daemon thread (:class:`HeartbeatThread`) that looks at the task's thread
about twenty times a second through ``sys._current_frames()``: which user line it is on, and
whether it sits inside a ``torch.distributed`` call (recognised from the stack alone, nothing is
patched). From those samples it adds up the time spent waiting in collectives, and once a second
it sends a ``Heartbeat``: where the rank is, the collective it is in, how many collectives it has
issued (the process group's sequence number), how long it has been still, and a formatted stack
of every thread.

The notebook's side, which names hangs and stragglers from these, is
:mod:`nblaunch.engine.hang`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from nblaunch.events import Heartbeat, InFlightInfo
from nblaunch.ranks import process_groups, waits, worker
from nblaunch.ranks.this_rank import RankContext, add_task_hook, emit

if TYPE_CHECKING:
    pass

# Rank side: how often the task's thread is sampled, and how often a heartbeat is sent.
SAMPLE_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 1.0
# A thread that used this share of a core between heartbeats is computing, not stuck.
BUSY_CPU_SHARE = 0.05
# Longest stack text a heartbeat carries (a deep stack of many threads is cut).
MAX_STACK_CHARS = 20_000
# A task thread that has not moved for this long while its process group has a collective in
# flight waits in it, even with no torch.distributed frame on its stack (DDP's backward, FSDP's
# hooks and work.wait() wait in C++).
NATIVE_WAIT_AFTER_S = 0.5
# A task thread still in a wait this long gets a heartbeat at once, not at the next second: the
# watchdog proves deadlocks from the ranks' waits (nblaunch.engine.deadlock) within 2 s.
WAIT_BEATS_S = (0.3, 1.0)


_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_NBLAUNCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root
_STDLIB_DIRS = tuple(
    {os.path.realpath(sysconfig.get_paths()[name]) for name in ("stdlib", "platstdlib")}
)
_LIBRARY_DIRS = tuple(
    {os.path.realpath(sysconfig.get_paths()[name]) for name in ("purelib", "platlib")}
)


# --- reading a stack -----------------------------------------------------------------------------

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


# Where nblaunch calls the user's task: the frames above it are the process bootstrap (the
# forkserver's ``<string>`` frame) and nblaunch's loop, never the user's code.
_TASK_ENTRY = worker._run_task.__code__
# Debug mode's check before a collective (nblaunch.ranks.debug_mode.verify): its frame names the
# operation.
_VERIFY = ("verify", os.path.join(_NBLAUNCH_DIR, "ranks", "debug_mode.py"))


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
    while frame is not None and frame.f_code is not _TASK_ENTRY:
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
        return int(group._get_sequence_number_for_group())
    except Exception:
        return None


# --- rank side: the heartbeat thread --------------------------------------------------------------


class _OutputClock:
    """Remembers when the rank last wrote to ``sys.stdout``/``sys.stderr`` (Python-level writes).

    Output written by C code does not pass here; the parent sees that from its pipes.
    """

    def __init__(self) -> None:
        self.last = 0.0
        self._wrapped: list[tuple[Any, Any]] = []

    def install(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            original = getattr(stream, "write", None)
            if original is None or "write" in getattr(stream, "__dict__", {}):
                continue
            try:
                stream.write = self._timed(original)
            except (AttributeError, TypeError):
                continue
            self._wrapped.append((stream, original))

    def _timed(self, write: Callable[[str], int]) -> Callable[[str], int]:
        def timed_write(text: str) -> int:
            self.last = time.time()
            return write(text)

        return timed_write

    def remove(self) -> None:
        for stream, _ in self._wrapped:
            with contextlib.suppress(AttributeError):
                del stream.write
        self._wrapped.clear()


class HeartbeatThread:
    """Samples one thread's stack and sends a ``Heartbeat`` about once a second.

    Parameters
    ----------
    rank
        The rank the heartbeats are for.
    send
        Where heartbeats go (``nblaunch.ranks.this_rank.emit`` in a rank).
    target
        Ident of the thread to watch; default the thread that creates this object.
    """

    def __init__(
        self,
        rank: int,
        send: Callable[[Heartbeat], None] = emit,
        *,
        target: int | None = None,
        sample_interval: float = SAMPLE_INTERVAL_S,
        interval: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.rank = rank
        self.send = send
        self.target = target if target is not None else threading.get_ident()
        self.sample_interval = sample_interval
        self.interval = interval
        self.wait_s = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nblaunch-heartbeat", daemon=True)
        self._output = _OutputClock()
        self._cpu_clock = _thread_cpu_clock(self.target)
        self._started = self._last_sample = self._last_moved = time.monotonic()
        self._position = Position("", None, ())
        self._seq: int | None = None
        self._cpu = self._cpu_time()
        self._checked_at = self._started  # when the last heartbeat looked at seq, CPU, output
        self._beat_output = 0.0
        self._last_beat = self._started
        self._described: InFlightInfo | None = None  # the collective last described
        self._counts = (0, 0)  # collectives issued on every group, point-to-point posts
        self._wait_beat = (0.0, 0)  # (still since, how many of WAIT_BEATS_S) last sent early

    def start(self) -> None:
        self._output.install()
        self._seq = collective_sequence()
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and send a last heartbeat with the final counts."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._output.remove()
        with contextlib.suppress(Exception):
            self.send(self._heartbeat(time.monotonic(), final=True))

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.sample_interval):
                now = time.monotonic()
                self.sample(now)
                if now - self._last_beat >= self.interval or self._wait_beat_due(now):
                    self._last_beat = now
                    self.send(self._heartbeat(now))
        except Exception:
            pass  # the parent went away (broken pipe): nothing left to report to

    def _wait_beat_due(self, now: float) -> bool:
        """True once per step of ``WAIT_BEATS_S`` the task thread spends still in a wait."""
        if self._position.collective is None and waits.waiting(self.target) is None:
            return False
        stage = sum(now - self._last_moved >= after for after in WAIT_BEATS_S)
        if stage == 0 or (self._last_moved, stage) <= self._wait_beat:
            return False
        self._wait_beat = (self._last_moved, stage)
        return True

    def sample(self, now: float) -> None:
        """Look at the target thread once; add the time since the last sample to its state."""
        frame = sys._current_frames().get(self.target)
        position = read_position(frame, self._position)
        del frame  # keep no frame (and its locals) alive between samples
        if position.collective is not None:
            self.wait_s += now - self._last_sample
        if position.signature != self._position.signature:
            self._last_moved = now
        self._last_sample = now
        self._position = position
        self.samples += 1

    def _heartbeat(self, now: float, *, final: bool = False) -> Heartbeat:
        seq = collective_sequence()
        groups = process_groups.group_status()
        if not final:
            # Reading the counts may let the task's thread run (they come from C++): look at it
            # again now, so the position is no older than the collectives they say it issued,
            # and agrees with the stack below (DDP's backward was once reported at the forward).
            self.sample(now)
        cpu = self._cpu_time()
        busy_cpu = cpu - self._cpu > BUSY_CPU_SHARE * max(now - self._checked_at, 1e-3)
        output = self._output.last
        # Between two samples the thread may have moved and come back; these catch that: a new
        # collective issued, output written, or real computing outside collectives.
        counts = (sum(issued for issued, _ in (groups or {}).values()), waits.posted_total())
        if seq != self._seq or counts != self._counts:
            # issued between two beats: still at most since the last beat
            self._last_moved = max(self._last_moved, self._checked_at)
        self._counts = counts
        if output != self._beat_output:
            self._last_moved = max(self._last_moved, now - max(0.0, time.time() - output))
        waiting = self._position.collective or waits.waiting(self.target)
        if busy_cpu and not waiting:
            self._last_moved = now
        self._seq, self._cpu, self._checked_at, self._beat_output = seq, cpu, now, output
        position = self._position
        still_s = 0.0 if final else now - self._last_moved
        in_flight = None
        collective = position.collective
        pending = process_groups.pending(groups, calling=collective is not None)
        proof = waits.heartbeat_fields(self.target)
        if final:
            proof["p2p_wait"] = None
        elif proof["p2p_wait"] is not None:
            collective = waits.label(proof["p2p_wait"], collective)
        elif pending and (collective or still_s >= NATIVE_WAIT_AFTER_S):
            in_flight = self._in_flight(pending, collective)
            collective = in_flight["label"]
        stack = ""
        if not final:
            frames = sys._current_frames()
            try:
                stack = format_stacks(frames, self.target)
            finally:
                del frames
        return {
            "kind": "heartbeat",
            "rank": self.rank,
            "where": position.where,
            "collective": None if final else collective,
            "wait_s": self.wait_s,
            "busy_s": now - self._started,
            "last_output": output,
            "stack": stack,
            "seq": seq,
            "still_s": still_s,
            "in_flight": in_flight,
            "groups": {name: issued for name, (issued, _) in (groups or {}).items()},
            **proof,  # type: ignore[typeddict-item]
        }

    def _in_flight(self, pending: tuple[str, int], called: str | None) -> InFlightInfo:
        """Describe the collective this rank waits in, once per collective."""
        if self._described is None or (self._described["group"], self._described["seq"]) != pending:
            group, seq = pending
            entry = process_groups.in_flight(group, seq)  # None when the recorder is off
            frame = sys._current_frames().get(self.target)
            functions, files = [], []
            checked = None  # in debug mode: the operation whose check this collective is
            while frame is not None:
                functions.append(frame.f_code.co_name)
                files.append(frame.f_code.co_filename)
                if (frame.f_code.co_name, frame.f_code.co_filename) == _VERIFY:
                    checked = frame.f_locals.get("operation")
                frame = frame.f_back
            del frame
            operation = entry.operation if entry else called or "collective"
            self._described = {
                "group": group,
                "group_desc": entry.group_desc if entry else "",
                "seq": seq,
                "label": process_groups.collective_label(operation, functions, files, checked),
                "shapes": entry.shapes if entry else [],
            }
        return self._described

    def _cpu_time(self) -> float:
        if self._cpu_clock is not None:
            with contextlib.suppress(OSError):
                return time.clock_gettime(self._cpu_clock)
        return time.process_time()


def _thread_cpu_clock(ident: int) -> int | None:
    try:
        return time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return None


@contextlib.contextmanager
def heartbeats(context: RankContext) -> Iterator[HeartbeatThread]:
    """Send heartbeats while a task runs (registered as a task hook in every rank)."""
    beat = HeartbeatThread(context.rank)
    beat.start()
    try:
        yield beat
    finally:
        beat.stop()


add_task_hook(heartbeats)
