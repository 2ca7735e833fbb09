"""Rank-aware logging: ``get_logger``, log records relayed from ranks, and in-order display.

Three parts, one per side of the process boundary:

- :func:`get_logger` returns a :class:`RankLogger`, a ``logging.LoggerAdapter`` whose methods take
  ``main_process_only=True`` (only rank 0 logs) and ``in_order=False`` (``True``: every rank logs
  and the view shows the records in rank order).
- Inside ranks, a task hook puts a :class:`RankRelayHandler` on the root logger, so records of
  every logger (nblaunch's and ordinary ``logging`` loggers of libraries) travel to the notebook
  as ``Log`` events tagged with their rank and level, unless the user configured handlers that
  already print them.
- In the parent, :class:`InOrderLog` lines ``in_order`` records up by (per-rank sequence number,
  rank). Ordering happens here, not with barriers in the ranks, so ranks that log different
  numbers of records or at different levels never wait for each other: a record waits for a
  rank that is behind only while that rank keeps logging in-order records, at most
  ``IN_ORDER_WAIT_S`` seconds after its last one.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nblaunch import worker

LEVEL_ENV = ("NBLAUNCH_LOG_LEVEL", "ACCELERATE_LOG_LEVEL")
# Longest an in-order record waits for the other ranks' records of the same step.
IN_ORDER_WAIT_S = 0.4
_IN_ORDER_ATTR = "nblaunch_in_order"


def _level_from_env() -> str | None:
    for name in LEVEL_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            return value.upper()
    return None


class RankLogger(logging.LoggerAdapter):
    """A logger that knows which rank it runs on.

    Every method (``debug``, ``info``, ``warning``, ``error``, ``critical``, ``exception``,
    ``log``) takes two extra keywords:

    main_process_only : bool, default True
        Log on rank 0 only.
    in_order : bool, default False
        Log on every rank; the notebook shows the records of one step in rank order. Costs no
        collective, so ranks may log different numbers of records.

    Outside a launch it is an ordinary logger (``main_process_only`` still follows torchrun's
    ``RANK``).
    """

    def __init__(self, logger: logging.Logger, log_level: str | int | None = None) -> None:
        super().__init__(logger, {})
        self.log_level = log_level
        level = log_level if log_level is not None else _level_from_env()
        if level is not None:
            logger.setLevel(level.upper() if isinstance(level, str) else level)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt by name in the rank, where the level is applied again (the parent's logger
        # object, with its level, does not travel).
        return (get_logger, (self.logger.name, self.log_level))

    def log(
        self,
        level: int,
        msg: object,
        *args: Any,
        main_process_only: bool = True,
        in_order: bool = False,
        **kwargs: Any,
    ) -> None:
        if not self.isEnabledFor(level):
            return
        if main_process_only and not in_order and worker.rank() != 0:
            return
        extra = kwargs.get("extra") or {}
        msg, kwargs = self.process(msg, kwargs)  # replaces kwargs["extra"] by the adapter's
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **extra}
        if in_order:
            kwargs["extra"][_IN_ORDER_ATTR] = True
        # Report the caller's line, not this method's.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> RankLogger:
    """A rank-aware logger: ``get_logger(__name__).info("loss %.3f", loss, in_order=True)``.

    Parameters
    ----------
    name
        The ``logging`` logger name.
    log_level
        Its level, e.g. ``"INFO"``; default ``NBLAUNCH_LOG_LEVEL``, else ``ACCELERATE_LOG_LEVEL``,
        else the ``logging`` default (warnings and above). ``notebook_launcher(log_level=...)``
        sets ``NBLAUNCH_LOG_LEVEL`` in the ranks.

    Returns
    -------
    RankLogger
        Its methods take ``main_process_only=True`` and ``in_order=False``.
    """
    return RankLogger(logging.getLogger(name), log_level)


# --- inside ranks: records become Log events -----------------------------------------------------


class RankRelayHandler(logging.Handler):
    """Sends each record that reaches the root logger to the parent as a ``Log`` event.

    It stands down for records that a handler configured by the user already writes (they reach
    the notebook as that rank's output), so nothing is shown twice.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.seq = 0
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self._printed_elsewhere(record):
            return
        try:
            in_order = bool(getattr(record, _IN_ORDER_ATTR, False))
            seq = -1
            if in_order:  # emit runs under the handler's lock: the counter is safe
                seq = self.seq
                self.seq += 1
            worker.emit(
                {
                    "kind": "log",
                    "rank": self.rank,
                    "level": record.levelname,
                    "name": record.name,
                    "message": self.format(record),
                    "in_order": in_order,
                    "seq": seq,
                    "time": record.created,
                }
            )
        except Exception:
            self.handleError(record)

    def _printed_elsewhere(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            for handler in logger.handlers:
                if (
                    handler is not self
                    and not isinstance(handler, logging.NullHandler)
                    and record.levelno >= handler.level
                ):
                    return True
            if not logger.propagate:
                break
            logger = logger.parent
        return False


@contextlib.contextmanager
def relay_records(rank: int) -> Iterator[RankRelayHandler]:
    """Relay log records to the parent while the block runs (the task hook of every rank)."""
    handler = RankRelayHandler(rank)
    root = logging.getLogger()
    original_basic_config = logging.basicConfig
    logging.basicConfig = _basic_config_beside(handler, original_basic_config)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        logging.basicConfig = original_basic_config


def _basic_config_beside(
    handler: logging.Handler, original: Callable[..., None]
) -> Callable[..., None]:
    """``logging.basicConfig`` that ignores the relay handler when deciding to configure."""

    def basic_config(**kwargs: Any) -> None:
        root = logging.getLogger()
        root.removeHandler(handler)
        try:
            original(**kwargs)
        finally:
            root.addHandler(handler)

    basic_config.__doc__ = original.__doc__
    return basic_config


def _task_hook(context: worker.RankContext) -> contextlib.AbstractContextManager[Any]:
    return relay_records(context.rank)


worker.add_task_hook(_task_hook)


# --- in the parent: in-order records, lined up --------------------------------------------------


class InOrderLog:
    """Releases ``in_order`` Log events in (seq, rank) order; passes every other event through.

    The records with sequence number ``s`` are released together, sorted by rank, once every
    rank has sent record ``s`` (or a later one), finished, or stayed silent: sent no in-order
    record for ``wait_s`` seconds since the first record ``s`` arrived. So a rank that is merely
    slower keeps its place at every step, while a rank that logs fewer records, logs at a
    higher level, or died delays the others by at most ``wait_s``. Nothing in the ranks waits.

    Parameters
    ----------
    ranks
        The ranks of the run (more can be added with :meth:`add_rank`).
    wait_s
        How long a silent rank is waited for (default ``IN_ORDER_WAIT_S``).
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
        self._pending: dict[int, list[tuple[int, float, dict[str, Any]]]] = {}
        self._seqs: list[int] = []  # heap of the sequence numbers in _pending
        self._next: dict[int, int] = {}  # rank -> one past the highest seq it sent
        self._last: dict[int, float] = {}  # rank -> when its latest in-order record arrived
        self._done: set[int] = set()

    def add_rank(self, rank: int) -> None:
        self.ranks.add(rank)

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one event from a rank; return the events to show now, in order."""
        kind = event.get("kind")
        if kind == "log" and event.get("in_order"):
            rank, seq = event["rank"], int(event["seq"])
            self.ranks.add(rank)
            self._next[rank] = max(self._next.get(rank, 0), seq + 1)
            self._last[rank] = now = self.clock()
            if seq not in self._pending:
                self._pending[seq] = []
                heapq.heappush(self._seqs, seq)
            self._pending[seq].append((rank, now, event))
            return self._release()
        if kind == "finished":
            self._done.add(event["rank"])
            # Once the task is over everywhere, start afresh (a pool runs the next cell).
            over = bool(self.ranks) and self._done >= self.ranks
            return [*(self.flush() if over else self._release()), event]
        return [event]

    def poll(self) -> list[dict[str, Any]]:
        """Records whose wait ran out (call often, e.g. every relay poll)."""
        return self._release() if self._seqs else []

    def flush(self) -> list[dict[str, Any]]:
        """Release everything held, in order, and forget the ranks' progress."""
        released = []
        while self._seqs:
            released += self._take(heapq.heappop(self._seqs))
        self._next.clear()
        self._last.clear()
        self._done.clear()
        return released

    def _release(self) -> list[dict[str, Any]]:
        released: list[dict[str, Any]] = []
        now = self.clock()
        while self._seqs:
            seq = self._seqs[0]
            batch = self._pending[seq]
            first = min(arrived for _, arrived, _ in batch)
            behind = [r for r in self.ranks if self._next.get(r, 0) <= seq and r not in self._done]
            # Wait only for a rank that is still logging in order: silent for wait_s, it is
            # taken to have nothing to say at this step.
            if any(now - max(first, self._last.get(r, first)) < self.wait_s for r in behind):
                break
            heapq.heappop(self._seqs)
            released += self._take(seq)
        return released

    def _take(self, seq: int) -> list[dict[str, Any]]:
        batch = self._pending.pop(seq)
        batch.sort(key=lambda item: item[0])
        return [event for _, _, event in batch]
