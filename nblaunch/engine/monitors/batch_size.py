"""Restarting every rank at a smaller batch size when a peer's out-of-memory left them blocked.

The notebook's side of :func:`nblaunch.ranks.memory.batch_size.find_executable_batch_size`.
"""

from __future__ import annotations

from typing import Any

from nblaunch.engine.monitors.protocol import RunContext
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import DistributedHangError, NoExecutableBatchSizeError
from nblaunch.events import RunState
from nblaunch.ranks.memory.batch_size import (
    RESTART_OPTION,
    no_size_message,
    render_attempts,
    who_ran_out,
)

# Restarts of one launch, at most (a custom reduce function could otherwise shrink very slowly).
MAX_RESTARTS = 16
# A peer counts as blocked after this many heartbeats in a collective since then
# (heartbeats carry a position sampled within the last 50 ms, and the notice comes 0.5 s after
# the out-of-memory, so the first one is already past any collective that could complete)...
STUCK_HEARTBEATS = 1
# ...or, when ranks send no heartbeats at all, after this many seconds without reaching agreement.
STUCK_WITHOUT_HEARTBEAT_S = 5.0


class BatchSizeMonitor:
    """Restarts every rank at the smaller size when a peer's out-of-memory left them blocked.

    A rank that ran out of memory waits for its peers' outcome; a peer blocked in a collective
    of the same attempt waits for that rank; neither can move. The monitor sees the first
    rank's "waiting" progress and the others' heartbeats (inside a collective), or no word
    from them for a while, and asks the launcher for a restart (a root cause ``Cause.RESTART``
    whose ``options`` go into every rank's setup).
    """

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.world_size = plan.world_size
        self._waiting: dict[int, dict[str, Any]] = {}
        self._in_collective: dict[int, int] = {}
        self._where: dict[int, str] = {}
        self._heard: dict[int, float] = {}

    def on_event(self, run: RunContext, event: dict[str, Any]) -> None:
        kind = event["kind"]
        rank = event.get("rank")
        if kind == "progress" and event.get("what") == "batch_size":
            data = event.get("data") or {}
            self._show_retrying(run, rank, data)
            if data.get("status") == "waiting":
                self._waiting[rank] = {**data, "since": run.now()}
                self._in_collective.clear()
            elif data.get("status") in ("oom", "ok", "agreed"):  # an agreement completed
                self._waiting = {
                    r: w
                    for r, w in self._waiting.items()
                    if w["key"] != data.get("key") or w["attempt"] > data.get("attempt", 0)
                }
        elif kind == "heartbeat" and self._waiting and rank not in self._waiting:
            self._heard[rank] = run.now()
            if event.get("collective"):
                self._in_collective[rank] = self._in_collective.get(rank, 0) + 1
                self._where[rank] = f"{event['collective']} ({event.get('where', '')})"
            else:
                self._in_collective[rank] = 0

    @staticmethod
    def _show_retrying(run: RunContext, rank: int, data: dict[str, Any]) -> None:
        """Badges: RETRYING while a search tries another size, RUNNING once it is done."""
        state = RunState.RUNNING if data.get("done") else RunState.RETRYING
        for each in data.get("ranks", [rank]):  # one rank speaks for all after agreeing
            if run.states.get(each) in (RunState.RUNNING, RunState.RETRYING):
                run.set_state(each, state)

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: RunContext) -> RootCause | None:
        if not self._waiting or run.outcome.failures:
            return None  # a rank's own failure is the root cause; the launcher reports it
        outside = [r for r in range(self.world_size) if r not in run.task_ranks]
        returned = [r for r in run.outcome.results if r not in self._waiting]
        if outside or returned:  # ranks that will never take part in the agreement
            return self._never_agree(outside, returned)
        since = min(w["since"] for w in self._waiting.values())
        others = [
            r
            for r in range(self.world_size)
            if r not in self._waiting and r not in run.outcome.finished
        ]
        if not others:
            return None  # everyone is in the agreement, or gone (the launcher handles that)
        now = run.now()
        for rank in others:
            if self._in_collective.get(rank, 0) >= STUCK_HEARTBEATS:
                continue
            silent = self._heard.get(rank, 0.0) < since
            if silent and now - since > STUCK_WITHOUT_HEARTBEAT_S:
                continue
            return None  # this peer may still be working towards the agreement
        return self._restart(others)

    def _never_agree(self, outside: list[int], returned: list[int]) -> RootCause:
        rank = min(self._waiting)
        if outside:
            why = (
                f"rank(s) {', '.join(map(str, outside))}, which do not run this task: ranks "
                "agree on each attempt, so run it on every rank of the process group"
            )
        else:
            why = (
                f"rank(s) {', '.join(map(str, returned))}, which returned without calling it: "
                "every rank must call the decorated function the same number of times"
            )
        message = f"find_executable_batch_size on rank {rank} waits for {why}"
        self._waiting.clear()
        return RootCause(
            Cause.BATCH_SIZE,
            rank,
            message,
            exception=DistributedHangError(message),
            title="find_executable_batch_size not called on every rank",
        )

    def _restart(self, blocked: list[int]) -> RootCause:
        notice = min(self._waiting.values(), key=lambda w: w["attempt"])
        oom_ranks = sorted(self._waiting)
        history = [
            *notice["history"],
            {"batch_size": notice["batch_size"], "oom": oom_ranks, "restarted": True},
        ]
        next_size = notice["next_batch_size"]
        blocked_words = ", ".join(
            f"rank {r} in {self._where[r]}" if r in self._where else f"rank {r}" for r in blocked
        )
        rank = oom_ranks[0]
        restarts = sum(1 for entry in history if entry.get("restarted"))
        if next_size is None or next_size < 1 or restarts > MAX_RESTARTS:
            message = (
                no_size_message(history)
                if restarts <= MAX_RESTARTS
                else f"gave up after {MAX_RESTARTS} restarts: {render_attempts(history, 2)}"
            )
            exc: BaseException = NoExecutableBatchSizeError(message)
            if restarts > MAX_RESTARTS:
                exc = DistributedHangError(message)
            return RootCause(
                Cause.BATCH_SIZE,
                rank,
                message,
                exception=exc,
                title=f"rank {rank}: out of memory at every batch size",
            )
        cause = (
            f"{who_ran_out(oom_ranks, self.world_size)}: out of memory at batch_size="
            f"{notice['batch_size']} while {blocked_words} waited for it"
        )
        message = f"{cause}; restarting all {self.world_size} ranks at batch_size={next_size}"
        self._waiting.clear()
        self._in_collective.clear()
        return RootCause(
            Cause.RESTART,
            rank,
            message,
            # For a caller that cannot restart ranks (a persistent pool): what to raise instead.
            exception=DistributedHangError(
                f"{cause}. The ranks cannot be restarted here: run again with "
                f"starting_batch_size={next_size}"
            ),
            title=f"rank {rank}: out of memory while its peers waited in a collective",
            options={
                RESTART_OPTION: {notice["key"]: {"batch_size": next_size, "history": history}}
            },
            progress={
                "kind": "progress",
                "rank": rank,
                "what": "batch_size",
                "text": f"{render_attempts(history, self.world_size)} -> {next_size} ...",
                "data": {
                    "status": "restart",
                    "key": notice["key"],
                    "attempt": len(history),
                    "batch_size": notice["batch_size"],
                    "next_batch_size": next_size,
                    "oom_ranks": oom_ranks,
                    "blocked_ranks": blocked,
                    "history": history,
                    "ranks": list(range(self.world_size)),
                    "message": message,
                    "done": False,
                },
            },
        )
