"""The ranks a run drives, behind one small protocol: real processes, or a scripted stand-in.

:class:`~nblaunch.engine.run.run.Run` never starts a process itself. It takes a *rank backend*
(:class:`RankBackend`) made from its plan, and only starts, messages, reaps, interrupts and stops
ranks through it; the relay reads each rank's pipes (``RankProcess.conn``, ``stdout_r``,
``stderr_r``). :class:`ProcessBackend` is the real one: the supervisor's processes, adopting the
spare ranks forked ahead of a notebook's next launch. The tests' scripted backend plays back
event sequences through real pipes without a process, so the engine's decisions (root cause,
hang, restart, a pool's next task) are tested in milliseconds; a background or detached run is
the same engine on another thread or in another process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from nblaunch.engine.processes import spares
from nblaunch.engine.processes.supervisor import RankProcess, Supervisor


class RankBackend(Protocol):
    """This machine's ranks of a run, as the engine sees them."""

    ranks: list[RankProcess]  # started so far, in start order; the relay reads their pipes

    def start(
        self,
        rank_ids: list[int] | None = None,
        setup: Callable[[int], dict[str, Any]] | None = None,
        wait_for_previous: bool = True,
    ) -> None:
        """Start the ranks (default: every rank of the run); send each ``setup(rank)`` at once."""
        ...

    def send(self, rank: RankProcess, message: dict[str, Any]) -> bool:
        """Send a message down a rank's pipe; False when the rank has gone."""
        ...

    def reap(self) -> list[RankProcess]:
        """The ranks whose process ended since the last call (``exitcode`` set)."""
        ...

    def alive(self) -> list[RankProcess]: ...

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """A KeyboardInterrupt in the task of each of ``ranks`` (default: every live rank)."""
        ...

    def let_go(self, ranks: list[RankProcess]) -> None:
        """Stop watching ranks that hung up and are exiting on their own."""
        ...

    def stop(self, grace: float = 2.0, *, quiet: bool = False) -> list[int]:
        """Stop every live rank (politely, then SIGKILL after ``grace``); the ranks killed."""
        ...

    def close(self) -> None:
        """Close every pipe and release what the ranks left."""
        ...


# What a run is given: it makes a backend for its plan's world size and start method, and
# another one when every rank is started again (a batch-size restart).
BackendFactory = Callable[[int, str], RankBackend]


class ProcessBackend(Supervisor):
    """Rank processes on this machine (:class:`~nblaunch.engine.processes.supervisor.Supervisor`).

    Starting every rank of a run adopts the spare ranks forked while the notebook was idle
    (:mod:`nblaunch.engine.processes.spares`) when they fit, instead of forking in the cell.
    """

    def start(
        self,
        rank_ids: list[int] | None = None,
        setup: Callable[[int], dict[str, Any]] | None = None,
        wait_for_previous: bool = True,
    ) -> None:
        if rank_ids is None and setup is not None:
            # Rank 0's set-up says which device and device environment the ranks are to have:
            # spares that warmed up for others are let go. Made once: it is also rank 0's.
            first = setup(0)
            taken = spares.take(
                self.start_method,
                list(range(self.world_size)),
                first["device_type"],
                first["env"],
            )
            setup = _first_made(setup, first)
            if taken is not None:
                self.adopt(taken.ranks, taken.tree_marker, setup, wait_for_previous)
                return
        super().start(rank_ids, setup, wait_for_previous)


def _first_made(
    setup: Callable[[int], dict[str, Any]], first: dict[str, Any]
) -> Callable[[int], dict[str, Any]]:
    """``setup`` with rank 0's message, already made, given again rather than made twice."""
    return lambda rank: first if rank == 0 else setup(rank)
