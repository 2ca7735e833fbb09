"""The out-of-band collective checks in the notebook: compare the ranks' collectives as they come.

Each rank sends a record of every collective it issues down a local socket
(:mod:`nblaunch.ranks.checks.fingerprints`), read here at every check (:class:`CallReader`); a
joined node of a multi-node run passes what its ranks sent on to the notebook as ``Collectives``
events, with its other events. :class:`CollectiveChecks` keeps the records of each
collective (task, process group, its number on that group) until every rank of the group sent
one, and compares them with debug mode's rules
(:func:`nblaunch.ranks.checks.debug_report.mismatch_message`) as soon as two are there. When they
disagree the run ends with the same :class:`~nblaunch.errors.DistributedOperationException`
debug mode raises (both calls, both call sites, the shape table) within about a tenth of a
second of the second rank's call, even when gloo aborted a rank right after it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nblaunch import tracebacks
from nblaunch.engine.monitors.protocol import RunContext
from nblaunch.engine.monitors.source_lines import cell_names
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import DistributedOperationException
from nblaunch.ranks.checks.debug_report import (
    DDP_ALL_REDUCE,
    base_operation,
    is_recorded,
    mismatch_message,
    record_of,
    same_facts,
    user_frame,
)
from nblaunch.ranks.checks.fingerprints import (
    CALL,
    CALL_TAG,
    DEFINITION,
    DEFINITION_TAG,
    PREDICTED_CALL,
    PREDICTED_TAG,
    RECORDER,
)

if TYPE_CHECKING:
    from nblaunch.engine.plan.launch_plan import LaunchPlan

# Collectives kept while waiting for a group's other ranks; past this the oldest are dropped
# (a rank that failed half-way never sends the rest, and the run may go on in a pool).
MAX_OPEN = 10_000
# Rules whose comparison needs every rank's record, in group order (all_gather's outputs).
_WHOLE_GROUP_RULES = ("all_gather", "all_gather_even")
# Most bytes read from one rank's connection per check (about 2000 records).
READ_BYTES = 1 << 19
# How a group's collectives as the flight recorder numbers them are told apart from the calls
# checked in Python (numbered by the checks): their group's name ends with this.
RECORDED_SUFFIX = "@recorder"
# A call's entry in the recorder as its rank predicted it (sent with the call, before the
# collective ran) is used only when the rank failed without sending the entry itself: gloo
# aborts a rank on a size mismatch before its reader sees the entry.
# How long a failed rank's predicted entries wait for their peers' (once per failure).
PEERS_WAIT_S = 0.3


@dataclass
class _Sender:
    """One rank's connection for one task, with what it defined so far."""

    unread: bytes = b""  # the start of a message not yet whole
    rank: int = -1
    task: int = -1
    groups: dict[int, tuple[str, int, list[int]]] = field(default_factory=dict)  # by key name
    facts: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)  # groups whose first call was read


