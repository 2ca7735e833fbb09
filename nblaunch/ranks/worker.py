"""The code that runs inside a rank.

A rank process starts in :func:`main` (a module-level trampoline, so every start method can reach
it), points its stdout/stderr file descriptors at pipes the parent reads, starts watching the
process that launched it, receives a setup message (environment, ``sys.path``, rank, process
group) and then runs tasks until it is told to stop. A one-shot launch is one task; the
persistent pool sends many.

What the rank knows of itself, and how other modules reach the parent, is
:mod:`nblaunch.ranks.this_rank`: the worker sets it up and runs the task loop.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from nblaunch.events import RELEASE, SETUP, STOP, Event
from nblaunch.ranks import containment, stacks, this_rank
from nblaunch.ranks.device import devices, warm_up, xla
from nblaunch.ranks.failure import failure_event
from nblaunch.ranks.this_rank import Channel, emit

# After a rank hung up, how long its exit may wait for threads the user's code left running.
EXIT_AFTER_HANG_UP_S = 1.0
_channel: Channel | None = None
_tree_marker: str | None = None  # see containment.TREE_ENV
# Modules imported in every rank at setup; each registers its task hooks (see add_task_hook).
RANK_FEATURES = (
    "nblaunch.ranks.logging",
    "nblaunch.ranks.trigger",
    "nblaunch.ranks.checks.fingerprints",
    "nblaunch.ranks.checks.debug_patches",
    "nblaunch.ranks.checks.recorder",  # after fingerprints: its hook runs inside the outbox's
    "nblaunch.ranks.memory.batch_size",
    "nblaunch.ranks.memory.caught_oom",
    "nblaunch.ranks.checks.waits",
    "nblaunch.ranks.heartbeat",
    "nblaunch.ranks.debugger",
)


def main(
    rank: int,
    conn: Connection,
    stdout_w: Connection,
    stderr_w: Connection,
    launcher_pid: int,
    semaphore_dir: str | None = None,
    tree_marker: str | None = None,
    warm: dict[str, Any] | None = None,
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
    warm
        For a spare rank forked after a launch on an accelerator: the device it would get and
        the notebook's device environment then; it makes its context there while it waits
        (:mod:`nblaunch.ranks.device.warm_up`).
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
    signal.signal(signal.SIGINT, this_rank.on_sigint)
    _redirect_output(stdout_w, stderr_w)
    containment.watch_launcher(launcher_pid)
    from nblaunch.ranks import semaphores

    semaphores.track(semaphore_dir)
    _channel = Channel(conn)
    this_rank.connect(_channel)
    if warm is not None:
        try:
            warm_up.start(warm)  # in a thread: the pipe is read meanwhile
        except Exception:  # only lost time: the set-up makes the context as it would
            warm_up.forget()
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
        if not stopped:
            _tear_down()
        # Before multiprocessing's exit handler, which would wait for non-daemon children.
        containment.end_descendants()
        _flush_output()
    if stopped:
        # The values are in the notebook already, which need not wait for the process group's
        # teardown (NCCL's destroy_process_group takes ~0.5 s on a GPU): hang up, then tear
        # down, within the exit timer's second.
        _hang_up(_channel)
        _tear_down()


def _hang_up(channel: Channel) -> None:
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
    # A spare's device context first: nothing may change the environment while it is made.
    warm_up.wait()
    try:
        warm_up.check(setup)
    except RuntimeError as exc:
        emit(failure_event(rank, exc))
        emit({"kind": "finished", "rank": rank})
        return False
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
        context = this_rank.RankContext(
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
        this_rank.set_context(context)
        import_features()
        if setup["init_process_group"]:
            from nblaunch.ranks import default_group

            # Also takes over init_process_group, so code that makes its own group works.
            store = default_group.rendezvous_store(rank, context.world_size)
            init_method = setup.get("init_method")
            if init_method == "xla://":
                xla.use_launcher_store()
            default_group.set_up(
                store, rank, context.world_size, device, setup["backend"], init_method
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


def _run_task(message: dict[str, Any]) -> None:
    """Run one task and report its Result or Failure, then Finished."""
    import cloudpickle

    context = this_rank.current()
    assert context is not None
    rank = context.rank
    context.task_id = message.get("task_id", 0)
    try:
        with this_rank.task_arrived(), contextlib.ExitStack() as hooks:
            for hook in this_rank.task_hooks():
                hooks.enter_context(hook(context))
            if message.get("all_ranks", True):  # only every rank at once can make a group
                from nblaunch.ranks import default_group

                # The previous task may have destroyed it; inside the hooks, so a rank that
                # waits here for a peer that never comes shows in its heartbeats.
                default_group.ensure_ready()
            function, args, kwargs = cloudpickle.loads(message["payload"])
            exited = False
            try:
                with this_rank.user_code():
                    if context.device.type == "xla":  # a v2/v3 chip: a thread on each core
                        value = xla.call_on_each_core(function, args, kwargs)
                    else:
                        value = function(*args, **kwargs)
            except SystemExit as exit_:
                if exit_.code not in (None, 0):
                    raise  # a failure, reported below
                # `sys.exit(main())` at the end of a script: a normal end if every rank does it
                value, exited = None, True
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


stacks.task_entries.add(_run_task.__code__)  # the user's frames start below it


def _tear_down() -> None:
    from nblaunch.ranks import default_group

    default_group.tear_down()  # also when the user destroyed the group already; never raises
