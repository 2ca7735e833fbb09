"""Freeing a pool's ranks that wait in a collective their ended peers never issued.

A pool's task can end on some ranks (``q`` in the debugger, an exception, the interrupt
button) while others wait in a collective: no signal reaches a rank waiting in gloo or NCCL,
so the interrupt alone would leave them there and the pool would have to start fresh ranks,
their names gone. The out-of-band checks (:mod:`nblaunch.engine.monitors.collective_checks`) know
every call each rank issued on each group, so :class:`Releaser` asks the ranks that are back to
issue the calls they owe (:mod:`nblaunch.ranks.release`): the waiting ranks' calls complete, their
pending interrupt stops their task at its line, and every rank keeps its names. Where it
cannot (checks off, a point-to-point wait, an operation it cannot repeat, a peer on another
node), :attr:`Releaser.problem` says why, for the note of the pool's restart.
"""

from __future__ import annotations

from typing import Any

from nblaunch.engine.monitors.collective_checks import CollectiveChecks
from nblaunch.engine.run.run import Run
from nblaunch.events import RELEASE, Release
from nblaunch.ranks.release import RELEASE_TIMEOUT_S

# Before releasing, how long ranks interrupted outside a collective get to come back (they are
# then among the ranks that owe the call, not among those that wait in it).
SETTLE_S = 0.3
# Rounds of releases (a rank freed by one may owe another group's call); past them, the ranks
# kept issuing collectives, and the pool is restarted.
MAX_ROUNDS = 3
# After the releases, how long the freed ranks get to stop.
AFTER_RELEASE_S = 3.0


class Releaser:
    """The releases of one pool task (a monitor of the task: it hears ``released`` events).

    Parameters
    ----------
    task_id
        The task whose collectives are compared (the checks number calls per task).
    """

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.problem = ""  # why the waiting ranks could not be released
        self.done = ""  # what was released, for the cell's error
        self.in_flight: set[int] = set()
        self.sent_at = 0.0
        self.rounds = 0
        self.began: float | None = None
        self.wait_until = 0.0
        self._released: set[tuple[int, str, int]] = set()
        self.gave_up = False  # a release failed: the waiting ranks stay where they are

    # --- as a monitor ------------------------------------------------------------------------

    def on_event(self, run: Any, event: dict[str, Any]) -> None:
        if event["kind"] != "released" or event["rank"] not in self.in_flight:
            return
        self.in_flight.discard(event["rank"])
        if not event["ok"]:
            self.problem = f"rank {event['rank']} could not issue them: {event['problem']}"
            self.gave_up = True
        elif not self.in_flight:
            self.wait_until = run.now() + AFTER_RELEASE_S

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: Any) -> None:
        return None

    # --- while the task's ranks are brought back ---------------------------------------------

    def step(self, run: Run, pending: list[int]) -> float:
        """One turn of the pool's wait for ``pending`` ranks after it interrupted them: release
        what can be released. Returns until when the wait should go on (0: no longer)."""
        now = run.now()
        if self.began is None:
            self.began = now
        if self.gave_up:
            return 0.0
        if self.in_flight:
            limit = self.sent_at + RELEASE_TIMEOUT_S + 1.0
            if now > limit:
                ranks = ", ".join(map(str, sorted(self.in_flight)))
                self.problem = f"rank(s) {ranks} did not finish issuing them"
                self.gave_up = True
                return 0.0
            return limit
        if self.rounds >= MAX_ROUNDS:
            self.problem = self.problem or "they kept issuing collectives"
            return self.wait_until
        checks = next((m for m in run.monitors if isinstance(m, CollectiveChecks)), None)
        if checks is None or checks.reader is None:
            self.problem = (
                "the out-of-band checks are off (debug=True or NBLAUNCH_CHECKS=0), so nblaunch "
                "cannot tell which collective they wait in"
            )
            return 0.0
        checks.collect()
        idle = {r for r in run.task_ranks if r in run.outcome.finished}
        owed = checks.owed(self.task_id, idle, self._released)
        if owed.problem:
            self.problem = owed.problem
            return self.wait_until
        if not owed.calls:
            return self.wait_until
        if not set(pending) <= owed.waiting and now < self.began + SETTLE_S:
            return self.wait_until  # another pending rank may yet come back and owe too
        elsewhere = sorted(rank for rank in owed.calls if not run.runs_here(rank))
        if elsewhere:
            self.problem = f"rank {elsewhere[0]}, which owes them, is on another node"
            return self.wait_until
        for rank, calls in owed.calls.items():
            message: Release = {
                "kind": RELEASE,
                "calls": calls,  # type: ignore[typeddict-item]
                "timeout_s": RELEASE_TIMEOUT_S,
            }
            run.send_to_rank(rank, message)  # type: ignore[arg-type]
        self.in_flight = set(owed.calls)
        self.sent_at = now
        self.rounds += 1
        self._released.update(owed.keys)
        self.done = _describe(owed.calls, owed.waiting)
        return self.sent_at + RELEASE_TIMEOUT_S + 1.0

    def why(self, pending: list[int]) -> str:
        """Why ``pending`` ranks (still running at the end) could not be released."""
        if self.problem:
            return self.problem
        ranks = ", ".join(map(str, pending))
        return (
            f"no collective call the checks recorded holds rank(s) {ranks}: a point-to-point "
            "send or recv, or a wait outside torch.distributed, cannot be released"
        )


def _describe(calls: dict[int, list[dict[str, Any]]], waiting: set[int]) -> str:
    """``rank 0 issued torch.distributed.all_reduce (cell line 4), which rank 1 waited in; ...``"""
    parts = []
    for rank, owed in sorted(calls.items()):
        ops = ", ".join(
            dict.fromkeys(f"{c['record']['op']} ({c['record'].get('site', '?')})" for c in owed)
        )
        parts.append(f"rank {rank} issued {ops}")
    many = len(waiting) > 1
    ranks = ("ranks " if many else "rank ") + ", ".join(map(str, sorted(waiting)))
    return (
        f"{'; '.join(parts)}, which {ranks} waited in; {ranks} {'were' if many else 'was'} "
        f"stopped there, {'their' if many else 'its'} names kept (the values that call left "
        "in its tensors are meaningless)"
    )
