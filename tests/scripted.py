"""A scripted rank backend and clock: the engine's decisions played back without processes.

:class:`ScriptedRanks` is a :class:`nblaunch.engine.processes.backend.RankBackend` whose ranks are
real pipes (the relay reads them exactly as it reads a process's) and a script instead of a process.
A test gives a *behaviour*: for each message the engine sends a rank (``setup``, ``task``,
``stop``, ``debug_input``, and ``sigint`` for an interrupt), the steps that rank takes, each
``(seconds later, action)``, or ``None`` for what a rank does by default
(:func:`default_behaviour`). An action is an event the rank sends (a dict), :class:`Print` (a
line on its stdout) or :class:`Exit` (the process ends). Steps become due on the
:class:`ScriptedClock`, which jumps ahead by every wait instead of sleeping, so a scripted
"hang" of five minutes is judged in milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nblaunch.engine.clock import Clock
from nblaunch.engine.processes.supervisor import RankProcess
from nblaunch.ranks.failure import failure_event


class ScriptedClock(Clock):
    """Monotonic time that jumps ahead by each wait instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def wait_s(self, timeout: float) -> float:
        self.t += timeout
        return 0.0


@dataclass
class Print:
    """The rank writes ``text`` and a newline on its stdout (or stderr with ``fd=2``)."""

    text: str
    fd: int = 1


@dataclass
class Exit:
    """The rank's process ends with ``code`` (negative: killed by that signal)."""

    code: int = 0


@dataclass
class Interrupt:
    """The notebook's interrupt arrives (KeyboardInterrupt where the engine waits)."""


Step = tuple[float, Any]
Behaviour = Callable[[int, dict[str, Any]], list[Step] | None]


@dataclass
class _StandIn:
    """What the engine sees of a rank's process: its pid and whether it is alive."""

    pid: int
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


def started(rank: int) -> dict[str, Any]:
    return {
        "kind": "started",
        "rank": rank,
        "pid": 90000 + rank,
        "host": "scripted",
        "device": "cpu",
    }


def returns(rank: int, value: Any) -> list[dict[str, Any]]:
    """The events of a task that returned ``value``."""
    result = {
        "kind": "result",
        "rank": rank,
        "value_bytes": cloudpickle.dumps(value),
        "called_exit": False,
    }
    return [result, {"kind": "finished", "rank": rank}]


def raises(rank: int, exc: BaseException) -> list[dict[str, Any]]:
    """The events of a task that raised ``exc`` (with a real traceback, as a rank sends it)."""
    try:
        raise exc
    except BaseException as raised:
        failure = failure_event(rank, raised)
    return [failure, {"kind": "finished", "rank": rank}]


def heartbeat(
    rank: int,
    *,
    collective: str | None = None,
    seq: int | None = None,
    still: float = 0.0,
    where: str = "train.py:10 in train",
) -> dict[str, Any]:
    """A heartbeat: where the rank is, the collective it waits in, how many collectives it has
    issued (``seq``; None for a backend that does not count), how long it has been still."""
    return {
        "kind": "heartbeat",
        "rank": rank,
        "where": where,
        "collective": collective,
        "wait_s": 0.0,
        "busy_s": 1.0,
        "last_output": 0.0,
        "stack": f"stack of rank {rank}",
        "seq": seq,
        "still_s": still,
    }


def default_behaviour(rank: int, message: dict[str, Any]) -> list[Step]:
    """Ranks that start, hang up when stopped, and stop their task at an interrupt."""
    kind = message["kind"]
    if kind == "setup":
        return [(0.0, started(rank))]
    if kind == "stop":
        return [(0.0, Exit(0))]
    if kind == "sigint":
        return [(0.0, event) for event in raises(rank, KeyboardInterrupt())]
    return []


