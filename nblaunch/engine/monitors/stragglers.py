"""Stragglers: the rank that makes the others wait in collectives, named in an info diagnosis.

The ranks' heartbeats (:mod:`nblaunch.ranks.heartbeat`) carry how long each rank has waited
inside collectives and how long its task has run. A rank that waits much less than the others
computes while they wait for it: :class:`StragglerWatch` names it, live and when a task ends.
"""

from __future__ import annotations

from collections.abc import Mapping

from nblaunch.engine.monitors.protocol import RunContext
from nblaunch.events import Heartbeat, diagnosis

# Straggler: the others wait at least this share of the time more than the slowest rank, and
# every rank has run at least this long.
STRAGGLER_MIN_EXCESS = 0.2
STRAGGLER_MIN_BUSY_S = 2.0
STRAGGLER_CHECK_S = 2.0


class StragglerWatch:
    """Names the straggler in the view: live once per rank, and again when a task ends.

    :class:`nblaunch.engine.monitors.hang.HangMonitor` drives it and gives it the ranks' heartbeats.
    """

    def __init__(self) -> None:
        self.straggler: tuple[int, float] | None = None  # the last found: (rank, excess)
        self._checked = 0.0
        self._published: int | None = None

    def due(self, now: float) -> bool:
        """Whether to look again (every ``STRAGGLER_CHECK_S`` of the run's clock); if so, the
        look counts from ``now``."""
        if now - self._checked < STRAGGLER_CHECK_S:
            return False
        self._checked = now
        return True

    def publish(self, run: RunContext, beats: Mapping[int, Heartbeat], *, final: bool) -> None:
        """Show the straggler among ``beats`` (rank -> last heartbeat), if there is one.

        ``final``: the task ended, so the straggler is reported even if it was already.
        """
        found = find_straggler({r: (b["wait_s"], b["busy_s"]) for r, b in beats.items()})
        self.straggler = found
        if found is None:
            return
        rank, excess = found
        if not final and rank == self._published:
            return
        self._published = rank
        verb = "was" if final else "is"
        title = f"rank {rank} {verb} the slowest: the others wait {excess:.0%} of the time for it"
        shares = "\n".join(
            f"  rank {r}: waiting in collectives {b['wait_s']:.1f} s of "
            f"{b['busy_s']:.1f} s ({_share(b['wait_s'], b['busy_s']):.0%})"
            for r, b in sorted(beats.items())
        )
        body = (
            f"{shares}\nRank {rank} computes while the others wait for it in collectives: "
            "a slower device, more data on that rank, or work only that rank does."
        )
        run.publish(diagnosis(title, body, "info", rank))


def find_straggler(stats: dict[int, tuple[float, float]]) -> tuple[int, float] | None:
    """The rank the others wait for, and how much more of their time they wait than it does.

    Parameters
    ----------
    stats
        Rank -> (seconds waiting inside collectives, seconds of the task so far).

    Returns
    -------
    tuple or None
        ``(rank, excess)`` where ``excess`` is the others' mean waiting share minus the
        slowest rank's; ``None`` with fewer than two ranks, too little time, or no clear
        straggler.
    """
    if len(stats) < 2 or any(busy < STRAGGLER_MIN_BUSY_S for _, busy in stats.values()):
        return None
    shares = {rank: _share(wait, busy) for rank, (wait, busy) in stats.items()}
    slowest = min(shares, key=shares.get)  # type: ignore[arg-type]
    others = [share for rank, share in shares.items() if rank != slowest]
    excess = sum(others) / len(others) - shares[slowest]
    if excess < STRAGGLER_MIN_EXCESS:
        return None
    return slowest, excess


def _share(wait: float, busy: float) -> float:
    return min(1.0, wait / busy) if busy > 0 else 0.0
