"""A detached pool's host: the pool's ranks and their names, kept across kernels.

The host runs the pool's own engine headless (:class:`~nblaunch.engine.pool.pool_engine.PoolEngine`:
nothing of the notebook package, nor of IPython, is imported) and takes requests from one
notebook at a time on its socket (:mod:`nblaunch.engine.detached.wire`): ``("task", {...})`` runs a
task and streams its events back, then ``("outcome", bytes)``; ``("interrupt", None)`` interrupts
the running task as the interrupt button would; ``("status", None)``, ``("restart", None)`` and
``("close", None)``. A notebook that attaches later (a new kernel) replaces the one before and is
sent ``("info", {...})``. The pool ends on ``close``, on SIGTERM (``nblaunch runs stop``) or when
it was idle for its idle limit.

One notebook drives the pool at a time. A notebook says who it is first (``("hello", {"who":
..., "take_over": bool})``). While another one is attached, it is refused (``("refused",
{"holder": ...})``) unless it asks to take over: then the one before is told who took the pool
(``("taken", {"by": ...})``) and let go, after its running cell, if any, ended (the newcomer is
told it waits: ``("wait", {...})``). When the pool ends for another reason than its notebook's
``close`` (SIGTERM, the idle limit), the notebook is told why (``("ended", {"why": ...})``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import queue
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblaunch import tracebacks
from nblaunch.engine.detached import host_files, pool_holder, wire
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.run_dirs import RunLease
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
from nblaunch.engine.pool.pool_engine import PoolEngine
from nblaunch.events import Event, Lifecycle
from nblaunch.host.outcome import pickled, write_private

# How long a notebook that connected may take to say who it is.
_HELLO_S = 10.0
# How often the host looks at its idle limit (and at SIGTERM).
_TICK_S = 0.5


def serve_pool(run_dir: Path, launch: dict[str, Any], lease: RunLease) -> int:
    """Start the pool ``launch`` describes and serve it until it ends."""
    spec = launch["pool"]
    # The pool leases its directory itself as it plans (one lease per directory per process).
    lease.release()
    options = dataclasses.replace(spec["options"], run_dir=run_dir)
    pool = PoolEngine(spec["num_processes"], options, start_timeout=spec["start_timeout"])
    run_id = launch.get("run_id", run_dir.name)  # unique in the registry (detached.claim_id)
    entry = detached.Entry(
        run_id=run_id,
        run_dir=run_dir,
        pid=os.getpid(),
        socket=detached.socket_path(run_dir),
        kind="pool",
        started_at=time.time(),
        world_size=0,
        state=Lifecycle.RUNNING,
        origin=launch.get("origin", ""),
    )
    try:
        pool.start()
    except BaseException as exc:  # the notebook raises it (start_pool)
        write_private(run_dir / host_files.RESULT_FILE, pickled({"error": exc}, 1))
        print(f"pool host {os.getpid()}: the pool did not start: {exc!r}", flush=True)
        return 0
    server = PoolServer(entry.socket, pool, spec["idle_limit_s"])
    server.on_holder = lambda pid: pool_holder.write_holder(run_dir, pid)  # the runs panel shows it
    entry.world_size = pool.world_size
    entry.write()
    _write_ranks(run_dir, pool)
    print(f"pool host {os.getpid()} serving {entry.run_id} on {server.path}", flush=True)
    try:
        why = server.serve()
        if why == "stopped":
            server.tell_ended(
                f"the detached pool {entry.run_id} was stopped from outside at "
                f"{time.strftime('%H:%M:%S')} (SIGTERM to its host pid {os.getpid()}, e.g. "
                f"nblaunch runs stop {entry.run_id})"
            )
        elif why == "idle":
            server.tell_ended(
                f"the detached pool {entry.run_id} ended at {time.strftime('%H:%M:%S')}: no cell "
                f"for {server.idle_limit_s:g} s (its idle limit)"
            )
    finally:
        pool.close()
        server.close()
    entry.state = Lifecycle.STOPPED if why in ("stopped", "idle") else Lifecycle.DONE
    entry.write()
    print(f"pool host {os.getpid()}: the pool ended ({why})", flush=True)
    return 0


def _write_ranks(run_dir: Path, pool: PoolEngine) -> None:
    """Say which processes the pool's ranks are, on what, for the runs panel (best effort)."""
    if pool.engine is None:
        return
    plan = pool.engine.plan
    # a rank's device as its "started" event names it: cpu, or <type>:<local rank>
    per_node = getattr(plan, "nproc_per_node", None) or plan.world_size  # a multi-node plan's
    kind = plan.device_type
    devices = [kind if kind == "cpu" else f"{kind}:{r % per_node}" for r in range(len(pool.pids))]
    with contextlib.suppress(OSError):
        data = json.dumps({"pids": pool.pids, "devices": devices}).encode()
        write_private(run_dir / host_files.POOL_FILE, data)