@dataclass
class ScriptedRanks:
    """A rank backend of pipes and a script (see the module docstring)."""

    world_size: int
    behaviour: Behaviour
    clock: ScriptedClock
    ranks: list[RankProcess] = field(default_factory=list)
    sent: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (rank, message)
    interrupted: list[int] = field(default_factory=list)
    stopped: bool = False
    stop_time: float | None = None  # the clock when the engine stopped the ranks
    _due: list[tuple[float, int, int, Any]] = field(default_factory=list)
    _order: Any = field(default_factory=itertools.count)
    _ends: dict[int, tuple[Any, int, int]] = field(default_factory=dict)  # rank's own ends

    # --- RankBackend -----------------------------------------------------------------------------

    def start(
        self,
        rank_ids: list[int] | None = None,
        setup: Callable[[int], dict[str, Any]] | None = None,
        wait_for_previous: bool = True,
    ) -> None:
        for rank in rank_ids if rank_ids is not None else range(self.world_size):
            conn, child = multiprocessing.Pipe(duplex=True)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            process = RankProcess(
                rank,
                _StandIn(90000 + rank),
                conn,
                multiprocessing.connection.Connection(out_r, writable=False),
                multiprocessing.connection.Connection(err_r, writable=False),
            )
            self.ranks.append(process)
            self._ends[rank] = (child, out_w, err_w)
            if setup is not None:
                self.send(process, setup(rank))

    def send(self, rank: RankProcess, message: dict[str, Any]) -> bool:
        if not rank.process.alive:
            return False
        self.sent.append((rank.rank, message))
        self._schedule(rank.rank, self._react(rank.rank, message))
        return True

    def reap(self) -> list[RankProcess]:
        self._deliver()
        ended = []
        for rank in self.ranks:
            if not rank.ended and not rank.process.alive:
                rank.ended = True
                ended.append(rank)
        return ended

    def alive(self) -> list[RankProcess]:
        self._deliver()
        return [r for r in self.ranks if not r.ended and r.process.alive]

    def interrupt(self, ranks: list[int] | None = None) -> None:
        for rank in self.alive():
            if ranks is None or rank.rank in ranks:
                self.interrupted.append(rank.rank)
                self._schedule(rank.rank, self._react(rank.rank, {"kind": "sigint"}))

    def let_go(self, ranks: list[RankProcess]) -> None:
        for rank in ranks:
            rank.ended = True

    def stop(self, grace: float = 2.0, *, quiet: bool = False) -> list[int]:
        self.stopped = True
        self.stop_time = self.clock.now()
        killed = [rank.rank for rank in self.alive()]
        for rank in killed:
            self._exit(rank, -15)
        self.reap()
        return killed

    def close(self) -> None:
        for rank in self.ranks:
            for end in (rank.conn, rank.stdout_r, rank.stderr_r):
                end.close()
        for rank in list(self._ends):
            self._close_ends(rank)

    def setup_options(self, rank: int) -> dict[str, Any]:
        """The ``options`` of the setup message ``rank`` got."""
        return next(m["options"] for r, m in self.sent if r == rank and m["kind"] == "setup")

    # --- the script ------------------------------------------------------------------------------

    def _react(self, rank: int, message: dict[str, Any]) -> list[Step]:
        steps = self.behaviour(rank, message)
        return default_behaviour(rank, message) if steps is None else steps

    def _schedule(self, rank: int, steps: list[Step]) -> None:
        for delay, action in steps:
            heapq.heappush(self._due, (self.clock.now() + delay, next(self._order), rank, action))

    def _deliver(self) -> None:
        while self._due and self._due[0][0] <= self.clock.now():
            _, _, rank, action = heapq.heappop(self._due)
            self._act(rank, action)

    def _act(self, rank: int, action: Any) -> None:
        if rank not in self._ends:  # the process ended: what it would still do never happens
            return
        child, out_w, err_w = self._ends[rank]
        if isinstance(action, Exit):
            self._exit(rank, action.code)
        elif isinstance(action, Print):
            os.write(out_w if action.fd == 1 else err_w, (action.text + "\n").encode())
        elif isinstance(action, Interrupt):
            raise KeyboardInterrupt
        else:
            child.send(action)

    def _exit(self, rank: int, code: int) -> None:
        process = next(p for p in self.ranks if p.rank == rank)
        process.process.alive = False
        process.exitcode = code
        self._close_ends(rank)

    def _close_ends(self, rank: int) -> None:
        child, out_w, err_w = self._ends.pop(rank)
        child.close()
        os.close(out_w)
        os.close(err_w)


class Script:
    """Makes the backends of one run (a restart makes another) and keeps them for asserts."""

    def __init__(self, behaviour: Behaviour, clock: ScriptedClock | None = None) -> None:
        self.behaviour = behaviour
        self.clock = clock or ScriptedClock()
        self.backends: list[ScriptedRanks] = []

    def __call__(self, world_size: int, start_method: str) -> ScriptedRanks:
        backend = ScriptedRanks(world_size, self.behaviour, self.clock)
        self.backends.append(backend)
        return backend
