"""Out-of-memory retries that keep every rank on the same batch size.

:func:`find_executable_batch_size` runs a training function at a batch size, and when it runs out
of memory, frees what it can and runs it again at a smaller size. With several ranks, a rank that
ran out of memory must not go on alone: the ranks would pair up collectives from different
attempts (silently wrong results) or wait for each other forever. So:

- After each attempt, every rank records "ok" or "out of memory" in the process group's key-value
  store and waits until every rank has done the same (an agreement that cannot pair up with the
  training's own collectives); then all ranks retry, or all go on, together.
- When a rank ran out of memory while its peers were blocked in a collective of that attempt
  (they can never reach the agreement), the parent's
  :class:`~nblaunch.engine.monitors.batch_size.BatchSizeMonitor` notices it and asks the launcher to
  restart every rank at the smaller size.

Each agreed attempt is a ``Progress`` event (``what="batch_size"``) that views print as
``128 x (rank 1: out of memory) -> 64 x -> 32 ok``, then ``batch 32 per rank x 2 ranks = 64
effective``. Recognising an out-of-memory error and freeing memory are in
:mod:`nblaunch.ranks.memory.memory`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from nblaunch.errors import NoExecutableBatchSizeError
from nblaunch.ranks import this_rank
from nblaunch.ranks.memory.memory import effective_batch_size_event, free_memory, is_out_of_memory

# Key of the setup option through which a restart tells ranks where to resume the search.
RESTART_OPTION = "batch_size_restart"
# A rank that ran out of memory says it is waiting for its peers after this long.
WAIT_NOTICE_S = 0.5

# Searches are numbered per task (reset by a task hook), and keyed by the task's id, which every
# rank gets from the parent: ranks agree on names even after a task failed half-way on some.
_call_index = 0


@contextlib.contextmanager
def _count_searches(context: this_rank.RankContext) -> Iterator[None]:
    global _call_index
    _call_index = 0
    yield


this_rank.add_task_hook(_count_searches)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    *,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[int], int] | None = None,
) -> Any:
    """Run ``function(batch_size, ...)``, retrying at smaller sizes when memory runs out.

    Decorate an inner training function whose first parameter is the batch size, and call it
    without that argument; build everything that holds device memory (model, optimizer,
    dataloader) inside it, so a retry starts clean::

        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, epochs):
            model = build_model().to(device)
            ...

        train(3)                                    # or: find_executable_batch_size(f)(3)

    On several ranks, every rank ends on the same batch size: the ranks agree on each attempt's
    outcome before any goes on, and ranks blocked in a collective while a peer ran out of memory
    are restarted by the launcher at the smaller size.

    Parameters
    ----------
    function
        The function; omit it to use ``find_executable_batch_size(...)`` as a decorator.
    starting_batch_size
        The first size tried.
    reduce_batch_size_fn
        ``reduce(batch_size) -> smaller batch size``; default: halve.

    Returns
    -------
    callable
        The wrapped function; it returns what ``function`` returns at the size that fit.

    Raises
    ------
    NoExecutableBatchSizeError
        The size went below 1; the message lists the sizes tried.
    TypeError
        The wrapped function was called with a batch size.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if (
        isinstance(starting_batch_size, bool)
        or not isinstance(starting_batch_size, int)
        or starting_batch_size < 1
    ):
        raise ValueError(
            f"starting_batch_size must be a whole number of at least 1, got {starting_batch_size!r}"
        )
    reduce = reduce_batch_size_fn or _halve

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _refuse_batch_size_argument(function, args, kwargs)
        return _Search(function, starting_batch_size, reduce).run(args, kwargs)

    return wrapper


def _halve(batch_size: int) -> int:
    return batch_size // 2


def _refuse_batch_size_argument(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return
    if not parameters or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return
    name = getattr(function, "__name__", "the function")
    first = parameters[0].name
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) >= len(positional) or first in kwargs:
        raise TypeError(
            f"call {name}() without its first argument {first!r}: find_executable_batch_size "
            f"passes the batch size itself (you passed {len(args)} positional argument(s)"
            f"{' and ' + first + '=' if first in kwargs else ''})"
        )


