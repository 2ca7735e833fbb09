"""Out-of-band checks: each rank tells the launcher which collectives it issues, without waiting.

On by default (``debug=False`` or ``NBLAUNCH_CHECKS=0`` turn them off; ``debug=True`` checks
before each call instead). The same calls debug mode verifies (:mod:`nblaunch.ranks.ops`,
torch.distributed's collectives and DDP's gradient all-reduce, patched by
:mod:`nblaunch.ranks.debug_patches`) each send the call's facts (operation, call site,
shapes, dtypes, arguments: a plain tuple, ``debug_report.FACTS``), numbered by its process
group and its place on that group, to the launcher (:mod:`nblaunch.engine.checks`), which
compares the ranks' facts and stops the run with debug mode's
:class:`~nblaunch.errors.DistributedOperationException` when two ranks disagree at the same step
of the same group. The collective itself runs at once.

Each call is one pickled tuple (``debug_report.CALL_FIELDS``) on a local socket (one
connection per rank and task) that the launcher reads about 20 times a second, not a message on
the event pipe: the pipe wakes the launcher at every write, and on a busy machine those wake-ups
cost a step more than the checks themselves (measured: 1.2-1.6x). A call's facts and their
message cost about 25 µs of a rank's CPU inside a training step (8 in a warm loop), queue in
the kernel until read, and are still there when their sender was killed right after (gloo
aborts a rank on some mismatches). Only when the launcher is a megabyte behind does a rank wait
for it. Each message goes out before its collective starts, so a rank that hangs in it has
told the launcher where; batching messages would need a thread that wakes up to flush them,
and a message costs less than a wake-up.

The numbers are this module's own, per group and per task: they count the calls checked here,
so collectives torch issues out of sight (DDP's bucket rebuild, its buffer broadcast) cannot
shift them, and a task that failed half-way leaves nothing to the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

from nblaunch.ranks import worker

# Records a rank may send ahead of the launcher's reading (~5000 calls) before it waits.
SEND_BUFFER_BYTES = 1 << 20
_LENGTH = struct.Struct("<I")  # each message's length, before it
# A process group as the checks know it: its name, its size, its ranks (global numbers).
Route = tuple[str, int, list[int]]


def checks_on() -> bool:
    """True inside a rank whose launch has the out-of-band checks on."""
    context = worker.current()
    return context is not None and not context.debug and bool(context.options.get("checks"))


class Outbox:
    """Where one task's collectives go: the launcher's socket, and each group's numbers.

    Parameters
    ----------
    rank, task
        Whose calls these are.
    address
        The launcher's socket (Linux abstract namespace, without the leading NUL).
    """

    def __init__(self, rank: int, task: int, address: str) -> None:
        self.rank = rank
        self.task = task
        self.counters: dict[str, Iterator[int]] = {}  # group name -> its next numbers
        # process group -> its route, or None where this rank has nothing to check
        self.routes: dict[Any, Route | None] = {}
        self._lock = threading.Lock()
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self.sock.connect("\0" + address)
        except OSError:  # the launcher is gone: nobody to tell
            self.close()

    def route(self, group: Any = None) -> Route | None:
        """``group``'s name, size and ranks (None: the default group's), or None when this rank
        is not in it or it has no other rank: nothing to check. Asked once per group: torch's
        get_rank and get_world_size are Python calls that every collective would pay."""
        import torch.distributed as dist

        pg = group if group is not None else dist.GroupMember.WORLD
        if pg is None:  # no process group
            return None
        try:
            return self.routes[pg]
        except KeyError:
            pass
        except TypeError:  # not a group (unhashable): torch will say so
            return None
        route = None
        try:
            if dist.get_rank(pg) >= 0 and dist.get_world_size(pg) >= 2:
                # The ranks go with the group's first call of a task: without them the
                # launcher cannot release a call some ranks never issued (ranks/release.py).
                ranks = dist.get_process_group_ranks(pg)
                route = (pg.group_name, len(ranks), ranks)
        except (RuntimeError, ValueError, AttributeError, TypeError):  # torch will say so
            pass
        self.routes[pg] = route
        return route

    def add(self, group: str, size: int, members: list[int], facts: tuple[Any, ...]) -> None:
        """Number one call on ``group`` (``size`` ranks: ``members``) and send its facts; never
        waits. The members go with the group's first call of a task only."""
        # One call at a time: threads issuing collectives (an autograd thread's DDP hook) must
        # not interleave their bytes, and the numbers must go out in order.
        with self._lock:
            counter = self.counters.get(group)
            if counter is None:
                counter = self.counters[group] = itertools.count(1)
            n = next(counter)
            if self.sock is None:
                return
            data = pickle.dumps(
                (self.rank, self.task, group, size, n, facts, members if n == 1 else None),
                pickle.HIGHEST_PROTOCOL,
            )
            try:
                self.sock.sendall(_LENGTH.pack(len(data)) + data)
            except OSError:  # the launcher hung up
                self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


_outbox: Outbox | None = None


def current() -> Outbox | None:
    """This task's outbox while the out-of-band checks are on in it, else None."""
    return _outbox


def send(facts: tuple[Any, ...], group: Any = None) -> None:
    """Number one call's facts (``debug_report.FACTS``) on ``group`` and send them.

    Never waits for a peer.
    """
    outbox = _outbox
    if outbox is None:
        return
    route = outbox.route(group)
    if route is not None:
        outbox.add(*route, facts)


@contextlib.contextmanager
def collective_outbox(context: worker.RankContext) -> Iterator[Outbox | None]:
    """Keep an outbox while a task runs with the checks on (a task hook in every rank)."""
    global _outbox
    address = context.options.get("checks_address")
    if context.debug or not context.options.get("checks") or not address:
        yield None
        return
    outbox = _outbox = Outbox(context.rank, context.task_id, address)
    try:
        yield outbox
    finally:
        _outbox = None
        outbox.close()


worker.add_task_hook(collective_outbox)
