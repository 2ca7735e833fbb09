"""A heartbeat as the hang watchdog reads it (:mod:`nblaunch.engine.monitors.hang`).

A rank's :class:`~nblaunch.events.Heartbeat` (:mod:`nblaunch.ranks.heartbeat`) says where its
task is and what it has issued; :class:`Beat` answers the watchdog's questions of it: which
collective of which group it waits in, how many it issued on a group, and its position in words.
"""

from __future__ import annotations

from dataclasses import dataclass

from nblaunch.engine.monitors import deadlock
from nblaunch.engine.monitors.source_lines import with_source
from nblaunch.events import Heartbeat
from nblaunch.ranks.checks import process_groups

# The input of debug mode's own all_gather (ranks.debug_mode.RECORD_BYTES; a test keeps them
# equal): a rank that waits in it waits in the check before the user's call.
RECORD_BYTES = 2048


@dataclass
class Beat:
    """A rank's last heartbeat as the watchdog reads it: where it waits, and in what."""

    event: Heartbeat
    received: float  # the run's clock, in the parent

    @property
    def in_collective(self) -> bool:
        return self.event["collective"] is not None

    def waiting_for(self) -> tuple[str, int | None]:
        """The process group and number of the collective this rank waits in."""
        in_flight = self.event.get("in_flight")
        if in_flight:
            return in_flight["group"], in_flight["seq"]
        return process_groups.DEFAULT_GROUP, self.event["seq"]

    def waiting_in(self, seq: int) -> Beat:
        """This heartbeat, waiting in collective ``seq`` of its group instead (the recorder's
        entry, with its shapes, was an earlier one)."""
        in_flight = self.event.get("in_flight")
        if in_flight:
            in_flight = {**in_flight, "seq": seq, "shapes": None}
            return Beat({**self.event, "in_flight": in_flight}, self.received)  # type: ignore[typeddict-item]
        return Beat({**self.event, "seq": seq}, self.received)

    def issued(self, group: str) -> int | None:
        """How many collectives this rank had issued on ``group`` at this heartbeat."""
        groups = self.event.get("groups") or {}
        if group in groups:
            return groups[group]
        return self.event["seq"] if group == process_groups.DEFAULT_GROUP else None

    def group_words(self) -> str:
        """The group this rank waits in, as its position names it: ``"subgroup mesh_tp"``."""
        group = self.waiting_for()[0]
        if group == process_groups.DEFAULT_GROUP:
            return "the default group"
        desc = (self.event.get("in_flight") or {}).get("group_desc") or group
        return f"subgroup {group if desc == 'undefined' else desc}"  # new_group() without a name

    def position(self) -> str:
        event = self.event
        where = with_source(event["where"])
        p2p = event.get("p2p_wait")
        if event["collective"] and p2p:
            wait = deadlock.Wait(p2p["op"], p2p["group"], p2p["n"], p2p["peer"], p2p["tag"])
            return f"in {event['collective']} ({deadlock.describe_wait(wait)}) at {where}"
        if event["collective"]:
            group, seq = self.waiting_for()
            number = f"collective #{seq}" if seq else ""
            in_flight = event.get("in_flight")
            if number and group != process_groups.DEFAULT_GROUP:
                number += f" of {self.group_words()}"
            if in_flight and in_flight.get("shapes") == [[RECORD_BYTES]]:
                # debug mode's own all_gather of records: its buffer is not the user's tensor
                if not str(event["collective"]).startswith("debug mode's check"):
                    number += ", debug mode's check before it"
            elif in_flight and in_flight.get("shapes"):
                number += f", shapes {in_flight['shapes']}"
            number = f" ({number})" if number else ""
            return f"in {event['collective']}{number} at {where}"
        return f"at {where} (outside any collective)"
