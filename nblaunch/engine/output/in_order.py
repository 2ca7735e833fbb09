"""In-order log records, lined up in the notebook.

The ranks' side is :mod:`nblaunch.ranks.logging`.

Ordering happens here, not with barriers in the ranks, so ranks that log different numbers of
records or at different levels never wait for each other. A group of records is held until every
rank has sent its record, finished, or gone past the next collective; only code without
collectives falls back on a timeout (``IN_ORDER_WAIT_S``), so ranks that start logging seconds
apart still come out in rank order.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from typing import Any

# Longest an in-order record waits for a rank that neither logs in order, nor finishes, nor issues
# a collective (see InOrderLog): generous, because only code without collectives depends on it.
IN_ORDER_WAIT_S = 30.0


class InOrderLog:
    """Releases ``in_order`` Log events in (seq, rank) order; passes every other event through.

    The ``n``-th in-order record of every rank forms group ``n``. Groups are released in order,
    each sorted by rank, as soon as every rank running the task is accounted for. A rank is
    accounted for at group ``n`` when

    1. it sent its ``n``-th in-order record (or a later one);
    2. its task is over: it finished (returned or raised);
    3. it is known to have moved past the place where it would have logged it: it issued more
       collectives on the default process group than any rank had issued when logging its
       ``n``-th record (its heartbeats, about once a second, and its log records carry its
       count). Ranks that run the same code log their ``n``-th record between the same two
       collectives; a rank beyond that point has no ``n``-th record to give there. So a rank
       that logs fewer records and then keeps training holds the others back by about a
       heartbeat; or
    4. as the last resort, for code without collectives: it sent no in-order record for
       ``wait_s`` (default 30 s), counted from the group's first record or from its own latest
       in-order record, whichever came later (a slow rank that keeps logging keeps its place).
       A rank passed over this way is not waited for again until it sends another in-order
       record, so it delays the others once, not at every group.

    Nothing else releases a group, so a rank that starts logging seconds after the others (it
    loaded data, compiled, or slept) keeps its place: no timing guess below ``wait_s`` decides
    the order. A record whose group was already shown is shown at once. Nothing in the ranks
    waits: the ordering costs them no collective and no barrier.

    Parameters
    ----------
    ranks
        The ranks of the run (more can be added with :meth:`add_rank`).
    wait_s
        How long a rank that sends nothing in order and gives no sign of having moved on is
        waited for (default ``IN_ORDER_WAIT_S``).
    clock
        Monotonic time source (tests pass a fake one).
    """

    def __init__(
        self,
        ranks: Iterable[int] = (),
        *,
        wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ranks = set(ranks)
        self.wait_s = IN_ORDER_WAIT_S if wait_s is None else wait_s
        self.clock = clock
        self._task_ranks: set[int] | None = None  # None: every rank runs the task
        self._pending: dict[int, _Group] = {}
        self._seqs: list[int] = []  # heap of the sequence numbers in _pending
        self._shown = -1  # every group up to this one was released
        self._next: dict[int, int] = {}  # rank -> one past the highest seq it sent
        self._last: dict[int, float] = {}  # rank -> when its latest in-order record arrived
        self._collectives: dict[int, int] = {}  # rank -> highest collective count it reported
        self._done: set[int] = set()
        self._passed_over: set[int] = set()  # timed out at a group; not waited for again

    def add_rank(self, rank: int) -> None:
        self.ranks.add(rank)

    def start_task(self, ranks: Iterable[int]) -> None:
        """Only ``ranks`` run the next task (a pool cell with ``--ranks``): wait for those alone.

        Holds until the task is over (every one of them finished, or :meth:`flush`).
        """
        self._task_ranks = set(ranks)

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one event from a rank; return the events to show now, in order."""
        kind = event.get("kind")
        rank = event.get("rank")
        if kind == "log":
            self._count_collectives(rank, event.get("collectives"))
            if event.get("in_order"):
                return self._add(event)
        elif kind == "heartbeat":
            self._count_collectives(rank, event.get("seq"))
        elif kind in ("failure", "finished"):
            self._done.add(rank)
            running = self._running()
            if kind == "finished" and running and self._done >= running:
                # The task is over everywhere: start afresh (a pool runs the next cell).
                return [*self.flush(), event]
        else:
            return [event]
        return [*self._release(), event] if self._seqs else [event]

    def poll(self) -> list[dict[str, Any]]:
        """Records whose wait ran out (call often, e.g. every relay poll)."""
        return self._release() if self._seqs else []

    def flush(self) -> list[dict[str, Any]]:
        """Release everything held, in order, and forget the ranks' progress (the task ended)."""
        released = []
        while self._seqs:
            released += self._pending.pop(heapq.heappop(self._seqs)).sorted()
        self._shown = -1
        self._task_ranks = None
        self._next.clear()
        self._last.clear()
        self._collectives.clear()
        self._done.clear()
        self._passed_over.clear()
        return released

    def _running(self) -> set[int]:
        return self.ranks if self._task_ranks is None else self._task_ranks

    def _count_collectives(self, rank: int, count: int | None) -> None:
        if count is not None and count > self._collectives.get(rank, -1):
            self._collectives[rank] = count

    def _add(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        rank, seq = event["rank"], int(event["seq"])
        self.ranks.add(rank)
        self._next[rank] = max(self._next.get(rank, 0), seq + 1)
        self._last[rank] = now = self.clock()
        self._passed_over.discard(rank)  # it logs in order again: wait for it again
        if seq <= self._shown:
            return [*self._release(), event]  # its group is out already: late, shown at once
        group = self._pending.get(seq)
        if group is None:
            group = self._pending[seq] = _Group(first=now)
            heapq.heappush(self._seqs, seq)
        group.add(rank, event)
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        released: list[dict[str, Any]] = []
        now = self.clock()
        while self._seqs:
            seq = self._seqs[0]
            group = self._pending[seq]
            timed_out = []
            for rank in self._running():
                wait = self._wait_for(rank, seq, group, now)
                if wait is None:
                    continue
                if wait > 0:
                    return released
                timed_out.append(rank)
            self._passed_over.update(timed_out)
            heapq.heappop(self._seqs)
            del self._pending[seq]
            self._shown = seq
            released += group.sorted()
        return released

    def _wait_for(self, rank: int, seq: int, group: _Group, now: float) -> float | None:
        """``None`` if ``rank`` is accounted for at group ``seq``; else seconds left to wait."""
        if self._next.get(rank, 0) > seq or rank in self._done or rank in self._passed_over:
            return None
        count = self._collectives.get(rank)
        if group.collectives is not None and count is not None and count > group.collectives:
            return None  # it went on past the collective after which the others logged
        return self.wait_s - (now - max(group.first, self._last.get(rank, group.first)))


class _Group:
    """The records with one sequence number, as they arrive."""

    def __init__(self, first: float) -> None:
        self.first = first  # when its first record arrived
        self.collectives: int | None = None  # the most collectives a rank had issued at it
        self.records: list[tuple[int, dict[str, Any]]] = []

    def add(self, rank: int, event: dict[str, Any]) -> None:
        self.records.append((rank, event))
        count = event.get("collectives")
        if count is not None and (self.collectives is None or count > self.collectives):
            self.collectives = count

    def sorted(self) -> list[dict[str, Any]]:
        return [event for _, event in sorted(self.records, key=lambda item: item[0])]
