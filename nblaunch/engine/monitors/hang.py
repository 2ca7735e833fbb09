"""The hang watchdog in the notebook: stops runs that can never finish, names stragglers.

:class:`HangMonitor` reads the heartbeats the ranks send (:mod:`nblaunch.ranks.heartbeat`) and
stops a run that can never finish, with a :class:`~nblaunch.errors.DistributedHangError` that
names the rank and line:

* a rank returned while another waits in a collective it never called (ranks left a loop at
  different steps): reported about a second after the rank returned;
* ranks wait on one another in calls none of them can complete (collectives of different
  groups, receives from each other, a receive from a rank that returned): proven from their
  waits (:mod:`nblaunch.engine.monitors.deadlock`) about a second after the last one began waiting,
  whatever ``hang_timeout`` is;
* nothing moved on any rank for ``hang_timeout`` seconds while ranks wait (collectives or
  point-to-point):
  every rank's position and stack, and the rank outside any collective that the others wait
  for, if there is one.

Ranks that wait for a while are marked ``STALLED`` in the view first, and a rank that makes
the others wait (a straggler) is named in an info ``Diagnosis``, live and at the end
(:mod:`nblaunch.engine.monitors.stragglers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nblaunch import tracebacks
from nblaunch.engine.monitors import deadlock
from nblaunch.engine.monitors.beats import Beat
from nblaunch.engine.monitors.protocol import RunContext
from nblaunch.engine.monitors.source_lines import cell_names
from nblaunch.engine.monitors.stragglers import StragglerWatch
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import DistributedHangError, RankFailedError
from nblaunch.events import RunState
from nblaunch.ranks.checks import process_groups

# Parent side: a rank returned while another waits in a collective. With sequence numbers the
# hang is certain and is reported this long after the return; without, the waiting rank must
# have been still this long after it.
FINISHED_GRACE_S = 1.0
FINISHED_GRACE_UNSURE_S = 2.0
# A proven hang of collectives only, on a rank that returned, is left this long to the report
# made for that case (_returned_while_waiting), then reported as proven.
DEFER_TO_RETURNED_S = FINISHED_GRACE_UNSURE_S + 1.0
# Mark a rank STALLED after it waited this long in one collective (or hang_timeout / 2).
STALL_AFTER_S = 5.0
# A rank without a heartbeat for this long is reported as silent.
SILENT_AFTER_S = 5.0

if TYPE_CHECKING:
    from nblaunch.engine.plan.launch_plan import LaunchPlan


class HangMonitor:
    """Stops runs whose ranks wait in collectives that can never complete; names stragglers.

    A ``Monitor`` for :class:`nblaunch.engine.run.run.Run`: ``on_event`` sees every rank event,
    ``check`` is called about 20 times a second and returns a root cause to stop the run.

    Parameters
    ----------
    plan
        The launch plan: world size, ``hang_timeout`` (``None``: only the certain case, a rank
        that returned while others wait, is reported) and debug mode.
    """

    def __init__(self, plan: LaunchPlan) -> None:
        self.world_size = plan.world_size
        self.hang_timeout = plan.hang_timeout
        self.beats: dict[int, Beat] = {}
        self.returned: dict[int, float] = {}  # rank -> when its Result arrived
        self.final_seq: dict[int, int | None] = {}
        self.final_beat: dict[int, Beat | None] = {}  # each returned rank's last heartbeat
        self.exited: set[int] = set()  # returned ranks whose task ended with sys.exit(0)
        self.stalled: set[int] = set()
        self.stragglers = StragglerWatch()
        self._done = False
        self._new_beats = False  # a heartbeat or result since the last proof attempt
        stall = STALL_AFTER_S
        if self.hang_timeout is not None:
            stall = min(stall, self.hang_timeout / 2)
        self.stall_after = stall

    # --- events ----------------------------------------------------------------------------------

    def on_event(self, run: RunContext, event: dict[str, Any]) -> None:
        kind = event["kind"]
        self._new_beats = self._new_beats or kind in ("heartbeat", "result")
        if kind == "heartbeat":
            self.beats[event["rank"]] = Beat(event, run.now())  # type: ignore[arg-type]
        elif kind == "result":
            rank = event["rank"]
            self.returned[rank] = run.now()
            if event.get("called_exit"):
                self.exited.add(rank)
            beat = self.beats.get(rank)
            self.final_seq[rank] = beat.event["seq"] if beat else None
            self.final_beat[rank] = beat
            self._unstall(run, rank)
            if all(r in self.returned for r in self.beats):  # every rank of the task returned
                self._publish_straggler(run, final=True)

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: RunContext) -> RootCause | None:
        if self._done:
            return None
        now = run.now()
        self._mark_stalls(run, now)
        # A stalled rank is the stronger signal; a straggler report would only distract.
        if not self.stalled and self.stragglers.due(now):
            self._publish_straggler(run, final=False)
        root = (
            self._returned_while_waiting(run, now)
            or self._proven(run, now)
            or self._no_progress(run, now)
        )
        if root is not None:
            self._done = True
        return root

    # --- the pieces ------------------------------------------------------------------------------

    def _running(self, run: RunContext) -> list[int]:
        """Ranks running a task: they sent heartbeats and have not finished. A rank without
        heartbeats takes no part (a persistent pool may run a cell on some ranks only)."""
        finished = run.outcome.finished
        return sorted(r for r in self.beats if r not in self.returned and r not in finished)

    def _still_since(self, run: RunContext, rank: int, now: float) -> float | None:
        """Parent time since which ``rank`` has not moved, or None when it never reported."""
        beat = self.beats.get(rank)
        if beat is None:
            return None
        since = beat.received - beat.event["still_s"]
        ago = run.seconds_since_output(rank)
        if ago is not None:  # any output (C-level too) counts as progress
            since = max(since, now - max(0.0, ago))
        return since

    def _known_still(self, run: RunContext, rank: int, now: float) -> float | None:
        """How long ``rank`` is known to have been still: up to its last heartbeat, or up to
        now when its heartbeats stopped (a task thread holding the GIL, a stopped process)."""
        since = self._still_since(run, rank, now)
        if since is None:
            return None
        beat = self.beats[rank]
        until = now if now - beat.received >= SILENT_AFTER_S else beat.received
        return until - since

    def _mark_stalls(self, run: RunContext, now: float) -> None:
        for rank in self._running(run):
            beat = self.beats.get(rank)
            since = self._still_since(run, rank, now)
            waiting = beat is not None and beat.in_collective and since is not None
            if waiting and now - since >= self.stall_after:
                self._stall(run, rank, beat)
            elif rank in self.stalled:
                self._unstall(run, rank)

    def _stall(self, run: RunContext, rank: int, beat: Beat) -> None:
        if rank in self.stalled or run.states.get(rank) != RunState.RUNNING:
            return
        self.stalled.add(rank)
        detail = cell_names(f"waiting in {beat.event['collective']} at {beat.event['where']}")
        run.set_state(rank, RunState.STALLED, detail)

    def _unstall(self, run: RunContext, rank: int) -> None:
        if rank in self.stalled:
            self.stalled.discard(rank)
            if run.states.get(rank) == RunState.STALLED:
                run.set_state(rank, RunState.RUNNING)

    def _returned_while_waiting(self, run: RunContext, now: float) -> RootCause | None:
        """A rank returned; another waits in a collective the returned rank never called."""
        if not self.returned:
            return None
        last_return = max(self.returned.values())
        waiting: list[int] = []
        for rank in self._running(run):
            beat = self.beats.get(rank)
            if beat is None or not beat.in_collective or beat.received <= last_return:
                continue
            if (beat.event.get("p2p_wait") or {}).get("peer", -1) >= 0:
                continue  # point-to-point with a known peer: proven from its posts (_proven)
            group, seq = beat.waiting_for()
            finals = [self._final_issued(r, group) for r in self.returned]
            if seq is not None and all(s is not None for s in finals):
                # Sequence numbers tell for sure: the returned ranks never issued this one.
                # gloo's recorder may never mark a finished call: one issued past the returned
                # ranks' calls is where this rank waits.
                fewest: int = min(finals)  # type: ignore[type-var,assignment]
                if seq <= fewest < (beat.issued(group) or 0):
                    seq = fewest + 1
                    self.beats[rank] = beat.waiting_in(seq)
                if seq > fewest and now - last_return >= FINISHED_GRACE_S:
                    waiting.append(rank)
            else:
                since = self._still_since(run, rank, now)
                if (
                    since is not None
                    and since <= last_return
                    and now - last_return >= FINISHED_GRACE_UNSURE_S
                ):
                    waiting.append(rank)
        if not waiting:
            return None
        for rank in waiting:
            self._stall(run, rank, self.beats[rank])
        returned = sorted(self.returned, key=self.returned.get)  # type: ignore[arg-type]
        first = returned[0]
        n = self.world_size
        beat = self.beats[waiting[0]]
        group = beat.waiting_for()[0]
        # what the returned ranks issued on the group the waiting rank waits in
        on = "" if group == process_groups.DEFAULT_GROUP else f" on {beat.group_words()}"
        done_text = ", ".join(
            f"rank {r} {'exited' if r in self.exited else 'returned'} after "
            f"{_count(self._final_issued(r, group))}{on}"
            for r in returned
        )
        wait_text = "; ".join(
            f"rank {r} waits {self.beats[r].position()} "
            f"for {now - (self._still_since(run, r, now) or now):.1f} s"
            for r in waiting
        )
        left = "called sys.exit(0)" if first in self.exited else "returned"
        headline = (
            f"rank {first} of {n} {left} while {_rank_words(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} in a collective it never called"
        )
        fewer = _fewer(first, waiting[0], self._final_issued(first, group), beat.issued(group))
        message = f"{headline}: {done_text}; {wait_text}.{fewer}\n{PARTED}"
        if any(str(self.beats[r].event["collective"]).startswith("DDP") for r in waiting):
            message += (
                " For data that does not split evenly, give every rank the same number of "
                "batches (DistributedSampler(drop_last=True)) or wrap the loop in DDP's "
                "`with model.join():`."
            )
        root = self._root(run, first, headline, message, now, exited=first in self.exited)
        # debug=True checks each call's shapes; the counts already say the ranks parted.
        root.exception.debug_adds_nothing = True  # type: ignore[union-attr]
        return root

    def _proven(self, run: RunContext, now: float) -> RootCause | None:
        """Ranks wait on one another in calls none can complete (see :mod:`deadlock`)."""
        if not self._new_beats:
            return None  # nothing new to prove from (a deferred proof keeps its flag)
        running = {r: self.beats[r].event for r in self._running(run)}
        finals = {r: b.event if b else None for r, b in self.final_beat.items()}
        needs = deadlock.prove_from_beats(running, finals)  # type: ignore[arg-type]
        self._new_beats = bool(needs)
        if not needs:
            return None
        counts = {r: deadlock.counts_of(e) for r, e in {**finals, **running}.items() if e}
        waits = {r: deadlock.wait_of(running[r]) for r in needs}
        returned = sorted({r for need in needs.values() for r in need} & set(self.returned))
        collectives_only = all(w is not None and w.kind == "collective" for w in waits.values())
        if (
            returned
            and collectives_only
            and now - max(self.returned.values()) < DEFER_TO_RETURNED_S
        ):
            return None  # _returned_while_waiting says it better (set_trigger, DDP's join)
        for rank in needs:
            self._stall(run, rank, self.beats[rank])
        positions = {r: self.beats[r].position() for r in needs}
        headline, message = deadlock.report(
            needs,
            waits,
            counts,
            positions,
            returned,
            self.world_size,  # type: ignore[arg-type]
        )
        return self._root(run, min(needs), headline, message, now)

    def _no_progress(self, run: RunContext, now: float) -> RootCause | None:
        """Nothing moved for ``hang_timeout`` seconds and some rank waits in a collective."""
        if self.hang_timeout is None:
            return None
        running = self._running(run)
        if not running:
            return None
        last_return = max(self.returned.values(), default=float("-inf"))
        stills: dict[int, float] = {}
        for rank in running:
            beat = self.beats[rank]
            if beat.received <= last_return and now - beat.received < SILENT_AFTER_S:
                return None  # a rank returned since: its peers may be on their way out too
            still = self._known_still(run, rank, now)
            if still is None or still < self.hang_timeout:
                return None
            stills[rank] = still
        waiting = [r for r in running if self.beats[r].in_collective]
        if not waiting:
            return None  # no collective involved: a long computation, not a distributed hang
        outside = [r for r in running if r not in waiting]
        for rank in waiting:
            self._stall(run, rank, self.beats[rank])
        n = self.world_size
        timeout = f"{self.hang_timeout:g}"
        lines = [f"  rank {r}: {self._describe(r, now, stills[r])}" for r in running]
        lines += [
            f"  rank {r}: returned after {_count(self.final_seq.get(r))}"
            for r in sorted(self.returned)
        ]
        if outside:
            culprit = outside[0]
            headline = (
                f"rank {culprit} of {n} is stuck at {self.beats[culprit].event['where']} "
                f"outside any collective, while {_rank_words(waiting)} "
                f"{'waits' if len(waiting) == 1 else 'wait'} for it"
            )
            why = (
                f"Nothing moved for {timeout} s (hang_timeout). The waiting ranks are in a "
                f"collective that {_rank_words(outside)} never reached: a rank blocked in I/O, "
                "a lock, a sleep or a loop that does not end, or a collective skipped on one "
                "rank under an `if`."
            )
        else:
            culprit = min(waiting)
            headline = (
                f"{_rank_words(waiting)} of {n} waited in collectives for {timeout} s with "
                "no progress"
            )
            why = f"Nothing moved for {timeout} s (hang_timeout). " + _mismatch(self.beats, waiting)
        # The launcher adds the debug-mode hint (debug=True) to every error that happened
        # inside a collective while debug mode was off.
        why += " Pass a larger hang_timeout= if the ranks were only slow."
        message = f"{headline}.\n" + "\n".join(lines) + "\n" + why
        return self._root(run, culprit, headline, message, now)

    def _describe(self, rank: int, now: float, still: float) -> str:
        beat = self.beats[rank]
        text = f"{beat.position()}, no progress for {still:.0f} s"
        silent = now - beat.received
        if silent >= SILENT_AFTER_S:
            text += (
                f"; no heartbeat for {silent:.0f} s (its task thread holds the GIL in C code, "
                "or the process is stopped)"
            )
        return text

    def _final_issued(self, rank: int, group: str) -> int | None:
        beat = self.final_beat.get(rank)
        if beat is None:
            return self.final_seq.get(rank) if group == process_groups.DEFAULT_GROUP else None
        return beat.issued(group)

    def _root(
        self,
        run: RunContext,
        rank: int,
        headline: str,
        message: str,
        now: float,
        exited: bool = False,
    ) -> dict[str, Any]:
        """The hang as the run's root cause. ``exited``: ``rank`` left with ``sys.exit(0)``,
        which makes it that rank's failure (``RankFailedError``), never a ``SystemExit``."""
        stacks = {r: beat.event["stack"] for r, beat in sorted(self.beats.items())}
        blocks = []
        for r in self._running(run):
            beat = self.beats.get(r)
            if beat is not None and beat.event["stack"]:
                blocks.append(f"--- rank {r}: {beat.position()} ---\n{beat.event['stack']}")
        full = message
        if blocks:
            full += "\n\nStacks (most recent call last):\n" + "\n\n".join(blocks)
        headline = cell_names(headline)
        if exited:
            exception: Exception = RankFailedError(
                cell_names(full), rank=rank, world_size=self.world_size, exitcode=0
            )
        else:
            stacks = {r: cell_names(text) for r, text in stacks.items()}
            exception = DistributedHangError(cell_names(full), stacks=stacks)
            waiting = [r for r in self._running(run) if self.beats[r].in_collective]
            tracebacks.at_user_frames(exception, _user_frames(self.beats, [rank, *waiting]))
        return RootCause(Cause.HANG, rank, headline, exception=exception, title=headline)

    # --- stragglers ------------------------------------------------------------------------------

    def _publish_straggler(self, run: RunContext, *, final: bool) -> None:
        beats = {rank: beat.event for rank, beat in self.beats.items()}
        self.stragglers.publish(run, beats, final=final)


