"""Out-of-band checks: each rank tells the launcher which collectives it issues, without waiting.

On by default (``debug=False`` or ``NBLAUNCH_CHECKS=0`` turn them off; ``debug=True`` checks
before each call instead). The same calls debug mode verifies (:mod:`nblaunch.ranks.ops`,
torch.distributed's collectives and DDP's gradient all-reduce, patched by
:mod:`nblaunch.ranks.checks.debug_patches`) each send the call's facts (operation, call site,
shapes, dtypes, arguments: a plain tuple, ``debug_report.FACTS``), numbered by its process
group and its place on that group, to the launcher
(:mod:`nblaunch.engine.monitors.collective_checks`), which compares the ranks' facts and stops the
run with debug mode's
:class:`~nblaunch.errors.DistributedOperationException` when two ranks disagree at the same step
of the same group. The collective itself runs at once.

Each call is 13 bytes written into a pipe that the launcher reads about 20 times a second (the
rank hands the pipe's reading end over a local socket when its task starts), not a message on
the event pipe: that pipe wakes the launcher at every write, and on a busy machine those
wake-ups cost a step more than the checks themselves (measured: 1.2-1.6x). The 13 bytes say
which group, the call's number on it and which facts; a group and a set of facts are pickled
once, the first time a task uses them (a training loop repeats the same few calls). Writing
was most of what a check cost (measured in one launch, checked and unchecked blocks
alternating: the rank's main thread 1.04-1.11x with a pickle per call on a socket, 0.99-1.03x
with nothing written), and a pipe's write costs a quarter of a socket's. The bytes wait in the
kernel until read, and are still there when their writer was killed right after (gloo aborts a
rank on some mismatches). Only when the launcher is 20000 calls behind does a rank wait for it.
Each call goes out before its collective starts, so a rank that hangs in it has told the
launcher where; batching calls would need a thread that wakes up to flush them, and would lose
the last ones of a rank that gloo aborted.

What torch issues itself (DDP's gradient all-reduce, FSDP's collectives) is read from its
flight recorder by :mod:`nblaunch.ranks.checks.recorder` and sent down the same pipe as a second
stream, numbered by the recorder; each call checked here leaves a :class:`Claim` by which the
reader knows the entries it issued, and says (17 bytes then) the number the recorder will give
it, for a rank that gloo aborts before its reader sees the entry.

The numbers are this module's own, per group and per task: they count the calls checked here,
so collectives torch issues out of sight (DDP's bucket rebuild, its buffer broadcast) cannot
shift them, and a task that failed half-way leaves nothing to the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks import process_groups, waits

# Bytes a rank may write ahead of the launcher's reading (~20000 calls) before it waits. Not
# more: a user's pipes share 64 MiB (pipe-user-pages-soft), past which Linux gives a new pipe a
# page or two; where it refuses the size, the pipe keeps its default (64 KiB).
SEND_BUFFER_BYTES = 1 << 18
# What a message starts with: a call (``CALL``: tag, the group's index, the call's number on
# the group, the index of its facts) or a definition (tag, length, a pickled tuple: ``("rank",
# rank, task)`` first, then ``("group", index, name, size, ranks)`` and ``("facts", index,
# facts)`` before the first call that uses them).
CALL_TAG, DEFINITION_TAG, PREDICTED_TAG = 1, 2, 3
CALL = struct.Struct("<BIII")
# A call with the number the flight recorder should give it (tag, group, number, facts, that
# number): the launcher uses it only if the rank fails without sending the recorder's entry.
PREDICTED_CALL = struct.Struct("<BIIII")
DEFINITION = struct.Struct("<BI")
# Distinct facts numbered per task; past this the numbers start again (the launcher's table
# is overwritten definition by definition: shapes that change every step must not grow it).
MAX_FACTS = 4096
# The calls checked here, kept for the flight recorder's reader (nblaunch.ranks.checks.recorder): it
# tells which recorded collectives these calls issued by their thread and time.
MAX_CLAIMS = 4096
# The two streams of calls: the calls checked here, numbered by this module; the flight
# recorder's entries, numbered by torch (``collective_seq_id``), read by ranks/checks/recorder.py.
CALLS, RECORDER = "calls", "recorder"
# Per group name: what the recorder's number of a call is, as the reader last found it: (its
# number - the group's sequence number before the call - 1, the point-to-point posts then).
_offsets: dict[str, tuple[int, int]] = {}


class Route:
    """A process group as the checks know it: its index on the wire, its name, its size, its
    ranks (global numbers) and how many calls this task made on it."""

    __slots__ = (
        "calls",
        "group",
        "index",
        "members",
        "name",
        "predicted",
        "recorded",
        "size",
        "stream",
    )

    def __init__(
        self, index: int, name: str, members: list[int], stream: str = CALLS, group: Any = None
    ) -> None:
        self.index, self.name, self.size, self.members = index, name, len(members), members
        self.calls = 0
        self.stream = stream
        self.group = group  # the process group
        self.recorded: Route | None = None  # the same group's route for the recorder's entries


class Claim:
    """A call checked here, as the flight recorder's reader matches it to its entries: the
    recorder's entries made on the same thread, on the same group, between ``start`` and
    ``end`` (nanoseconds, the recorder's clock; ``end`` 0 while the call runs) are its."""

    __slots__ = ("end", "facts", "group", "matched", "posted", "seq", "start", "thread")

    def __init__(self, route: Route, facts: int, seq: int, posted: int) -> None:
        self.group, self.facts = route.name, facts
        self.thread = threading.get_ident()
        # The group's sequence number before the call, and its point-to-point posts: gloo's
        # number counts those, its recorder's does not (the reader learns the difference).
        self.seq, self.posted = seq, posted
        self.matched = False  # the reader found the call's first entry
        self.start, self.end = time.time_ns(), 0


def definition(item: tuple[Any, ...]) -> bytes:
    """One definition message (see ``CALL``)."""
    data = pickle.dumps(item, pickle.HIGHEST_PROTOCOL)
    return DEFINITION.pack(DEFINITION_TAG, len(data)) + data


class Outbox:
    """Where one task's collectives go: a pipe to the launcher, and each group's numbers.

    Parameters
    ----------
    rank, task
        Whose calls these are.
    address
        The launcher's socket (Linux abstract namespace, without the leading NUL), where the
        pipe's reading end goes.
    """

    def __init__(self, rank: int, task: int, address: str) -> None:
        # process group -> its route, or None where this rank has nothing to check
        self.routes: dict[Any, Route | None] = {}
        self.facts: dict[tuple[Any, ...], int] = {}  # the facts sent so far, by their index
        self.claims: deque[Claim] = deque(maxlen=MAX_CLAIMS)
        self.predicting = False  # the recorder's reader runs (ranks/checks/recorder.py sets it)
        self._lock = threading.Lock()
        self.pipe: int | None = None  # the pipe's writing end
        read_end = -1
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect("\0" + address)
                read_end, self.pipe = os.pipe()
                with contextlib.suppress(OSError):
                    fcntl.fcntl(self.pipe, fcntl.F_SETPIPE_SZ, SEND_BUFFER_BYTES)
                socket.send_fds(sock, [definition(("rank", rank, task))], [read_end])
        except OSError:  # the launcher is gone: nobody to tell
            self.close()
        finally:
            if read_end >= 0:
                os.close(read_end)  # the launcher has its own now

    def route(self, group: Any = None) -> Route | None:
        """``group``'s route (None: the default group's), or None when this rank is not in it
        or it has no other rank: nothing to check. Asked once per group: torch's get_rank and
        get_world_size are Python calls that every collective would pay."""
        pg = group if group is not None else _dist().GroupMember.WORLD
        try:
            return self.routes[pg]
        except KeyError:
            pass
        except TypeError:  # not a group (unhashable): torch will say so
            return None
        if pg is None:  # no process group
            return None
        dist = _dist()
        with self._lock:  # one route per group, whichever thread asks first
            if pg in self.routes:
                return self.routes[pg]
            route = None
            try:
                if dist.get_rank(pg) >= 0 and dist.get_world_size(pg) >= 2:
                    # The ranks go with the group's definition: without them the launcher
                    # cannot release a call some ranks never issued (ranks/release.py).
                    ranks = dist.get_process_group_ranks(pg)
                    route = Route(len(self.routes), pg.group_name, ranks, group=pg)
            except (RuntimeError, ValueError, AttributeError, TypeError):  # torch will say so
                pass
            self.routes[pg] = route
            return route

    def add(self, route: Route, facts: tuple[Any, ...]) -> Claim | None:
        """Number one call on ``route``'s group and send it, with its facts; never waits.
        Returns the call's claim on what the flight recorder will show of it."""
        # One call at a time: threads issuing collectives (an autograd thread's DDP hook) must
        # not interleave their bytes, and the numbers must go out in order.
        with self._lock:
            route.calls += 1
            seq, posted = _sequence(route.group), waits.posted_in_sequence(route.name)
            predicted = -1
            if seq >= 0 and self.predicting:
                # The recorder's number this call should have, sent with it, before the
                # collective runs: gloo may abort this rank at once on a mismatch, and its
                # reader then never sends the entry.
                offset = _offsets.get(route.name)
                if offset is None or offset[1] != posted:  # gloo counts its sends, its recorder not
                    offset = (-posted, posted)
                predicted = seq + 1 + offset[0]
            index = self._send(route, route.calls, facts, predicted)
            if index is None:
                return None
            claim = Claim(route, index, seq, posted)
            self.claims.append(claim)
            return claim

    def add_recorded(self, entries: list[tuple[Route, int, tuple[Any, ...] | int]]) -> None:
        """Send flight recorder entries, each ``(route, its number on the group, its facts or
        the index of facts already sent)`` (a call checked here that issued it), in one write."""
        with self._lock:  # its definitions reach the pipe before any call that uses them
            parts = []
            for route, seq, facts in entries:
                recorded = route.recorded
                if recorded is None:
                    recorded = route.recorded = Route(
                        1_000_000 + route.index, route.name, route.members, RECORDER
                    )
                recorded.calls += 1
                parts.append(self._message(recorded, seq, facts)[0])
            self._write(b"".join(parts))  # not +=: a read may bring 2,000 entries

    def _send(
        self, route: Route, n: int, facts: tuple[Any, ...] | int, predicted: int = -1
    ) -> int | None:
        """Write call ``n`` of ``route`` (and the definitions it needs); the facts' index."""
        if self.pipe is None:
            return None
        message, index = self._message(route, n, facts, predicted)
        self._write(message)
        return index

    def _message(
        self, route: Route, n: int, facts: tuple[Any, ...] | int, predicted: int = -1
    ) -> tuple[bytes, int]:
        """Call ``n`` of ``route`` as bytes, after the definitions it needs; the facts' index."""
        message = b""
        if route.calls == 1:
            message = definition(
                ("group", route.index, route.name, route.size, route.members, route.stream)
            )
        if isinstance(facts, int):
            index = facts
        else:
            found = self.facts.get(facts)
            if found is None:
                if len(self.facts) >= MAX_FACTS:
                    self.facts.clear()
                    self.claims.clear()  # their indices are about to mean other facts
                found = self.facts[facts] = len(self.facts)
                message += definition(("facts", found, facts))
            index = found
        if predicted >= 0:
            message += PREDICTED_CALL.pack(PREDICTED_TAG, route.index, n, index, predicted)
        else:
            message += CALL.pack(CALL_TAG, route.index, n, index)
        return message, index

    def _write(self, message: bytes) -> None:
        try:
            while message and self.pipe is not None:  # one write unless a signal cut it short
                message = message[os.write(self.pipe, message) :]
        except OSError:  # the launcher is gone
            self.close()

    def close(self) -> None:
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None


_outbox: Outbox | None = None
_torch_distributed: Any = None


def _dist() -> Any:
    """torch.distributed, imported once: an import statement costs every collective a lookup."""
    global _torch_distributed
    if _torch_distributed is None:
        import torch.distributed

        _torch_distributed = torch.distributed
    return _torch_distributed


def learn_offset(claim: Claim, seq: int) -> None:
    """The reader found ``claim``'s call first recorded as ``seq``: the next calls' numbers."""
    if claim.seq >= 0:
        _offsets[claim.group] = (seq - claim.seq - 1, claim.posted)


def _sequence(group: Any) -> int:
    """The process group's sequence number (its last collective's), or -1 where torch has none."""
    number = process_groups.sequence_number(group)
    return -1 if number is None else number


def current() -> Outbox | None:
    """This task's outbox while the out-of-band checks are on in it, else None."""
    return _outbox


@contextlib.contextmanager
def collective_outbox(context: this_rank.RankContext) -> Iterator[Outbox | None]:
    """Keep an outbox while a task runs with the checks on (a task hook in every rank)."""
    global _outbox
    address = context.options.get("checks_address")
    if context.debug or not context.options.get("checks") or not address:
        yield None
        return
    outbox = _outbox = Outbox(context.rank, context.task_id, address)
    try:
        yield outbox  # inside: the recorder's reader (nblaunch.ranks.checks.recorder), a task hook
    finally:
        _outbox = None
        outbox.close()


this_rank.add_task_hook(collective_outbox)
