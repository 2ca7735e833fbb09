"""Deadlocks proven from what every rank waits on, not timed.

Each heartbeat says what its rank waits on (:mod:`nblaunch.ranks.heartbeat`,
:mod:`nblaunch.ranks.checks.waits`) and what it has issued so far:

* a collective waits on its process group at its number ``n`` there; it completes only when
  every member of the group has issued call ``n`` on it;
* the ``n``-th receive a rank posted from a peer (same group and tag) completes only when that
  peer has posted ``n`` sends to it; the ``n``-th send, when the peer posted ``n`` receives
  (gloo's sends wait for the receive).

A wait that cannot complete now names the ranks whose missing call it needs. Those ranks may
still make that call, unless they are themselves blocked by the same kind of wait, or returned.
:func:`prove` keeps the largest set of waiting ranks each of which needs only ranks of the set or
ranks that returned: none of them can ever move again. Counts only grow, so heartbeats taken at
slightly different times still prove it (a count a peer had not reached at its heartbeat, it
had not reached before either). A rank counts as waiting only once its heartbeat shows it still
in the same wait for ``SETTLE_S``, with no count moving: a rank computing, a wait nblaunch
cannot name (a receive from any source, a collective the flight recorder does not count) or a
rank without heartbeats proves nothing, and the hang timeout stays for those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A rank counts as blocked once its heartbeat shows it this long in the same wait, no count
# moving (heartbeats come at 0.3 s and 1 s of a wait, then every second).
SETTLE_S = 0.8
DEFAULT_GROUP = "0"


@dataclass(frozen=True)
class Wait:
    """What a blocked rank waits on."""

    kind: str  # "collective", "send" or "recv"
    group: str  # process group name; "0" is the default group
    n: int  # its number on the group (collective) or among posts to the same peer and tag
    peer: int = -1  # send/recv: the peer's global rank; -1 a receive from any source
    tag: int | None = None  # send/recv: the tag, None where the backend ignores tags
    desc: str = ""  # the group's description where it was given one (a device mesh's "mesh_tp")


@dataclass
class Counts:
    """What a rank has issued: collectives per group, point-to-point posts per peer and tag."""

    collectives: dict[str, int] | None  # None: the rank's groups do not count collectives
    posted: dict[tuple[str, str, int, int | None], int] = field(default_factory=dict)


def wait_of(beat: Mapping[str, Any], settle_s: float = SETTLE_S) -> Wait | None:
    """What a heartbeat's rank is blocked on, or ``None`` when it is not known to be blocked."""
    if beat.get("collective") is None or beat.get("still_s", 0.0) < settle_s:
        return None
    p2p = beat.get("p2p_wait")
    if p2p:
        return Wait(p2p["op"], str(p2p["group"]), int(p2p["n"]), int(p2p["peer"]), p2p["tag"])
    in_flight = beat.get("in_flight")
    if in_flight:
        desc = str(in_flight.get("group_desc") or "")
        return Wait("collective", str(in_flight["group"]), int(in_flight["seq"]), desc=desc)
    return None


def counts_of(beat: Mapping[str, Any]) -> Counts:
    groups = beat.get("groups")
    collectives = None if groups is None else {str(k): int(v) for k, v in groups.items()}
    posted = {
        (str(op), str(group), int(peer), tag): int(count)
        for op, group, peer, tag, count in beat.get("p2p_posted") or ()
    }
    return Counts(collectives, posted)


def blockers(
    rank: int, wait: Wait, counts: Mapping[int, Counts], members: Mapping[str, list[int]]
) -> set[int] | None:
    """The ranks whose missing call keeps ``wait`` from completing.

    Empty when it can complete with what was issued; ``None`` when that cannot be told (a
    receive from any source, a group or a peer without counts).
    """
    if wait.kind == "collective":
        ranks = members.get(wait.group)
        if ranks is None or rank not in ranks:
            return None
        missing = set()
        for member in ranks:
            if member == rank:
                continue
            peer = counts.get(member)
            if peer is None or peer.collectives is None:
                return None
            if peer.collectives.get(wait.group, 0) < wait.n:
                missing.add(member)
        return missing
    peer = counts.get(wait.peer)
    if wait.peer < 0 or peer is None:
        return None
    if wait.kind == "recv":
        sent = peer.posted.get(("send", wait.group, rank, wait.tag), 0)
        return set() if sent >= wait.n else {wait.peer}
    if peer.posted.get(("recv", wait.group, -1, wait.tag), 0):
        return set()  # the peer posted a receive from any source: it may take this send
    received = peer.posted.get(("recv", wait.group, rank, wait.tag), 0)
    return set() if received >= wait.n else {wait.peer}


def prove(
    waits: Mapping[int, Wait],
    counts: Mapping[int, Counts],
    returned: set[int],
    members: Mapping[str, list[int]],
) -> dict[int, set[int]]:
    """The ranks proven never to move again, each with the ranks its wait needs.

    ``waits``: the running ranks known to be blocked; ``counts``: every rank's counts (returned
    ranks' final ones); ``returned``: ranks whose task returned. Empty when nothing is proven.
    """
    needs: dict[int, set[int]] = {}
    for rank, wait in waits.items():
        missing = blockers(rank, wait, counts, members)
        if missing:
            needs[rank] = missing
    changed = True
    while changed:  # drop a rank that needs one that may still move, until none does
        changed = False
        for rank in list(needs):
            if any(other not in needs and other not in returned for other in needs[rank]):
                del needs[rank]
                changed = True
    return needs