def pool_info(pool: PoolEngine) -> dict[str, Any]:
    """What a notebook needs to show and check the pool without asking again."""
    return {
        "world_size": pool.world_size,
        "pids": pool.pids,
        "describe": pool.describe(),
        "state": pool.state.value,
        "problem": pool.problem,
        "start_s": pool.start_s,
        "started_at": pool.started_at,
        "run_dir": str(pool.engine.plan.run_dir) if pool.engine is not None else "",
    }


class TaskFeed:
    """The events of one task, sent to the notebook that asked for it in batches (a view)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.gone = False
        self._batch: list[Event] = []

    def handle(self, event: Event) -> None:
        self._batch.append(event)

    def flush(self, force: bool = False) -> None:
        if not self._batch or self.gone:
            self._batch.clear()
            return
        batch, self._batch = self._batch, []
        try:
            wire.send(self.sock, wire.EVENTS, batch)
        except OSError:
            self.gone = True  # the notebook went away; the task goes on, its logs have it all

    def close(self) -> None:
        self.flush()


class PoolServer:
    """Serves ``pool`` on ``path`` until it is closed, stopped or idle too long."""

    def __init__(self, path: str, pool: PoolEngine, idle_limit_s: float) -> None:
        self.pool = pool
        self.idle_limit_s = idle_limit_s
        self.client: socket.socket | None = None
        self.client_who = ""  # the attached notebook, in words
        self.client_alive = False  # False once its connection closed (a killed kernel)
        self.last_active = time.monotonic()
        self.stopping = False
        self._messages: queue.Queue[tuple[str, Any, socket.socket]] = queue.Queue()
        self._task_running = False
        # Told the pid of each notebook that attaches (SO_PEERCRED), and None when it goes.
        self.on_holder: Callable[[int | None], None] = lambda pid: None
        self.path = path
        self.sock = wire.listen(path, 4)

    def serve(self) -> str:
        """Answer requests until the pool should end; returns why (``closed``, ``stopped``,
        ``idle``)."""
        threading.Thread(target=self._accept, name="nblaunch-pool-accept", daemon=True).start()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        while True:
            try:
                kind, body, sock = self._messages.get(timeout=_TICK_S)
            except queue.Empty:
                if self.stopping:
                    return "stopped"
                if time.monotonic() - self.last_active > self.idle_limit_s:
                    return "idle"
                continue
            if kind == "connect":
                self._take_over(sock, body)
            elif kind == "gone":
                if sock is self.client:
                    self.client = None
                    with contextlib.suppress(OSError):  # a read-only run directory
                        self.on_holder(None)
            elif sock is self.client and self._answer(kind, body, sock):
                return "closed"
            del kind, body, sock  # a task's payload is not kept while the pool idles

    def tell_ended(self, why: str) -> None:
        """Tell the attached notebook why the pool ends (not its own ``close``)."""
        if self.client is not None:
            with contextlib.suppress(OSError):
                wire.send(self.client, ENDED, {"why": why})

    def close(self) -> None:
        self.sock.close()
        if self.client is not None:
            self.client.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # --- requests --------------------------------------------------------------------------------

    def _answer(self, kind: str, body: Any, sock: socket.socket) -> bool:
        """Answer one request; True when the pool is to close."""
        self.last_active = time.monotonic()
        if kind == TASK:
            self._run_task(body, sock)
        elif kind == STATUS:
            wire.send(sock, STATUS, {"rows": self.pool.status(), "text": self.pool.status_text()})
        elif kind == RESTART:
            error = None
            try:
                self.pool.restart()
            except Exception as exc:
                error = exc
            _write_ranks(Path(self.pool.options.run_dir), self.pool)
            wire.send(sock, INFO, {**pool_info(self.pool), "error": error})
        elif kind == CLOSE:
            return True
        self.last_active = time.monotonic()
        return False

    def _run_task(self, request: dict[str, Any], sock: socket.socket) -> None:
        import cloudpickle

        feed = TaskFeed(sock)
        self._task_running = True
        try:
            values = self.pool.run_payload(
                request["payload"],
                ranks=request["ranks"],
                description=request["description"],
                view=feed,
                timeout=request["timeout"],
                hang_timeout=request["hang_timeout"],
            )
            outcome: dict[str, Any] = {"values": values}
        except BaseException as exc:  # the task's outcome, the notebook raises it
            outcome = {"error": tracebacks.portable(exc)}  # with the rank's frames
        finally:
            self._task_running = False
        outcome["info"] = pool_info(self.pool)
        try:
            blob = cloudpickle.dumps(outcome)
        except Exception as exc:
            blob = cloudpickle.dumps(
                {"error": TypeError(f"the task's outcome could not be pickled: {exc}")}
            )
        if not feed.gone:
            with contextlib.suppress(OSError):
                wire.send(sock, wire.OUTCOME, blob)

    # --- threads ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """Read who connected; refuse at once while another notebook drives the pool, unless
        it takes over (told to wait while that notebook's cell runs)."""
        try:
            sock.settimeout(_HELLO_S)
            message = wire.receive(sock)
            sock.settimeout(None)
            if message is None or message[0] != HELLO:
                raise ValueError("no hello")
            hello = message[1]
            holder = self.client_who if self.client is not None else ""
            alive = self._holder_alive()
            if holder and alive and not hello.get("take_over"):
                wire.send(sock, REFUSED, {"holder": holder})
                sock.close()
                return
            if holder and self._task_running:  # the task ends first, its notebook gone or not
                gone = "" if alive else ", which went away,"
                wire.send(sock, WAIT, {"holder": f"{holder}{gone}"})
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            sock.close()
            return
        self._messages.put(("connect", hello, sock))

    def _take_over(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        """A notebook attached: the first, one whose notebook went away (a restarted kernel's),
        or one taking the pool over from the notebook before (who is told)."""
        who = str(hello.get("who", "another process"))
        if self.client is not None:
            if self._holder_alive() and not hello.get("take_over"):  # two at once: the first won
                with contextlib.suppress(OSError):
                    wire.send(sock, REFUSED, {"holder": self.client_who})
                sock.close()
                return
            with contextlib.suppress(OSError):
                wire.send(
                    self.client,
                    TAKEN,
                    {"by": who, "at": time.strftime("%H:%M:%S")},
                )
                self.client.shutdown(socket.SHUT_RDWR)
            self.client.close()
        self.client, self.client_who, self.client_alive = sock, who, True
        self.last_active = time.monotonic()
        with contextlib.suppress(OSError):
            self.on_holder(pool_holder.peer_pid(sock))
        try:
            wire.send(sock, INFO, pool_info(self.pool))
        except OSError:
            self.client = None
            return
        threading.Thread(target=self._read, args=(sock,), daemon=True).start()

    def _holder_alive(self) -> bool:
        """Whether the notebook that holds the pool is still connected: also False for a killed
        kernel whose hang-up its reading thread has not seen yet (a newcomer right after it
        must not be refused for it)."""
        client = self.client
        if client is None or not self.client_alive:
            return False
        hung_up = select.poll()  # POLLRDHUP: its end closed, even with a message unread
        try:
            hung_up.register(client, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        except (OSError, ValueError):  # closed here already
            return False
        return not hung_up.poll(0)

    def _read(self, sock: socket.socket) -> None:
        try:
            while (message := wire.receive(sock)) is not None:
                kind, body = message
                if kind == INTERRUPT:
                    if self._task_running and self.pool.engine is not None:
                        self.pool.engine.request_stop()
                else:
                    self._messages.put((kind, body, sock))
                del message, body  # not held while waiting for the next one
        except (OSError, EOFError, ValueError):
            pass
        if sock is self.client:
            self.client_alive = False  # a newcomer need not be refused for it
        self._messages.put(("gone", None, sock))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self._task_running and self.pool.engine is not None:
            self.pool.engine.request_stop()