def _mismatch(beats: dict[int, Beat], waiting: list[int]) -> str:
    """Why ranks that all wait in collectives cannot go on, as far as their calls say."""
    names = {beats[r].event["collective"] for r in waiting}
    seqs = {beats[r].event["seq"] for r in waiting}
    if len(names) > 1:
        return (
            "The ranks wait in different collectives: they called collectives in a "
            "different order or a different number of times."
        )
    if len(seqs) > 1 and None not in seqs:
        return (
            "The ranks wait in different calls of the same collective (see their collective "
            "numbers): one rank called it more times than another."
        )
    return (
        "All ranks wait in the same collective: check that they pass tensors of the same "
        "shape and dtype, and that no peer process is blocked outside Python."
    )


def _user_frames(beats: dict[int, Beat], ranks: list[int]) -> list[tuple[str, int, str]]:
    """The user's frames where the first of ``ranks`` with a stack stands: the traceback."""
    for rank in ranks:
        beat = beats.get(rank)
        frames = tracebacks.user_frames_of_stack(beat.event["stack"]) if beat else []
        if frames:
            return frames
    return []


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _rank_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


# What the counts of a rank that returned early cannot tell: a step skipped on one rank and a
# rank that left the loop early both leave it with fewer collectives (see docs/hangs.md).
PARTED = (
    "Every rank must issue the same collectives in the same order; the counts show where the "
    "ranks parted, not why: a collective skipped on one rank (with DDP, a `backward()` under an "
    "`if`), a rank that left the loop early (early stopping, a `break`), or uneven data. To stop "
    "early together, call set_trigger() on the rank that wants to stop and "
    "`if check_trigger(): break` on every rank."
)


def _fewer(returned: int, waiting: int, final: int | None, issued: int | None) -> str:
    """How many fewer collectives the rank that returned issued, when the counts say."""
    if final is None or issued is None or issued <= final:
        return ""
    fewer = issued - final
    return (
        f" Rank {returned} issued {fewer} fewer collective{'s' if fewer != 1 else ''} than "
        f"rank {waiting} had (on the same process group)."
    )


def _count(seq: int | None) -> str:
    """How many collectives a returned rank issued, in words."""
    if seq is None:
        return "its last collective"
    return f"{seq} collective{'s' if seq != 1 else ''}"
