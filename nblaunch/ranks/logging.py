"""Rank-aware logging in the ranks: ``get_logger``, and log records relayed to the notebook.

- :func:`get_logger` returns a :class:`RankLogger`, a ``logging.LoggerAdapter`` whose methods take
  ``main_process_only=True`` (only rank 0 logs) and ``in_order=False`` (``True``: every rank logs
  and the view shows the records in rank order).
- A task hook puts a :class:`RankRelayHandler` on the root logger, so records of every logger
  (nblaunch's and ordinary ``logging`` loggers of libraries) travel to the notebook as ``Log``
  events tagged with their rank and level, unless the user configured handlers that already
  print them.

The notebook lines ``in_order`` records up (:mod:`nblaunch.engine.output.in_order`), never with a
barrier in the ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.stacks import collective_sequence

LEVEL_ENV = ("NBLAUNCH_LOG_LEVEL", "ACCELERATE_LOG_LEVEL")
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
        if main_process_only and not in_order and this_rank.rank() != 0:
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
            this_rank.emit(
                {
                    "kind": "log",
                    "rank": self.rank,
                    "level": record.levelname,
                    "name": record.name,
                    "message": self.format(record),
                    "in_order": in_order,
                    "seq": seq,
                    # lets the parent tell a rank that has moved on from one that is behind
                    "collectives": collective_sequence(),
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


def _task_hook(context: this_rank.RankContext) -> contextlib.AbstractContextManager[Any]:
    return relay_records(context.rank)


this_rank.add_task_hook(_task_hook)