class _Search:
    """One call of a wrapped function: attempts, agreement, events."""

    def __init__(
        self, function: Callable[..., Any], starting: int, reduce: Callable[[int], int]
    ) -> None:
        global _call_index
        self.function = function
        self.reduce = reduce
        context = this_rank.current()
        self.rank = this_rank.rank()
        self.world_size = this_rank.world_size()
        self.key = f"{_call_index}:{getattr(function, '__qualname__', '?')}"
        task_id = context.task_id if context is not None else 0
        self.agreement = _Agreement.open(task_id, _call_index)
        _call_index += 1
        resume = None
        if context is not None:  # a restarted launch resumes where the search left off
            resume = (context.options.get(RESTART_OPTION) or {}).get(self.key)
        self.batch_size = int(resume["batch_size"]) if resume else starting
        self.history: list[dict[str, Any]] = list(resume["history"]) if resume else []
        if self.agreement is None and self.world_size > 1:
            # No process group: the ranks cannot agree, so each searches alone and says so.
            self.world_size = 1
            self.ranks = [self.rank]
        else:
            self.ranks = list(range(self.world_size))

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        while True:
            if self.batch_size < 1:
                raise NoExecutableBatchSizeError(no_size_message(self.history))
            attempt = len(self.history) + 1
            out_of_memory = ""
            try:
                result = self.function(self.batch_size, *args, **kwargs)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                out_of_memory = _first_line(exc)
                result = None
            # Outside the except block, the traceback (and the tensors its frames hold) is gone.
            if out_of_memory:
                free_memory()
            next_size = self._next(self.batch_size) if out_of_memory else None
            if self.agreement is None:
                oom_ranks = [self.rank] if out_of_memory else []
            else:
                oom_ranks = self.agreement.outcome(
                    attempt,
                    bool(out_of_memory),
                    on_wait=functools.partial(self._waiting, attempt, next_size, out_of_memory),
                )
            self._resolve_notice(oom_ranks, next_size)
            if not oom_ranks:
                self.history.append({"batch_size": self.batch_size, "oom": []})
                if _reports() or self.agreement is None:
                    this_rank.emit(self._attempt_event("ok", done=True))
                    this_rank.emit(
                        effective_batch_size_event(self.batch_size, self.world_size, self.ranks)
                    )
                return result
            del result  # a rank that got through must run again at the agreed size
            free_memory()
            if next_size is None:
                next_size = self._next(self.batch_size)
            self.history.append({"batch_size": self.batch_size, "oom": oom_ranks})
            if _reports() or self.agreement is None:
                this_rank.emit(self._attempt_event("oom", next_size=next_size, attempt=attempt))
            self.batch_size = next_size

    def _next(self, batch_size: int) -> int:
        smaller = int(self.reduce(batch_size))
        if smaller >= batch_size:
            raise ValueError(
                f"reduce_batch_size_fn({batch_size}) returned {smaller}; it must return a "
                "smaller batch size, or the search would never end"
            )
        return smaller

    def _waiting(self, attempt: int, next_size: int | None, reason: str) -> None:
        """Tell the parent this rank ran out of memory and waits for its peers' outcome."""
        self._told = True
        this_rank.emit(
            {
                "kind": "progress",
                "rank": self.rank,
                "what": "batch_size",
                "text": (
                    f"rank {self.rank}: out of memory at batch_size={self.batch_size} "
                    f"(attempt {attempt}); waiting for the other ranks to finish this attempt"
                ),
                "data": {
                    "status": "waiting",
                    "key": self.key,
                    "attempt": attempt,
                    "batch_size": self.batch_size,
                    "next_batch_size": next_size,
                    "history": list(self.history),
                    "ranks": [self.rank],
                    "reason": reason,
                    "done": False,
                },
            }
        )

    def _resolve_notice(self, oom_ranks: list[int], next_size: int | None) -> None:
        """Replace this rank's "waiting" line once the ranks agreed (rank 0 says the rest)."""
        if not getattr(self, "_told", False) or _reports():
            return
        self._told = False
        this_rank.emit(
            {
                "kind": "progress",
                "rank": self.rank,
                "what": "batch_size",
                "text": (
                    f"rank {self.rank}: every rank finished attempt {len(self.history) + 1}; "
                    f"{who_ran_out(oom_ranks, self.world_size)} ran out of memory, "
                    f"all retry with {next_size}"
                ),
                "data": {
                    "status": "agreed",
                    "key": self.key,
                    "attempt": len(self.history) + 1,
                    "ranks": [self.rank],
                    "done": False,
                },
            }
        )

    def _attempt_event(
        self, status: str, *, done: bool = False, next_size: int | None = None, attempt: int = 0
    ) -> dict[str, Any]:
        text = render_attempts(self.history, self.world_size)
        last = self.history[-1]
        message = ""
        if status == "oom":
            message = (
                f"{who_ran_out(last['oom'], self.world_size)}: out of memory at "
                f"batch_size={last['batch_size']}, retrying with {next_size} "
                f"(attempt {attempt + 1})"
            )
        return {
            "kind": "progress",
            "rank": self.rank,
            "what": "batch_size",
            "text": text,
            "data": {
                "status": status,
                "key": self.key,
                "attempt": len(self.history),
                "batch_size": last["batch_size"],
                "next_batch_size": next_size,
                "oom_ranks": last["oom"],
                "history": list(self.history),
                "ranks": self.ranks,
                "message": message,
                "done": done,
            },
        }