class CallReader:
    """The launcher's end of the ranks' pipes: a listening socket in Linux's abstract namespace
    (its name travels in the ranks' set-up options), where each rank hands over the reading end
    of one pipe per task. Nothing waits on them: :meth:`read` takes what arrived, without
    blocking.

    The messages are calls by index and the definitions they refer to
    (``nblaunch.ranks.checks.fingerprints.CALL``); each call is read into a
    :class:`~nblaunch.events.CollectiveCall`. Only processes of this user may connect
    (the abstract namespace has no file permissions), which may read this process's memory
    anyway: their pickles are as trusted as the ranks' event pipes.
    """

    def __init__(self) -> None:
        self.address = f"nblaunch-checks-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.connecting: list[socket.socket] = []  # accepted, their pipe not handed over yet
        self.pipes: dict[int, _Sender] = {}  # each pipe's reading end, and whose it is

    def read(self) -> list[dict[str, Any]]:
        """Every whole call that arrived since the last read."""
        self._accept()
        calls: list[dict[str, Any]] = []
        for pipe, sender in list(self.pipes.items()):
            try:
                data = os.read(pipe, READ_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the task ended on that rank
                self._drop(pipe)
                continue
            try:
                sender.unread = _parse(sender, sender.unread + data, calls)
            except Exception:  # not a rank's messages: stop listening to that pipe
                self._drop(pipe)
        return calls

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                break
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                conn.close()
                continue
            conn.setblocking(False)
            self.connecting.append(conn)
        for conn in list(self.connecting):
            try:
                data, fds, _, _ = socket.recv_fds(conn, 4096, 1)
            except BlockingIOError:
                continue
            except OSError:
                data, fds = b"", []
            self.connecting.remove(conn)
            conn.close()
            if not fds:
                continue  # hung up, or not a rank
            sender = _Sender()
            try:
                if _parse(sender, data, []) or sender.rank < 0:
                    raise ValueError("not a rank's first message")
                os.set_blocking(fds[0], False)
            except Exception:
                os.close(fds[0])
                continue
            self.pipes[fds[0]] = sender

    def _drop(self, pipe: int) -> None:
        if self.pipes.pop(pipe, None) is not None:
            os.close(pipe)

    def close(self) -> None:
        for pipe in list(self.pipes):
            self._drop(pipe)
        for conn in self.connecting:
            conn.close()
        self.connecting.clear()
        with contextlib.suppress(OSError):
            self.listener.close()


def _parse(sender: _Sender, buffer: bytes, calls: list[dict[str, Any]]) -> bytes:
    """Append the calls of ``buffer``'s whole messages to ``calls``; return the rest."""
    start, end = 0, len(buffer)
    while start < end:
        tag = buffer[start]
        if tag in (CALL_TAG, PREDICTED_TAG):
            layout = CALL if tag == CALL_TAG else PREDICTED_CALL
            if end - start < layout.size:
                break
            _, group, n, facts, *predicted = layout.unpack_from(buffer, start)
            start += layout.size
            name, size, members = sender.groups[group]
            first = group not in sender.announced  # its ranks go with its first call
            sender.announced.add(group)
            calls.append(
                {
                    "rank": sender.rank,
                    "task": sender.task,
                    "group": name,
                    "size": size,
                    "n": n,
                    "record": sender.facts[facts],
                    "members": members if first else None,
                }
            )
            if predicted:  # the recorder's number this call should get
                calls[-1]["predicted"] = predicted[0]
            continue
        if tag != DEFINITION_TAG:
            raise ValueError(f"not a message: {buffer[start : start + 8]!r}")
        if end - start < DEFINITION.size:
            break
        _, length = DEFINITION.unpack_from(buffer, start)
        if end - start < DEFINITION.size + length:
            break
        item = pickle.loads(buffer[start + DEFINITION.size : start + DEFINITION.size + length])
        start += DEFINITION.size + length
        if item[0] == "rank":
            _, sender.rank, sender.task = item
        elif item[0] == "group":
            _, index, name, size, members, *stream = item
            if stream and stream[0] == RECORDER:  # the flight recorder's numbers
                name += RECORDED_SUFFIX

            sender.groups[index] = (name, size, members)
        elif item[0] == "facts":
            sender.facts[item[1]] = item[2]
        else:
            raise ValueError(f"not a definition: {item[0]!r}")
    return buffer[start:]


# The readers alive, by address: a pool's next task has new monitors but the same ranks, which
# know the address they were set up with.
_readers: weakref.WeakValueDictionary[str, CallReader] = weakref.WeakValueDictionary()


def reader_for(plan: LaunchPlan) -> CallReader:
    """The reader whose address the plan's ranks were given, or a new one (its address then goes
    into the plan's options, which the ranks' set-up carries)."""
    address = plan.options.get("checks_address")
    reader = _readers.get(address) if address else None
    if reader is None:
        reader = CallReader()
        _readers[reader.address] = reader
        plan.options["checks_address"] = reader.address
    return reader


def compare(records: dict[int, Any], complete: bool) -> str | None:
    """Debug mode's report for the records of one collective (by rank), or ``None`` if they agree.

    Each record is a rank's facts (``debug_report.FACTS``, what ranks send) or debug mode's
    record of them. ``complete``: every rank of the group sent its record. Before that,
    everything is compared but an all-gather's outputs, which need every rank's input.
    """
    ranks = sorted(records)
    ordered = [records[rank] for rank in ranks]
    if all(type(r) is tuple for r in ordered):
        if same_facts(ordered):  # nearly every call: no record made, nothing hashed
            return None
        ordered = [record_of(facts, rank) for rank, facts in zip(ranks, ordered, strict=True)]
    if len({record["op"] for record in ordered}) > 1:
        if _same_call(ordered):
            return None
        return mismatch_message(ordered)
    if not complete and ordered[0].get("rule") in _WHOLE_GROUP_RULES:
        return None
    return mismatch_message(ordered)


def _same_call(records: list[dict[str, Any]]) -> bool:
    """True when records of different names are one collective with the same inputs: torch
    issued it on one rank (the flight recorder's entry) and a call checked in Python on
    another (``dist.all_reduce`` in a library's code path on one rank only)."""
    ops = {record["op"] for record in records}
    issued_by_torch = {op for op in ops if op == DDP_ALL_REDUCE or is_recorded(op)}
    if not issued_by_torch or (DDP_ALL_REDUCE in ops and issued_by_torch != ops):
        return False  # DDP's all-reduce against a call in Python: never the same step
    if len({base_operation(op) for op in ops}) > 1:
        return False
    keys = {(record["key"]["shape"], record["key"]["dtype"]) for record in records}
    return len(keys) == 1 or any(record["rule"] == "none" for record in records)


@dataclass
class Owed:
    """What ranks back from a task owe peers that wait in collectives (see :func:`owed_calls`)."""

    calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> in order
    keys: list[tuple[int, str, int]] = field(default_factory=list)  # the collectives
    waiting: set[int] = field(default_factory=set)  # ranks that issued them
    problem: str = ""  # why they cannot be released; then ``calls`` is empty


def owed_calls(
    open_calls: dict[tuple[int, str, int], dict[int, Any]],
    members: dict[str, list[int]],
    task: int,
    idle: set[int],
    skip: set[tuple[int, str, int]],
    highest: dict[tuple[int, str, int], int] | None = None,
) -> Owed:
    """Which collectives of ``task`` ranks in ``idle`` owe, and the calls that release them.

    A collective some ranks of its group issued and others never did, all of them back from the
    task (``idle``), can be completed by those others issuing the same call: its record says
    the operation, shapes, dtypes and arguments (:mod:`nblaunch.ranks.release`). One whose
    missing ranks still run is left to them. All or nothing: a call that cannot be released
    (or a group whose ranks are unknown) makes the result empty, with the reason.
    """
    from nblaunch.ranks.release import unsupported

    owed = Owed()
    highest = highest or {}
    for key, records in open_calls.items():
        call_task, group, n = key
        if call_task != task or key in skip:
            continue
        first = min(records)
        record = records[first]
        if type(record) is tuple:  # a call's facts, as ranks send them
            record = record_of(record, first)
        recorded = group.endswith(RECORDED_SUFFIX)
        if recorded and not (record["op"] == DDP_ALL_REDUCE or is_recorded(record["op"])):
            continue  # a call checked in Python: its own numbers say what is owed
        ranks = members.get(group)
        if ranks is None:
            return Owed(problem=f"the ranks of process group {group} are not known")
        missing = [rank for rank in ranks if rank not in records]
        if not missing or any(rank not in idle for rank in missing):
            continue
        if recorded and any(highest.get((call_task, group, r), 0) > n for r in missing):
            continue  # sent later entries: this one was overwritten before it was read
        group = group.removesuffix(RECORDED_SUFFIX)
        problem = unsupported(record)
        if problem:
            waiting = ", ".join(map(str, sorted(records)))
            return Owed(problem=f"rank(s) {waiting} wait in {problem}")
        for rank in missing:
            owed.calls.setdefault(rank, []).append({"group": group, "n": n, "record": record})
        owed.keys.append(key)
        owed.waiting.update(records)
    return owed


class CollectiveChecks:
    """Ends a run whose ranks disagree on a collective (a ``Monitor``; see the module).

    Parameters
    ----------
    plan
        The launch plan: its world size names the ranks in the report; with the checks on,
        its options carry the reader's address (:func:`reader_for`).
    """

    def __init__(self, plan: LaunchPlan) -> None:
        self.world_size = plan.world_size
        self.reader = reader_for(plan) if plan.checks else None
        self.open: dict[tuple[int, str, int], dict[int, Any]] = {}
        self.members: dict[str, list[int]] = {}  # group name -> its ranks, once a call said
        self.compared = 0  # collectives every rank of the group reported, found consistent
        # (task, recorder group, rank) -> the highest entry the rank sent
        self.highest: dict[tuple[int, str, int], int] = {}
        # (task, group, rank) -> the rank's last call there that said its recorder number
        self.predicted: dict[tuple[int, str, int], dict[str, Any]] = {}
        self.found: RootCause | None = None
        self.reported = False
        self.forwards: bool | None = None  # see _forwards

    def on_event(self, run: RunContext, event: dict[str, Any]) -> None:
        """Another node's ranks' calls, passed on by its launcher."""
        if event["kind"] != "collectives":
            return
        for call in event["calls"]:
            self._take(call)

    def collect(self) -> None:
        """Take what the ranks sent since the last check, without judging (a pool's task is
        ending: :meth:`owed` reads what is still open)."""
        if self.reader is not None and not self.reported:
            for call in self.reader.read():
                self._take(call)

    def owed(self, task: int, idle: set[int], skip: set[tuple[int, str, int]]) -> Owed:
        """The calls of ``task`` that ranks in ``idle`` (back from their task) never issued
        while peers did (:func:`owed_calls`); ``skip``: collectives released already."""
        if self.found is not None:
            return Owed(problem="the ranks called mismatched collectives")
        return owed_calls(self.open, self.members, task, idle, skip, self.highest)

    def _take(self, call: dict[str, Any]) -> None:
        predicted = call.get("predicted")
        if predicted is not None:  # only the last one per group and rank can be needed
            self.predicted[(call["task"], call["group"], call["rank"])] = call
        if call.get("members"):
            self.members[call["group"]] = call["members"]
        if self.found is not None:
            return
        rank = call["rank"]
        key = (call["task"], call["group"], call["n"])
        if call["group"].endswith(RECORDED_SUFFIX):
            mark = (call["task"], call["group"], rank)
            self.highest[mark] = max(self.highest.get(mark, 0), call["n"])
        records = self.open.get(key)
        if records is None:
            if len(self.open) >= MAX_OPEN:
                del self.open[next(iter(self.open))]
            records = self.open[key] = {}
        records[rank] = call["record"]
        if len(records) < 2:
            return
        complete = len(records) >= call["size"]
        message = compare(records, complete)
        if message is not None:
            self.found = self._root(call, records, message)
        elif complete:
            del self.open[key]
            self.compared += 1

    def _await_peers(self, gone: set[int]) -> list[dict[str, Any]]:
        """Read on for up to ``PEERS_WAIT_S`` while a predicted entry of a rank ``gone`` has
        no peer's entry to meet: the peers' readers send theirs within a poll, and the run's
        verdict on the failure comes right after this check."""
        assert self.reader is not None
        taken: list[dict[str, Any]] = []
        deadline = time.monotonic() + PEERS_WAIT_S
        while time.monotonic() < deadline:
            if not any(
                not self.open.get((task, group + RECORDED_SUFFIX, call["predicted"]))
                for (task, group, rank), call in self.predicted.items()
                if rank in gone
            ):
                break
            time.sleep(0.01)
            for call in self.reader.read():
                self._take(call)
                taken.append(call)
        return taken

    def _take_predicted(self, gone: set[int]) -> None:
        """The last predicted entry of each group of ranks ``gone`` (failed or aborted: their
        reader will send nothing more), where the rank did not send the entry itself."""
        for key, call in list(self.predicted.items()):
            task, group, rank = key
            if rank not in gone:
                continue
            del self.predicted[key]
            recorded = group + RECORDED_SUFFIX
            if self.highest.get((task, recorded, rank), 0) < call["predicted"]:
                self._take({**call, "group": recorded, "n": call["predicted"], "predicted": None})

    def ranks_ended(self) -> None:
        """The ranks were stopped: close their reader (a listening socket, and a run's plan
        outlives it in the handles ``runs()`` keeps); fresh ranks get a new one."""
        if self.reader is not None:
            _readers.pop(self.reader.address, None)
            self.reader.close()

    def check(self, run: RunContext) -> RootCause | None:
        if self.reader is not None and not self.reported:
            calls = self.reader.read()
            for call in calls:
                self._take(call)
            if self.predicted and run.outcome.failures:
                gone = {failure.rank for failure in run.outcome.failures}
                calls += self._await_peers(gone)
                self._take_predicted(gone)
            if calls and self._forwards(run):
                run.publish({"kind": "collectives", "calls": calls})  # type: ignore[typeddict-item]
        if self.found is None or self.reported:
            return None
        self.reported = True  # once: the run ends with it
        self.open.clear()
        return self.found

    def _forwards(self, run: RunContext) -> bool:
        """True on a node without every rank (a joined node's launcher sends its ranks' calls
        on to the notebook's); a single machine's calls stay here, out of its view's events."""
        if self.forwards is None:
            self.forwards = not all(run.runs_here(rank) for rank in range(self.world_size))
        return self.forwards

    def _root(self, call: dict[str, Any], records: dict[int, Any], message: str) -> RootCause:
        ranks = sorted(records)
        name = call["group"].removesuffix(RECORDED_SUFFIX)
        group = "the default group" if name == "0" else f"process group {name}"
        if name != call["group"]:
            group += " (torch's numbers, from its flight recorder)"
        message = cell_names(message) + (
            f"\n\nFound by nblaunch's checks (on by default), comparing the calls of ranks "
            f"{', '.join(map(str, ranks))} at collective #{call['n']} of {group}. The mismatched "
            "call may have run already: with debug=True every rank checks each call before it "
            "runs (slower; worth it with NCCL, where a size mismatch can corrupt memory)."
        )
        headline = message.splitlines()[0]
        names = " and ".join(f"rank {r}" for r in ranks[:2])
        title = f"{names} of {self.world_size} disagree on collective #{call['n']}"
        exception = DistributedOperationException(message)
        tracebacks.at_user_frames(exception, user_frame(records))
        return RootCause(Cause.MISMATCH, ranks[0], headline, exception=exception, title=title)
