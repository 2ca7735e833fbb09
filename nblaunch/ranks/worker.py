"""The code that runs inside a rank.

A rank process starts in :func:`main` (a module-level trampoline, so every start method can reach
it), points its stdout/stderr file descriptors at pipes the parent reads, starts watching the
process that launched it, receives a setup message (environment, ``sys.path``, rank, process
group) and then runs tasks until it is told to stop. A one-shot launch is one task; the
persistent pool sends many.

Other modules reach the parent through :func:`emit` and learn where they run through
:func:`current`; both are safe to call outside a launch (``current()`` is then ``None`` and
``emit`` does nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from nblaunch.events import RELEASE, SETUP, STOP, Event
from nblaunch.ranks import containment, devices, xla
from nblaunch.ranks.failure import failure_event

# After a rank hung up, how long its exit may wait for threads the user's code left running.
EXIT_AFTER_HANG_UP_S = 1.0


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
_channel: _Channel | None = None
_tree_marker: str | None = None  # see containment.TREE_ENV
# Modules imported in every rank at setup; each registers its task hooks (see add_task_hook).
RANK_FEATURES = (
    "nblaunch.ranks.logging",
    "nblaunch.ranks.trigger",
    "nblaunch.ranks.fingerprints",
    "nblaunch.ranks.debug_patches",
    "nblaunch.ranks.batch_size",
    "nblaunch.ranks.waits",
    "nblaunch.ranks.heartbeat",
    "nblaunch.ranks.debugger",
)
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


class _Channel:
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


def main(
    rank: int,
    conn: Connection,
    stdout_w: Connection,
    stderr_w: Connection,
    launcher_pid: int,
    semaphore_dir: str | None = None,
    tree_marker: str | None = None,
) -> None:
    """Entry point of a rank process (the trampoline every start method calls).

    Parameters
    ----------
    rank
        Global rank of this process.
    conn
        Duplex pipe to the parent: events go up, setup/task/stop messages come down.
    stdout_w, stderr_w
        Write ends of the pipes the parent reads this rank's output from.
    launcher_pid
        The process that launched the run (the notebook kernel); the rank exits when it dies,
        even though its parent process may be a forkserver.
    semaphore_dir
        Where this rank notes its multiprocessing semaphores, so that the supervisor can
        release those it leaves when it is killed (:mod:`nblaunch.ranks.semaphores`).
    tree_marker
        The run's value of ``containment.TREE_ENV``, inherited by whatever the rank starts.
    """
    global _channel, _tree_marker
    _tree_marker = tree_marker
    # Own process group: a terminal's Ctrl-C reaches only the launcher, which then stops every
    # rank in order, instead of each rank raising KeyboardInterrupt at a random point.
    with contextlib.suppress(OSError):
        os.setpgrp()
    # Whatever the rank starts stays in its tree, even a daemon's double fork, so that it can
    # be ended with the rank (nblaunch.ranks.containment).
    containment.become_subreaper()
    # The launcher sends SIGINT to interrupt a task: make it a KeyboardInterrupt here.
    signal.signal(signal.SIGINT, _on_sigint)
    _redirect_output(stdout_w, stderr_w)
    containment.watch_launcher(launcher_pid)
    from nblaunch.ranks import semaphores

    semaphores.track(semaphore_dir)
    _channel = _Channel(conn)
    stopped = False
    try:
        setup = _channel.recv()
        assert setup["kind"] == SETUP, setup
        if not _set_up(rank, setup):
            return
        while True:
            message = _channel.recv()
            if message["kind"] == STOP:
                stopped = True
                break
            if message["kind"] == RELEASE:  # peers wait in collectives a task left owed
                from nblaunch.ranks import release

                release.handle(message)
                continue
            _run_task(message)
    except (EOFError, OSError):
        pass  # the parent went away; nothing left to report to
    finally:
        _tear_down()
        # Before multiprocessing's exit handler, which would wait for non-daemon children.
        containment.end_descendants()
        _flush_output()
    if stopped:
        _hang_up(_channel)


def _hang_up(channel: _Channel) -> None:
    """Close every pipe to the parent: this rank has nothing more to say.

    The parent returns once a stopped rank's pipes are closed, without waiting for the process
    to exit, which costs a few milliseconds of unmapping torch's memory. Anything written after
    this (multiprocessing's exit handlers) goes to /dev/null. Python's exit waits for threads
    that are not daemons; one the user's code left running gets ``EXIT_AFTER_HANG_UP_S``, then
    the rank exits anyway: nothing of a run outlives it for long, whether or not the notebook
    launches again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    channel.close()
    timer = threading.Timer(EXIT_AFTER_HANG_UP_S, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _redirect_output(stdout_w: Connection, stderr_w: Connection) -> None:
    """Point fds 1 and 2 at the parent's pipes, so C-level output is captured too.

    Python's own streams are rebuilt line-buffered on the new fds: every finished line reaches
    the parent at once, and nothing sits in a buffer when the rank crashes.
    """
    for target, pipe in ((1, stdout_w), (2, stderr_w)):
        os.dup2(pipe.fileno(), target)
        pipe.close()
    sys.stdout = _line_buffered(1)
    sys.stderr = _line_buffered(2)


def _line_buffered(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )


def _set_up(rank: int, setup: dict[str, Any]) -> bool:
    """Apply the parent's environment, pick the device, join the process group.

    Returns False (after reporting a Failure) when the rank cannot take part.
    """
    global _context
    # The forkserver started earlier: bring this rank up to the caller's present state.
    os.environ.clear()
    os.environ.update(setup["env"])
    if _tree_marker:
        os.environ[containment.TREE_ENV] = _tree_marker
    sys.path[:] = setup["sys_path"]
    with contextlib.suppress(OSError):
        os.chdir(setup["cwd"])
    if setup.get("mp_start_method"):
        import multiprocessing

        multiprocessing.set_start_method(setup["mp_start_method"], force=True)
    try:
        devices.import_device_modules()  # accelerator plug-ins, before torch picks a device
        import torch

        if setup.get("num_threads"):
            torch.set_num_threads(setup["num_threads"])
        device, badge = _pick_device(setup["device_type"], int(os.environ["LOCAL_RANK"]))
        _context = RankContext(
            rank=rank,
            local_rank=int(os.environ["LOCAL_RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
            device=device,
            backend=setup["backend"],
            debug=bool(setup.get("debug")),
            launcher_pid=setup["launcher_pid"],
            options=dict(setup.get("options") or {}),
        )
        import_features()
        if setup["init_process_group"]:
            from nblaunch.ranks import default_group

            # Also takes over init_process_group, so code that makes its own group works.
            store = default_group.rendezvous_store(rank, _context.world_size)
            init_method = setup.get("init_method")
            if init_method == "xla://":
                xla.use_launcher_store()
            default_group.set_up(
                store, rank, _context.world_size, device, setup["backend"], init_method
            )
    except BaseException as exc:
        emit(failure_event(rank, exc))
        emit({"kind": "finished", "rank": rank})
        return False
    emit(
        {
            "kind": "started",
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": badge,
        }
    )
    return True


def import_features(names: tuple[str, ...] = RANK_FEATURES) -> None:
    """Import the feature modules that exist, so they can register their hooks.

    A module that is missing is skipped; one that exists but fails to import raises.
    """
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the feature exists but something it needs is missing
                raise


def _pick_device(device_type: str, local_rank: int) -> tuple[Any, str]:
    """This rank's device, pinned, and what the view's badge says of it."""
    import torch

    if device_type == "cpu":
        return torch.device("cpu"), "cpu"
    if device_type == "xla":
        return xla.set_up()
    device = devices.pin(device_type, local_rank)
    return device, str(device)


def _on_sigint(signum: int, frame: Any) -> None:
    """SIGINT interrupts the running task; between tasks it is ignored.

    Outside user code a KeyboardInterrupt could land in the middle of a message to the parent
    and break the pipe protocol, or end a pool rank that waits for its next task.
    """
    global _interrupt_waits
    if _in_task:
        if _deferring:
            _interrupt_waits = True
            return
        raise KeyboardInterrupt


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


def _run_task(message: dict[str, Any]) -> None:
    """Run one task and report its Result or Failure, then Finished."""
    global _in_task, _interrupt_waits
    import cloudpickle

    assert _context is not None
    rank = _context.rank
    _context.task_id = message.get("task_id", 0)
    try:
        with contextlib.ExitStack() as hooks:
            for hook in _task_hooks:
                hooks.enter_context(hook(_context))
            if message.get("all_ranks", True):  # only every rank at once can make a group
                from nblaunch.ranks import default_group

                # The previous task may have destroyed it; inside the hooks, so a rank that
                # waits here for a peer that never comes shows in its heartbeats.
                default_group.ensure_ready()
            function, args, kwargs = cloudpickle.loads(message["payload"])
            _interrupt_waits = False
            _in_task = True
            exited = False
            try:
                if _context.device.type == "xla":  # a v2/v3 chip: a thread on each core
                    value = xla.call_on_each_core(function, args, kwargs)
                else:
                    value = function(*args, **kwargs)
            except SystemExit as exit_:
                if exit_.code not in (None, 0):
                    raise  # a failure, reported below
                # `sys.exit(main())` at the end of a script: a normal end if every rank does it
                value, exited = None, True
            finally:
                _in_task = False
        try:
            value_bytes = cloudpickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the function returned a {type(value).__name__} that cannot be pickled back "
                f"to the notebook ({exc}); return plain data, tensors or a state_dict instead"
            ) from None
        outcome: Event = {
            "kind": "result",
            "rank": rank,
            "value_bytes": value_bytes,
            "called_exit": exited,
        }
    except BaseException as exc:  # KeyboardInterrupt and SystemExit are reported too
        outcome = failure_event(rank, exc)
    _flush_output()  # what the task printed, even a last line without "\n", comes first
    emit(outcome)
    emit({"kind": "finished", "rank": rank})


def _tear_down() -> None:
    from nblaunch.ranks import default_group

    default_group.tear_down()  # also when the user destroyed the group already; never raises


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
