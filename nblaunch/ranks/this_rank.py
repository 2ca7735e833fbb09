"""What a running rank knows of itself, and how its features reach the parent.

The worker (:mod:`nblaunch.ranks.worker`) sets this module up when the setup message arrives;
every other module of the rank reads it: :func:`current` says where this process sits in the
launch, :func:`emit` sends an event up the pipe, :func:`add_task_hook` runs a feature around every
task, :func:`interrupts_deferred` keeps an interrupt out of a compound collective. All are safe to
call outside a launch (``current()`` is then ``None`` and ``emit`` does nothing). This module
imports nothing of the rank's features, so any of them can import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from nblaunch.events import STOP, Event


@dataclasses.dataclass
class RankContext:
    """Where this process sits in the launch; set once the setup message arrived."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: Any  # torch.device
    backend: str
    debug: bool
    launcher_pid: int
    options: dict[str, Any]  # free-form settings for in-rank features (log level, heartbeat)
    task_id: int = 0  # the task running now; the same on every rank that runs it


_context: RankContext | None = None
_in_task = False  # user code of a task is running: SIGINT raises KeyboardInterrupt
_deferring = 0  # inside interrupts_deferred() (nested): SIGINT waits for the block's end
_interrupt_waits = False  # an interrupt came inside interrupts_deferred()
_task_arrived = False  # a task came and is being set up (hooks, its group, unpickling)
_interrupted_early = False  # an interrupt came then: the task's code starts by raising it
_channel: Channel | None = None
# Hooks other modules register to run around each task (debug patches, heartbeats, logging).
_task_hooks: list[Callable[[RankContext], contextlib.AbstractContextManager[Any]]] = []


def current() -> RankContext | None:
    """The rank context when called inside an nblaunch rank, else ``None``."""
    return _context


def emit(event: Event) -> None:
    """Send one event to the parent; does nothing outside an nblaunch rank or after it hung up."""
    if _channel is not None:
        _channel.send(event)


def receive() -> dict[str, Any]:
    """Wait for the parent's next message during a task (the debugger's answers).

    Only the task's own thread may call this: between tasks the rank's loop reads the pipe.
    """
    assert _channel is not None, "receive() is for nblaunch ranks"
    try:
        return _channel.recv()
    except (EOFError, OSError):
        return {"kind": STOP}


def add_task_hook(hook: Callable[[RankContext], contextlib.AbstractContextManager[Any]]) -> None:
    """Run ``hook(context)`` as a context manager around every task on this rank.

    Features that live inside ranks (heartbeats, debug-mode patches, log capture) register here
    at import time; the hook list is per process, so it costs nothing in the parent.
    """
    if hook not in _task_hooks:
        _task_hooks.append(hook)


class Channel:
    """The rank's end of its duplex pipe: events up, tasks down. Sends are thread-safe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, event: Event | dict[str, Any]) -> None:
        with self._lock:
            if not self.conn.closed:
                self.conn.send(event)

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def recv(self) -> dict[str, Any]:
        return self.conn.recv()


def set_context(context: RankContext) -> None:
    """The worker's: where this rank sits, once its setup message arrived."""
    global _context
    _context = context


def connect(channel: Channel) -> None:
    """The worker's: events go up ``channel`` from now on."""
    global _channel
    _channel = channel


def task_hooks() -> list[Callable[[RankContext], contextlib.AbstractContextManager[Any]]]:
    """The hooks to enter around a task, in the order they were added."""
    return list(_task_hooks)


@contextlib.contextmanager
def task_arrived() -> Iterator[None]:
    """A task came and is set up inside: an interrupt meanwhile (the launcher stops a task's
    ranks as soon as one fails, which may be before this rank reached its code) is raised
    when the task's code starts, not lost."""
    global _task_arrived, _interrupted_early
    _interrupted_early = False
    _task_arrived = True
    try:
        yield
    finally:
        _task_arrived = _interrupted_early = False


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """The task's own code runs inside: an interrupt raises ``KeyboardInterrupt`` there."""
    global _in_task, _interrupt_waits, _interrupted_early
    _interrupt_waits = False
    _in_task = True
    try:
        if _interrupted_early:
            _interrupted_early = False
            raise KeyboardInterrupt
        yield
    finally:
        _in_task = False


def on_sigint(signum: int, frame: Any) -> None:
    """SIGINT interrupts the running task (one still being set up as its code starts); between
    tasks it is ignored.

    Outside user code a KeyboardInterrupt could land in the middle of a message to the parent
    and break the pipe protocol, or end a pool rank that waits for its next task.
    """
    global _interrupt_waits, _interrupted_early
    if _in_task:
        if _deferring:
            _interrupt_waits = True
            return
        raise KeyboardInterrupt
    if _task_arrived:
        _interrupted_early = True


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Inside this block an interrupt waits for its end, then raises ``KeyboardInterrupt``.

    For a collective made of several torch calls (``broadcast_object_list`` sends sizes, then
    data): stopped between them, the rank would leave its peers, and a pool's release of them
    (:mod:`nblaunch.ranks.release`), with a call no rank ever matches.
    """
    global _deferring, _interrupt_waits
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _interrupt_waits and _in_task:
        _interrupt_waits = False
        raise KeyboardInterrupt


# --- inside a rank: public accessors --------------------------------------------------------------


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def rank() -> int:
    """Global rank of this process (0 outside a launch; honours torchrun's ``RANK``)."""
    return _context.rank if _context else _env_int("RANK", 0)


def local_rank() -> int:
    """Rank of this process on its node (``LOCAL_RANK``)."""
    return _context.local_rank if _context else _env_int("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of ranks in the run (1 outside a launch)."""
    return _context.world_size if _context else _env_int("WORLD_SIZE", 1)


def device() -> Any:
    """The ``torch.device`` of this rank: the accelerator device of its ``LOCAL_RANK``
    (``cuda:1``, ``xpu:1``, ``xla:0`` on its TPU chip), else CPU."""
    import torch

    if _context:
        return _context.device
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is not None:
        return torch.device(current.type, local_rank())
    return torch.device("cpu")


def is_main_process() -> bool:
    """True on global rank 0."""
    return rank() == 0


def wait_for_everyone() -> None:
    """Block until every rank reaches this point (a barrier; a no-op without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
