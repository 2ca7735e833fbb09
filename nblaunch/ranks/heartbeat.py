"""Heartbeats: each rank tells the notebook, once a second, where it is and what it waits in.

Every task runs with a daemon thread (:class:`HeartbeatThread`) that looks at the task's thread
about twenty times a second through ``sys._current_frames()``: which user line it is on, and
whether it sits inside a ``torch.distributed`` call (recognised from the stack alone, nothing is
patched). From those samples it adds up the time spent waiting in collectives, and once a second
it sends a ``Heartbeat``: where the rank is, the collective it is in, how many collectives it has
issued (the process group's sequence number), how long it has been still, and a formatted stack
of every thread.

Reading a stack (where the user's line is, whether it is inside a collective) is
:mod:`nblaunch.ranks.stacks`. The notebook's side, which names hangs and stragglers from these,
is :mod:`nblaunch.engine.monitors.hang`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nblaunch.events import Heartbeat, InFlightInfo
from nblaunch.ranks.checks import process_groups, waits
from nblaunch.ranks.stacks import (
    VERIFY_FRAME,
    Position,
    collective_sequence,
    format_stacks,
    read_position,
)
from nblaunch.ranks.this_rank import RankContext, add_task_hook, emit

# Rank side: how often the task's thread is sampled, and how often a heartbeat is sent.
SAMPLE_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 1.0
# A thread that used this share of a core between heartbeats is computing, not stuck.
BUSY_CPU_SHARE = 0.05
# A task thread that has not moved for this long while its process group has a collective in
# flight waits in it, even with no torch.distributed frame on its stack (DDP's backward, FSDP's
# hooks and work.wait() wait in C++).
NATIVE_WAIT_AFTER_S = 0.5
# A task thread still in a wait this long gets a heartbeat at once, not at the next second: the
# watchdog proves deadlocks from the ranks' waits (nblaunch.engine.monitors.deadlock) within 2 s.
WAIT_BEATS_S = (0.3, 1.0)


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
        self._described_key: tuple[Any, ...] = ()  # its group, number and stack
        self._unrecorded: tuple[str, int] | None = None  # pending, and not in the recorder
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
            collective = in_flight["label"] if in_flight else collective
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

    def _in_flight(self, pending: tuple[str, int], called: str | None) -> InFlightInfo | None:
        """Describe the collective this rank waits in, once per collective and stack.

        ``None`` the first time the flight recorder has no entry for a collective issued from
        C++: gloo counts a collective as issued before its worker thread records it (most looks
        at one just issued find no entry, measured), and a rank that has just issued one is not
        known to wait in it. The next heartbeat describes it, from its entry or (overwritten,
        never recorded) without. The stack counts too: the task's thread may move between
        reading the counts and reading its stack.
        """
        frame = sys._current_frames().get(self.target)
        functions, files, signature = [], [], []
        checked = None  # in debug mode: the operation whose check this collective is
        while frame is not None:
            functions.append(frame.f_code.co_name)
            files.append(frame.f_code.co_filename)
            signature.append((id(frame.f_code), frame.f_lasti))
            if (frame.f_code.co_name, frame.f_code.co_filename) == VERIFY_FRAME:
                checked = frame.f_locals.get("operation")
            frame = frame.f_back
        del frame
        key = (*pending, tuple(signature))
        if self._described_key != key:  # () until the first description
            group, seq = pending
            entry = process_groups.in_flight(group, seq)  # None when the recorder is off
            recording = process_groups.recorder_size() != 0
            if entry is None and called is None and recording and self._unrecorded != pending:
                self._unrecorded = pending  # just issued: not known to wait in it yet
                return None
            operation = entry.operation if entry else called or "collective"
            label = process_groups.collective_label(operation, functions, files, checked)
            if entry and entry.progress:  # NCCL's own word on it
                label += f" ({entry.progress})"
            self._described = {
                "group": group,
                "group_desc": entry.group_desc if entry else "",
                "seq": entry.seq if entry else seq,  # gloo's count may lag (in_flight)
                "label": label,
                "shapes": entry.shapes if entry else [],
            }
            self._described_key = key
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
