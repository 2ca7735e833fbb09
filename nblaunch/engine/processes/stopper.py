"""Stopping ranks: SIGINT, then SIGTERM, then SIGKILL, with what they write read meanwhile.

A :class:`Stopper` names no run, as torch elastic's ``PContext.close`` never names its agent: it
is given this machine's ranks (a :class:`~nblaunch.engine.processes.backend.RankBackend`), the
run's clock, and a way to go on reading the ranks' output while they stop. The run decides when
and how politely; the stopper only escalates.
"""

from __future__ import annotations

from collections.abc import Callable

from nblaunch.engine.processes.backend import RankBackend

# After a root cause, how long the other ranks get to stop before SIGKILL.
STOP_GRACE_S = 2.0
# How long the other ranks get to stop once a root cause (a failure, a death, a hang) is known.
KNOWN_CAUSE_GRACE_S = 0.5
# After SIGINT (the notebook's interrupt), how long the ranks get to end their task themselves.
INTERRUPT_GRACE_S = 1.5


class Stopper:
    """Stops the ranks of ``backend``, escalating.

    Parameters
    ----------
    backend
        This machine's ranks.
    now
        The run's clock (monotonic seconds).
    read
        Reads the ranks' output for up to the given seconds, so that their last words are kept
        while they stop.
    """

    def __init__(
        self, backend: RankBackend, now: Callable[[], float], read: Callable[[float], object]
    ) -> None:
        self.backend = backend
        self.now = now
        self.read = read

    def interrupt(self, done: Callable[[], bool], limit_s: float = INTERRUPT_GRACE_S) -> None:
        """SIGINT every rank (a ``KeyboardInterrupt`` in its task), then read their output until
        ``done()`` or ``limit_s``; a second interrupt meanwhile goes straight on."""
        try:
            self.backend.interrupt()
            deadline = self.now() + limit_s
            while self.backend.alive() and self.now() < deadline:
                self.read(0.05)
                self.backend.reap()
                if done():
                    break
        except KeyboardInterrupt:
            pass  # the caller stops the ranks next

    def hang_up(self, hung_up: Callable[[int], bool], limit_s: float) -> None:
        """Read output until every live rank closed its pipes (``hung_up(rank)``: its last
        words) or exited, at most ``limit_s``; those still exiting are left to exit alone."""
        deadline = self.now() + limit_s
        while self.now() < deadline:
            self.backend.reap()
            if all(hung_up(rank.rank) for rank in self.backend.alive()):
                break
            self.read(0.01)
        self.backend.let_go([r for r in self.backend.alive() if hung_up(r.rank)])

    def stop(self, grace: float, quiet: bool = False) -> None:
        """SIGTERM every live rank, SIGKILL after ``grace`` s (``quiet``: being killed is no
        news, the cause is known)."""
        self.backend.stop(grace=grace, quiet=quiet)
