"""A detached pool seen from the notebook: :class:`HostPool`, the client of its run host.

``start_pool(n, detach=True)`` (``%dist start -n N --detach``) starts a run host
(:mod:`nblaunch.host.pool`) that starts the pool and keeps it; this kernel is its client. After
a kernel restart, ``attach_pool()`` (``%dist attach``) connects a new kernel to the same ranks,
with the names earlier cells defined. Cells, ``%dist push/pull/status/restart/stop`` work as on a
pool of the kernel's own: every task still runs through the pool's engine, in the host, and its
events come back to this cell's view. The pool ends on ``%dist stop`` (``close()``), on
``nblaunch runs stop ID``, or after ``idle_limit`` seconds without a cell.

:class:`HostPool` is what a :class:`~nblaunch.notebook.pool.Pool` made with ``detach=True``
drives (its transport), as a kernel's own pool drives the engine in the kernel.

One kernel drives a detached pool at a time: attaching while another kernel is attached is
refused, naming it, unless ``take_over=True`` (``%dist attach --take-over``). The kernel that
lost the pool (taken over, stopped from a terminal, idle too long, its host killed) is told so
in words by its next use of it, and the pool is closed here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import sys
import time
from pathlib import Path
from typing import Any

from nblaunch import tracebacks
from nblaunch.engine.detached import host_files, wire
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.run_dirs import new_run_dir
from nblaunch.engine.pool.messages import (
    CLOSE,
    ENDED,
    HELLO,
    INFO,
    INTERRUPT,
    REFUSED,
    RESTART,
    STATUS,
    TAKEN,
    TASK,
    WAIT,
)
from nblaunch.engine.pool.pool_engine import START_TIMEOUT_S, checked_task_ranks
from nblaunch.engine.pool.task_end import TaskGuard
from nblaunch.errors import LaunchError
from nblaunch.events import EventSink, Lifecycle
from nblaunch.options import LaunchOptions

# A detached pool with no cell for this long ends, and its host with it.
DEFAULT_IDLE_LIMIT_S = 24 * 3600.0


class HostPool:
    """A detached pool's ranks, through the socket of their run host; see the module docstring.

    Parameters
    ----------
    num_processes, options, start_timeout
        As for a pool of the kernel's own (one machine only).
    idle_limit
        Seconds without a cell after which the pool ends (default 24 h).
    """

    detached = True
    engine = None  # the ranks' run is the host's
    nodes = None  # one machine only

    def __init__(
        self,
        num_processes: int | None,
        options: LaunchOptions,
        start_timeout: float = START_TIMEOUT_S,
        idle_limit: float = DEFAULT_IDLE_LIMIT_S,
    ) -> None:
        if not (isinstance(idle_limit, (int, float)) and idle_limit > 0):
            raise LaunchError(f"idle_limit={idle_limit!r}: give seconds, a positive number")
        self.num_processes = num_processes
        self.options = options
        self.start_timeout = start_timeout
        self.idle_limit = float(idle_limit)
        self.state = Lifecycle.CLOSED
        self.problem = ""
        self.start_s = 0.0
        self.restarts = 0
        self.tasks_run = 0
        self.current_task = ""
        self.last_failed_rank: int | None = None
        self.entry: detached.Entry | None = None
        self._sock: socket.socket | None = None
        self._info: dict[str, Any] = {}

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> HostPool:
        """Start the run host, which starts the ranks; returns once they all joined.

        Raises
        ------
        LaunchError
            The host did not start.
        Exception
            A rank's own exception when it failed to start.
        """
        began = time.monotonic()
        run_dir, lease = new_run_dir(self.options.run_dir)
        launch = {
            "kind": "pool",
            "pool": {
                "num_processes": self.num_processes,
                "options": self.options,  # the host makes its run directory the pool's
                "start_timeout": self.start_timeout,
                "idle_limit_s": self.idle_limit,
            },
        }
        try:
            entry = detached.start_host(run_dir, lease, launch)
        except LaunchError:
            failure = run_dir / host_files.RESULT_FILE  # the ranks' own error, when they failed
            if failure.exists():
                raise pickle.loads(failure.read_bytes())["error"] from None
            raise
        self._connect(entry)
        self.start_s = time.monotonic() - began
        return self

    @classmethod
    def attach(cls, run_id: str | None = None, take_over: bool = False) -> HostPool:
        """Connect to a detached pool of this machine (default: the newest still running);
        ``take_over``: also when another kernel drives it (that kernel is told)."""
        entry = detached.find(run_id, kind="pool")
        pool = cls(None, LaunchOptions())
        pool._connect(entry, take_over)
        return pool

    def _connect(self, entry: detached.Entry, take_over: bool = False) -> None:
        sock = None
        try:
            sock = wire.connect(entry.socket)
            wire.send(sock, HELLO, {"who": who_am_i(), "take_over": take_over})
            message = wire.receive(sock)
            if message is not None and message[0] == WAIT:
                print(
                    f"nblaunch pool: {message[1]['holder']} is running a cell on the pool; "
                    "taking it over when that cell ends",
                    flush=True,
                )
                message = wire.receive(sock)
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise LaunchError(f"cannot reach the pool's host (pid {entry.pid}): {exc}") from None
        if message is not None and message[0] == REFUSED:
            sock.close()
            raise LaunchError(
                f"the detached pool {entry.run_id} is driven by {message[1]['holder']}; one "
                f"kernel drives a pool at a time. %dist attach {entry.run_id} --take-over (or "
                "attach_pool(take_over=True)) takes it over; that kernel is told"
            )
        if message is None or message[0] != INFO:
            sock.close()
            raise LaunchError(f"the pool's host (pid {entry.pid}) did not answer")
        self.entry, self._sock = entry, sock
        self._take_info(message[1])

    def _take_info(self, info: dict[str, Any]) -> None:
        self._info = info
        self.started_at = info["started_at"]
        self.state = Lifecycle(info["state"])
        self.problem = info.get("problem", "")

    def close(self) -> None:
        """End the pool and its host; safe to call twice."""
        if self.state is Lifecycle.CLOSED or self._sock is None:
            return
        self._check_connection()
        with contextlib.suppress(OSError):
            wire.send(self._sock, CLOSE, None)
        self._disconnect()
        assert self.entry is not None
        deadline = time.monotonic() + 15.0
        while detached.host_alive(self.entry.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.state = Lifecycle.CLOSED

    def restart(self, num_nodes: int | None = None) -> HostPool:
        """Fresh ranks, in the same host."""
        if num_nodes is not None:
            raise LaunchError("num_nodes: a detached pool runs on this machine only")
        if self.state is not Lifecycle.CLOSED and self._sock is not None:
            self._check_connection()
            info = self._ask(RESTART, INFO)
            self._take_info(info)
            if info.get("error") is not None:
                raise info["error"]
        self.restarts += 1
        return self

    def detach(self) -> None:
        """Let go of the pool, which goes on; ``attach_pool()`` gets it back."""
        self._disconnect()
        self.state = Lifecycle.CLOSED  # closed here, not there

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __del__(self) -> None:  # the pool goes on without this kernel
        try:  # not contextlib: at interpreter exit module globals may be None already
            if self._sock is not None:
                self._sock.close()
        except Exception:
            pass

    # --- tasks -----------------------------------------------------------------------------------

    def task_ranks(self, ranks: list[int] | None) -> list[int]:
        """The ranks a task asked for, checked; raises ``LaunchError`` unless the pool can take
        a task now."""
        self._check_usable()
        return checked_task_ranks(ranks, self.world_size)

    def run_task(
        self,
        payload: bytes,
        task_ranks: list[int],
        view: EventSink,
        description: str,
        timeout: float | None,
        hang_timeout: float | None,
    ) -> list[Any]:
        """Run one task on the host's pool; its events show in ``view``. The interrupt button
        interrupts the task there (the names stay)."""
        request = {
            "payload": payload,
            "ranks": task_ranks,
            "description": description,
            "timeout": timeout,
            "hang_timeout": hang_timeout,
        }
        assert self._sock is not None
        guard = TaskGuard()  # an interrupt only counts: it is sent, never half-read
        previous = guard.install()
        try:
            try:
                wire.send(self._sock, TASK, request)
            except OSError:
                self._lost()
            outcome = self._follow(view, guard)
        finally:
            guard.uninstall(previous)
        self._take_info(outcome.pop("info", self._info))
        self.tasks_run += 1
        if "error" in outcome:
            raise tracebacks.make_readable(outcome["error"])  # the rank's frames, as a local pool's
        return outcome["values"]

    def _follow(self, view: Any, guard: TaskGuard) -> dict[str, Any]:
        """Show the task's events until its outcome comes."""
        assert self._sock is not None
        sent_interrupts = 0
        try:
            while True:
                if guard.interrupts > sent_interrupts:
                    sent_interrupts = guard.interrupts
                    with contextlib.suppress(OSError):  # a host gone is told below
                        wire.send(self._sock, INTERRUPT, None)
                if not select.select([self._sock], [], [], 0.05)[0]:
                    view.flush()
                    continue
                message = self._receive()
                if message is None or message[0] in (TAKEN, ENDED):
                    self._lost(message, during_cell=True)
                kind, body = message
                if kind == wire.EVENTS:
                    for event in body:
                        view.handle(event)
                    view.flush()
                elif kind == wire.OUTCOME:
                    return pickle.loads(body)
        finally:
            view.close()

    def _ask(self, kind: str, answer: str) -> Any:
        if self._sock is None:
            raise LaunchError("the detached pool is not attached here: %dist attach")
        self._check_connection()
        try:
            wire.send(self._sock, kind, None)
        except OSError:
            self._lost()
        while (message := self._receive()) is not None:
            if message[0] == answer:
                return message[1]
            if message[0] in (TAKEN, ENDED):
                break
        self._lost(message)

    def _receive(self) -> tuple[str, Any] | None:
        """The host's next message; None when it is gone (a reset socket too)."""
        assert self._sock is not None
        try:
            return wire.receive(self._sock)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _check_connection(self) -> None:
        """Say why the pool is no longer this kernel's, if the host said so meanwhile (another
        kernel took it, it was stopped) or went away; nothing when all is well."""
        if self._sock is not None and select.select([self._sock], [], [], 0)[0]:
            self._lost(self._receive())

    def _lost(self, message: tuple[str, Any] | None = None, during_cell: bool = False) -> Any:
        """This kernel no longer drives the pool: close it here and raise why, in words."""
        run_id = self.entry.run_id if self.entry else "?"
        if message is not None and message[0] == TAKEN:
            why = (
                f"{message[1]['by']} took over the detached pool {run_id} at "
                f"{message[1]['at']}; this kernel no longer drives it"
            )
        elif message is not None and message[0] == ENDED:
            why = message[1]["why"]
        else:
            why = self._gone_reason()
        self._disconnect()
        self.state = Lifecycle.CLOSED
        after = " during the cell" if during_cell else ""
        raise LaunchError(
            f"{why}{after}. %%distributed cells here launch fresh ranks again; "
            f"%dist attach {run_id} --take-over takes a pool back, %dist start starts one"
        )

    def _gone_reason(self) -> str:
        """Why the host closed the connection without a word (killed, or it ended)."""
        if self.entry is None:
            return "the pool's host went away"
        entry = detached.Entry.read(detached.registry_dir() / f"{self.entry.run_id}.json")
        pid, where = self.entry.pid, self.entry.run_dir / host_files.HOST_LOG
        if detached.host_alive(pid):
            return (
                f"the detached pool {self.entry.run_id}'s host (pid {pid}) closed this connection"
            )
        if entry is not None and entry.state != "running":
            return f"the detached pool {self.entry.run_id} ended ({entry.state}) elsewhere"
        return (
            f"the detached pool {self.entry.run_id}'s host (pid {pid}) ended without a word "
            f"(killed?): its ranks and their names are gone; see {where}"
        )

    def _check_usable(self) -> None:
        if self.state is Lifecycle.CLOSED or self._sock is None:
            raise LaunchError("the detached pool is not attached here: %dist attach")
        self._check_connection()
        if self.state is Lifecycle.BROKEN:
            raise LaunchError(
                f"the pool cannot run cells: {self.problem}. Run %dist restart for fresh ranks, "
                "or %dist stop."
            )

    # --- information -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return int(self._info.get("world_size", 0))

    @property
    def pids(self) -> list[int | None]:
        return list(self._info.get("pids", []))

    def describe(self) -> str:
        host = f"host pid {self.entry.pid}, " if self.entry else ""
        return f"detached ({host}id {self.entry.run_id if self.entry else '?'}): " + (
            self._info.get("describe", "not started")
        )

    def status(self) -> list[dict[str, Any]]:
        return self._ask(STATUS, STATUS)["rows"]

    def status_text(self) -> str:
        return self.describe() + "\n" + self._ask(STATUS, STATUS)["text"]


def who_am_i() -> str:
    """This kernel in words, as another kernel is told it: its id and pid (a script: its pid)."""
    # Only a kernel has ipykernel's app running; importing ipykernel elsewhere would install its
    # comms for every widget of the process (a script's, a test's).
    app = sys.modules.get("ipykernel.kernelapp")
    if app is not None and app.IPKernelApp.initialized():
        connection_file = app.IPKernelApp.instance().connection_file
        kernel_id = Path(connection_file).stem.removeprefix("kernel-")
        return f"kernel {kernel_id[:8]} (pid {os.getpid()})"
    return f"process {os.getpid()} ({Path(sys.argv[0]).name or 'python'})"