def _reports() -> bool:
    """Whether this rank speaks for all after an agreement (rank 0; every rank alone)."""
    return this_rank.rank() == 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def who_ran_out(ranks: list[int], world_size: int) -> str:
    if world_size > 1 and len(ranks) == world_size:
        return "all ranks"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def render_attempts(history: list[dict[str, Any]], world_size: int) -> str:
    """``128 x (rank 1: out of memory) -> 64 x -> 32 ok`` from a search's attempts.

    Who ran out of memory is named when it changes from the attempt before; a restart of every
    rank is noted on the attempt that caused it.
    """
    parts = []
    previous: list[int] | None = None
    for entry in history:
        if not entry["oom"]:
            parts.append(f"{entry['batch_size']} ok")
            continue
        notes = []
        if entry["oom"] != previous:
            notes.append(f"{who_ran_out(entry['oom'], world_size)}: out of memory")
        if entry.get("restarted"):
            notes.append("all ranks restarted")
        previous = entry["oom"]
        parts.append(f"{entry['batch_size']} x" + (f" ({'; '.join(notes)})" if notes else ""))
    return " -> ".join(parts)


def no_size_message(history: list[dict[str, Any]]) -> str:
    sizes = ", ".join(str(entry["batch_size"]) for entry in history) or "none"
    return (
        f"no batch size fits in memory: tried {sizes}, and every one ran out of memory on at "
        "least one rank. Make the model or the inputs smaller (shorter sequences, lower "
        "precision, gradient checkpointing), or use more devices"
    )


class _Agreement:
    """Every rank's outcome of an attempt, exchanged through the process group's store.

    A key-value store rather than a collective: a collective here could pair up with a
    collective that a peer is still blocked in from the attempt itself, mixing attempts.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def open(cls, task_id: int, call_index: int) -> _Agreement | None:
        """The agreement for one search, or None when this process is alone."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        prefix = f"nblaunch/batch_size/{task_id}/{call_index}"
        return cls(store, prefix, dist.get_rank(), dist.get_world_size())

    def outcome(self, attempt: int, out_of_memory: bool, on_wait: Callable[[], None]) -> list[int]:
        """Record this rank's outcome; wait for all; return the ranks that ran out of memory."""
        base = f"{self.prefix}/{attempt}"
        if out_of_memory:  # flags first: once all have arrived, every flag is in place
            self.store.set(f"{base}/oom/{self.rank}", "1")
            self.store.add(f"{base}/oom", 1)
        arrived = self.store.add(f"{base}/arrived", 1)
        started = time.monotonic()
        delay = 0.001
        told = False
        while arrived < self.world_size:
            if out_of_memory and not told and time.monotonic() - started > WAIT_NOTICE_S:
                on_wait()
                told = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            arrived = self.store.add(f"{base}/arrived", 0)
        if self.store.add(f"{base}/oom", 0) == 0:
            return []
        return [r for r in range(self.world_size) if self.store.check([f"{base}/oom/{r}"])]
