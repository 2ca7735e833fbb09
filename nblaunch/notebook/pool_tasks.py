"""What a pool's front end needs beside the pool: rank lists as people write them, what a task
is called in ``%dist status``, a task on a thread (``--bg``), the values ``%dist push`` sent."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any

from nblaunch import pickling
from nblaunch.engine.background.background_run import BackgroundTask
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.pool.pool_engine import PoolEngine
from nblaunch.errors import LaunchError
from nblaunch.ranks import namespace


def parse_ranks(spec: Any, world_size: int) -> list[int]:
    """Turn ``0``, ``"0,2"``, ``"1-3"`` or ``[0, 2]`` into a sorted list of ranks.

    Raises
    ------
    LaunchError
        A rank outside ``0 .. world_size-1`` or text that is not a rank list.
    """
    if isinstance(spec, bool):
        raise LaunchError(f"ranks must be rank numbers, got {spec!r}")
    if isinstance(spec, int):
        chosen = {spec}
    elif isinstance(spec, str):
        chosen = set()
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part.strip("-"):
                    low, high = part.split("-", 1)
                    chosen.update(range(int(low), int(high) + 1))
                else:
                    chosen.add(int(part))
            except ValueError:
                raise LaunchError(f"--ranks {spec!r}: write ranks like 0, 0,2 or 1-3") from None
    else:
        try:
            chosen = {int(r) for r in spec}
        except (TypeError, ValueError):
            raise LaunchError(f"ranks must be rank numbers, got {spec!r}") from None
    bad = sorted(r for r in chosen if not 0 <= r < world_size)
    if not chosen or bad:
        raise LaunchError(
            f"ranks {spec!r}: the pool has ranks 0-{world_size - 1}"
            + (f"; {', '.join(map(str, bad))} do not exist" if bad else "")
        )
    return sorted(chosen)


def describe_cell(source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return "cell: " + (first if len(first) <= 60 else first[:57] + "...")


def describe_function(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def task_in_background(
    pool: PoolEngine,
    payload: bytes,
    task_ranks: list[int],
    display: str,
    description: str,
    timeout: float | None,
    hang_timeout: float | None,
) -> Any:
    """A pool's task on a thread (``run_payload(background=True)``); returns its handle."""
    from nblaunch.notebook.handle import RunHandle, remember

    run = pool.engine
    hub = EventHub()
    pool.reserve(description)  # from now: no other cell slips in before the thread starts
    # The header now, while the cell runs: the view is built in it.
    hub.handle(run.plan.run_info(time.time(), warnings=[], notes=[]))
    task = BackgroundTask(
        hub,
        f"{run.plan.run_id}-task{pool.task_id + 1}",
        run.plan.run_dir,
        lambda: pool.run_task(payload, task_ranks, hub, description, timeout, hang_timeout),
        run.request_stop,
    )
    handle = RunHandle(task)
    if display != "none":
        handle.view(display)
    pool.background = task
    task.start()
    return remember(handle)


def spread_by_rank(chosen: list[int] | None, world_size: int) -> Callable[[list[Any]], list[Any]]:
    """What turns the values of the ``chosen`` ranks (None: all) into one per rank of the pool,
    ``None`` where the task did not run."""

    def by_rank(values: list[Any]) -> list[Any]:
        spread: list[Any] = [None] * world_size
        for rank, value in zip(chosen or range(world_size), values, strict=True):
            spread[rank] = value
        return spread

    return by_rank


def push_payload(name: str, value: Any) -> bytes:
    """The task that binds ``name`` to ``value`` on a rank.

    Raises
    ------
    LaunchError
        The value cannot be pickled (nothing was sent).
    """
    try:
        return pickling.dumps((namespace.push_value, (name, value), {}))
    except Exception as exc:
        raise LaunchError(
            f"{name} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
            f"sent to the ranks: {type(exc).__name__}: {exc}. Make it on the ranks, in a "
            "%%distributed cell, instead."
        ) from None


class PushedNames:
    """The notebook values every rank holds since ``%dist push``, and which ranks got them."""

    def __init__(self) -> None:
        # name -> (a weak reference to the object, when the ranks that got it were started)
        self._pushed: dict[str, tuple[Any, float]] = {}

    def remember(self, name: str, value: Any, started_at: float) -> None:
        with contextlib.suppress(TypeError):  # a value without weak references is small
            self._pushed[name] = (weakref.ref(value), started_at)

    def forget(self, name: str) -> None:
        self._pushed.pop(name, None)

    def pinned(self, user_ns: dict[str, Any], started_at: float) -> set[str]:
        """The names whose value is still the one pushed to the ranks started at
        ``started_at`` (fresh ranks hold nothing)."""
        return {
            name
            for name, (pushed, when) in self._pushed.items()
            if name in user_ns and pushed() is user_ns[name] and when == started_at
        }