def prove_from_beats(
    running: Mapping[int, Mapping[str, Any]],
    finals: Mapping[int, Mapping[str, Any] | None],
    settle_s: float = SETTLE_S,
) -> dict[int, set[int]]:
    """:func:`prove` from the running ranks' latest heartbeats and the returned ranks' last."""
    waits = {}
    for rank, beat in running.items():
        wait = wait_of(beat, settle_s)
        if wait is not None:
            waits[rank] = wait
    beats = {**{r: b for r, b in finals.items() if b is not None}, **running}
    counts = {rank: counts_of(beat) for rank, beat in beats.items()}
    members: dict[str, list[int]] = {}
    for beat in beats.values():
        members.update(beat.get("members") or {})
    return prove(waits, counts, set(finals), members)


# --- saying it -----------------------------------------------------------------------------------


def group_words(group: str, desc: str = "") -> str:
    """``"the default group"``, ``"group 1"``, ``"group 4 (mesh_tp)"``."""
    if group == DEFAULT_GROUP:
        return "the default group"
    named = desc and desc not in ("undefined", group)  # new_group() without a description
    return f"group {group} ({desc})" if named else f"group {group}"


def describe_wait(wait: Wait) -> str:
    """``"recv #1 from rank 1 (tag 0)"``, ``"collective #3 of group 1"``."""
    if wait.kind == "collective":
        return f"collective #{wait.n} of {group_words(wait.group, wait.desc)}"
    where = "from" if wait.kind == "recv" else "to"
    peer = "any rank" if wait.peer < 0 else f"rank {wait.peer}"
    text = f"{wait.kind} #{wait.n} {where} {peer}"
    if wait.tag is not None:
        text += f", tag {wait.tag}"
    if wait.group != DEFAULT_GROUP:
        text += f", {group_words(wait.group)}"
    return text


def describe_need(rank: int, wait: Wait, need: set[int], counts: Mapping[int, Counts]) -> str:
    """Why ``wait`` cannot complete: what the ranks it needs issued."""
    parts = []
    for other in sorted(need):
        peer = counts.get(other) or Counts(None)
        if wait.kind == "collective":
            issued = (peer.collectives or {}).get(wait.group, 0)
            parts.append(
                f"rank {other}, which issued {issued} collective{'s' if issued != 1 else ''} "
                f"on {group_words(wait.group, wait.desc)}"
            )
        elif wait.kind == "recv":
            sent = peer.posted.get(("send", wait.group, rank, wait.tag), 0)
            parts.append(f"rank {other}, which posted {sent} send{'s' if sent != 1 else ''} to it")
        else:
            got = peer.posted.get(("recv", wait.group, rank, wait.tag), 0)
            parts.append(
                f"rank {other}, which posted {got} receive{'s' if got != 1 else ''} from it"
            )
    return "; ".join(parts)


def report(
    needs: Mapping[int, set[int]],
    waits: Mapping[int, Wait],
    counts: Mapping[int, Counts],
    positions: Mapping[int, str],
    returned: list[int],
    world_size: int,
) -> tuple[str, str]:
    """The headline and message of a proven deadlock: each rank's wait (``positions``: how the
    hang report shows it) and what it needs, the returned ranks it needs, and what to do."""
    ranks = sorted(needs)
    words = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    headline = (
        f"{words} of {world_size} {'waits' if len(ranks) == 1 else 'wait'} in calls that can "
        "never complete"
    )
    lines = [
        f"  rank {r}: {positions[r]}; needs {describe_need(r, waits[r], needs[r], counts)}"
        for r in ranks
    ]
    lines += [f"  rank {r}: returned" for r in returned]
    why = (
        "Proven from the ranks' waits (each needs a call from a rank that is itself blocked or "
        "returned), not timed. " + advice(list(waits.values()), bool(returned))
    )
    return headline, f"{headline}.\n" + "\n".join(lines) + "\n" + why


def advice(waits: list[Wait], returned: bool) -> str:
    """What to do, by the kinds of wait in the proof."""
    kinds = {wait.kind for wait in waits}
    groups = {wait.group for wait in waits if wait.kind == "collective"}
    tips = []
    if returned:
        tips.append(
            "A rank returned without the call its peers wait for: every rank must make the "
            "same calls (a loop left at different steps, a send or receive skipped under an "
            "`if`)."
        )
    if len(groups) > 1:
        tips.append(
            "The ranks wait in collectives of different process groups: every rank must call "
            "the collectives of the groups it belongs to in the same order."
        )
    elif "collective" in kinds and not returned:
        tips.append("The ranks issued different numbers of collectives on a group.")
    if kinds & {"send", "recv"}:
        tips.append(
            "Every receive needs its peer's matching send, and every send (on gloo) its peer's "
            "receive: two ranks that both receive (or both send) first wait for each other. "
            "Post both sides together with batch_isend_irecv, or order them by rank."
        )
    return " ".join(tips)
