"""The flight recorder's collectives, checked out of band: what DDP, FSDP and C++ code issue.

torch records every collective its process groups issue, from Python or from C++ (DDP's
gradient all-reduce in ``backward()``, its broadcasts, FSDP's all-gathers), in its flight
recorder (on for gloo and NCCL while ``TORCH_FR_BUFFER_SIZE`` > 0; nblaunch turns it on,
:mod:`nblaunch.ranks.checks.process_groups`). While the out-of-band checks are on, in a launch of
two ranks or more, a thread of each task (:class:`RecorderReader`) looks at the groups' counts 50
times a second and reads the entries made since its last read once the recorder is nearly full
of new ones or the oldest is a quarter of a second old (see ``POLL_S``), and sends each one's
fingerprint (operation, input sizes, dtypes, its number on its group: ``collective_seq_id``)
down the checks' pipe (:mod:`nblaunch.ranks.checks.fingerprints`), where the launcher compares them
as it compares the calls checked in Python (:mod:`nblaunch.engine.monitors.collective_checks`).
Nothing runs in the training step: DDP keeps its own C++ all-reduce, and a user's comm hook stays
the one DDP reports.

An entry issued by a call checked in Python (``dist.all_reduce``, nblaunch's own collectives)
is sent with that call's facts, so that the report names the call and its line; the entry is
that call's when it was made on the same thread, on the same group, while the call ran (a
:class:`~nblaunch.ranks.checks.fingerprints.Claim`). Any other entry was issued by torch itself: an
all-reduce on a group with a DDP model is DDP's gradient all-reduce; its call site is the line
the task's thread is on when the entry is read (the ``loss.backward()`` a rank waits in).
"""

from __future__ import annotations

import contextlib
import pickle
import re
import sys
import threading
import time
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks import fingerprints, process_groups
from nblaunch.ranks.checks.debug_mode import UNKNOWN, site_of
from nblaunch.ranks.checks.debug_report import DDP_ALL_REDUCE, RECORDED

# How often the thread looks at the groups' counts (a few µs), and when it reads the new entries:
# a read takes about 5 µs per entry the recorder holds (0.32 ms for 64 on this project's CPU),
# however few are new, so it waits until the recorder is nearly full of new ones (``read``), or
# the oldest unread entry is ``MAX_LAG_S`` old (a rank that hangs or waits has its last entries
# read by then).
POLL_S = 0.02
MAX_LAG_S = 0.25
# Each group's count of collectives issued, in the recorder's counts (JSON).
_ENQUEUED = re.compile(rb'"last_enqueued_collective"\s*:\s*"?(-?\d+)')
# Distinct entries torch issued itself whose facts a reader keeps (see ``_facts``).
MAX_KNOWN = 1024
# torch's names of dtypes in the recorder, as torch.dtype prints them (others are kept as is).
DTYPES = {
    "Float": "torch.float32",
    "Double": "torch.float64",
    "Half": "torch.float16",
    "BFloat16": "torch.bfloat16",
    "Long": "torch.int64",
    "Int": "torch.int32",
    "Short": "torch.int16",
    "Char": "torch.int8",
    "Byte": "torch.uint8",
    "Bool": "torch.bool",
    "ComplexFloat": "torch.complex64",
    "ComplexDouble": "torch.complex128",
}
# Operations whose every rank must pass the same input sizes and dtypes. Others (all-to-all,
# gather, scatter: uneven by design) are compared by their operation alone.
SAME_INPUTS = {
    "all_reduce",
    "allreduce",
    "broadcast",
    "reduce",
    "all_gather",
    "allgather",
    "_allgather_base",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "allreduce_coalesced",
    "all_reduce_coalesced",
}
# The recorder's dump functions (their JSON twin gives the groups' counts alone, cheaply):
# gloo's, and NCCL's on a CUDA build.
DUMPS = (("_dump_fr_trace", "_dump_fr_trace_json"), ("_dump_nccl_trace", "_dump_nccl_trace_json"))


class RecorderReader:
    """Reads one task's new flight recorder entries and sends them (see the module).

    Parameters
    ----------
    outbox
        The task's outbox: the pipe, the groups' routes, the claims of the calls checked.
    target
        Ident of the task's thread (whose line names a collective torch issued).
    """

    def __init__(self, outbox: fingerprints.Outbox, target: int | None = None) -> None:
        self.outbox = outbox
        self.target = target if target is not None else threading.get_ident()
        self.newest = -1  # the highest record_id read
        self.counts: Any = None  # the groups' counts at the last read
        self.groups: dict[str, Any] = {}  # group name -> process group
        self.sent = 0  # entries sent
        self.lost = 0  # entries overwritten before they were read (a burst of > buffer size)
        self.reads = 0  # full reads
        self.read_s = 0.0  # time spent in them
        self.paused = False
        self.waiting_since: float | None = None  # when a count moved, unread since
        self.issued = 0  # collectives issued on every group at the last read
        self.issued_now = 0  # ... at the last look
        self.issued_seen = 0  # ... at the look before
        self.counts_seen: Any = None  # the counts at the last look
        # (when, the task thread's line) at each look that saw a count move, since the last read
        self.sites: list[tuple[int, str]] = []
        self._size = process_groups.recorder_size() or process_groups.FLIGHT_RECORDER_ENTRIES
        self._known: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see _facts
        self._dumps = _dump_functions()
        self._stop = threading.Event()
        self._resumed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nblaunch-recorder", daemon=True)

    def start(self) -> None:
        """Skip what earlier tasks recorded, then read in the background."""
        if not self._dumps:
            return
        if self.outbox is not None:
            self.outbox.predicting = True
        with contextlib.suppress(Exception):
            self.counts = self._counts()
            self.issued = self.issued_now = self.issued_seen = _issued(self.counts)
            for entry in self._entries():
                self.newest = max(self.newest, int(entry.get("record_id", -1)))
        self._thread.start()

    def stop(self, error: BaseException | None = None) -> None:
        """Stop the thread; read what the task issued last (its final calls). ``error``: what
        the task raised, whose line the entries not yet placed were made under."""
        self._stop.set()
        self._resumed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():  # never two readers sending at once
            if error is not None:  # the thread has left the task: its error's line is a look
                self.sites.append((time.time_ns(), _error_site(error)))  # after all it made
            with contextlib.suppress(Exception):
                self.read()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.paused:
                self._resumed.wait()  # not even a look meanwhile: as if the checks were off
                continue
            try:
                self.read(lazily=True)
            except Exception:
                return  # the launcher went away, or torch's dump failed: nothing to check

    def pause(self) -> None:
        """Stop reading (bench_debug's unchecked blocks); :meth:`resume` skips what came since."""
        self._resumed.clear()
        self.paused = True

    def resume(self) -> None:
        with contextlib.suppress(Exception):
            self.counts = self._counts()
            self.issued = self.issued_now = self.issued_seen = _issued(self.counts)
            for entry in self._entries():
                self.newest = max(self.newest, int(entry.get("record_id", -1)))
        self.paused = False
        self._resumed.set()

    def read(self, lazily: bool = False) -> None:
        """Send the entries recorded since the last read, if a group's count moved; ``lazily``:
        only once the recorder is nearly full of new entries or the oldest new entry waited
        ``MAX_LAG_S`` (see ``POLL_S``)."""
        counts = self._counts()
        if counts != self.counts_seen:  # a count moved since the last look
            self.counts_seen = counts
            # Where the task's thread is now: the line of what torch issued since then.
            self.sites.append((time.time_ns(), _task_site(self.target)))
            issued, self.issued_seen = _issued(counts), self.issued_now
            self.issued_now = issued
        if counts == self.counts:
            return  # nothing new since the last read
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        if lazily:
            # Read before the next look could find entries overwritten: what came since the
            # last look may come again before it, twice over (a late look).
            new = self.issued_now - self.issued
            coming = 2 * max(self.issued_now - self.issued_seen, 0)
            if new + coming < self._size and time.monotonic() - self.waiting_since < MAX_LAG_S:
                return
        self.counts, self.waiting_since = counts, None
        self.issued = self.issued_seen = self.issued_now = _issued(counts)
        began = time.perf_counter()
        newest = self.newest
        entries = [e for e in self._entries() if e.get("record_id", -1) > newest]
        self.reads += 1
        if not entries:
            self.read_s += time.perf_counter() - began
            return
        entries.sort(key=lambda e: e.get("record_id", -1))
        first = int(entries[0].get("record_id", -1))
        if newest >= 0 and first > newest + 1:
            self.lost += first - newest - 1
        self.newest = int(entries[-1].get("record_id", -1))
        sites, self.sites = self.sites, []
        claims = _Claims(self.outbox.claims)
        batch: list[tuple[fingerprints.Route, int, Any]] = []
        for entry in entries:
            if entry.get("is_p2p"):
                continue  # sends and receives differ by design
            name = str((entry.get("process_group") or ("",))[0])
            route = self._route(name)
            if route is None:
                continue
            seq = int(entry.get("collective_seq_id", -1))
            created = int(entry.get("time_created_ns", 0))
            claim = claims.of(name, entry.get("thread_id"), created)
            if claim is not None:
                if not claim.matched:  # its first entry: what the next calls' numbers will be
                    claim.matched = True
                    fingerprints.learn_offset(claim, seq)
                batch.append((route, seq, claim.facts))
            else:
                batch.append((route, seq, self._facts(entry, name, _site_after(sites, created))))
        claims.forget()
        self.outbox.add_recorded(batch)  # one write for them all
        self.sent += len(batch)
        self.read_s += time.perf_counter() - began

    def _counts(self) -> list[bytes]:
        return [status(False, False) for _, status in self._dumps]

    def _entries(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for dump, _ in self._dumps:
            data = pickle.loads(
                dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            )
            entries += data.get("entries") or []
        return entries

    def _route(self, name: str) -> fingerprints.Route | None:
        group = self.groups.get(name)
        if group is None:
            import torch.distributed as dist

            self.groups = {n: g for g, n in dist.distributed_c10d._world.pg_names.items()}
            group = self.groups.get(name)
            if group is None:
                return None
        return self.outbox.route(group)

    def _facts(self, entry: dict[str, Any], group: str, site: str) -> tuple[Any, ...]:
        """The facts (``debug_report.FACTS``) of an entry torch issued itself."""
        sizes = entry.get("input_sizes") or ()
        dtypes = entry.get("input_dtypes") or ()
        name = entry.get("profiling_name", "")
        # (a DDP model made later on the group names its all-reduces from then on)
        key = (group, name, tuple(map(tuple, sizes)), tuple(dtypes), _has_ddp_model(group))
        known = self._known.get(key)  # a training loop's entries repeat: made once each
        if known is None:
            if len(self._known) >= MAX_KNOWN:
                self._known.clear()
            operation = str(name).split(":")[-1] or "collective"
            if operation in ("all_reduce", "allreduce") and key[-1]:
                label = DDP_ALL_REDUCE
            else:
                label = RECORDED.format(operation)
            if operation in SAME_INPUTS:
                shapes = tuple(tuple(int(n) for n in s) for s in sizes)
                names = tuple(DTYPES.get(str(d), str(d)) for d in dtypes)
                known = (label, "same", shapes, names)
            else:
                known = (label, "none", (), ())
            self._known[key] = known
        label, rule, shapes, names = known
        return (label, site, rule, 0, shapes, names, (), None, (), None)


class _Claims:
    """The calls checked in Python (an outbox's claims, oldest first), as one read matches the
    entries it found to them, oldest first (see the module)."""

    def __init__(self, claims: Any) -> None:
        self.claims = claims  # the outbox's deque: the task's thread appends meanwhile
        self.pending = list(claims)
        self.ended = 0  # claims before this one ended before the last entry was made

    def of(self, group: str, thread: Any, created: int) -> fingerprints.Claim | None:
        """The call that issued an entry made at ``created`` (ns) on ``thread`` (its ident, as
        a string) on ``group``, if one did: the one that ran then on that thread."""
        pending = self.pending
        while self.ended < len(pending) and 0 < pending[self.ended].end < created:
            self.ended += 1  # ended before this entry: neither it nor a later one is its
        try:
            ident = int(thread)
        except (TypeError, ValueError):
            return None
        for i in range(self.ended, len(pending)):
            claim = pending[i]
            if claim.start > created:
                break
            if claim.thread == ident and claim.group == group and not 0 < claim.end < created:
                return claim
        return None

    def forget(self) -> None:
        """Drop the calls that ended before the last entry from the outbox's claims."""
        for claim in self.pending[: self.ended]:
            if not self.claims or self.claims[0] is not claim:
                break  # cleared meanwhile (the facts' table was full)
            with contextlib.suppress(IndexError):
                self.claims.popleft()


def _site_after(sites: list[tuple[int, str]], created: int) -> str:
    """The user's line the task's thread was on at the first look after ``created`` (ns) that
    found it on one (a look as the task ends may find it outside the task's code)."""
    for when, site in sites:
        if when >= created and site != UNKNOWN:
            return site
    return sites[-1][1] if sites else UNKNOWN


def _issued(counts: Any) -> int:
    """Collectives issued on every group, from the recorders' counts (``_counts``): a
    look at the counts' JSON for its numbers, a third of parsing it (every look does this)."""
    total = 0
    for status in counts or ():
        for number in _ENQUEUED.findall(status):
            total += max(int(number), 0)
    return total


def _dump_functions() -> list[tuple[Any, Any]]:
    """The recorder dumps this torch has: (full dump, counts only)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return []
    import torch
    import torch._C._distributed_c10d as c10d

    found = []
    for full, counts in DUMPS:
        if full == "_dump_nccl_trace" and not torch.cuda.is_available():
            continue
        if hasattr(c10d, full) and hasattr(c10d, counts):
            found.append((getattr(c10d, full), getattr(c10d, counts)))
    return found


def _has_ddp_model(group: str) -> bool:
    global _ddp_groups
    if _ddp_groups is None:
        from nblaunch.ranks.checks.debug_patches import ddp_groups

        _ddp_groups = ddp_groups()  # the set itself, which DDP models made later join
    return group in _ddp_groups


_ddp_groups: set[str] | None = None


def _task_site(target: int) -> str:
    """The user's line the task's thread is on now (what a collective torch issued from C++ was
    issued under, when the rank still waits in it)."""
    frame = sys._current_frames().get(target)
    try:
        return site_of(frame) if frame is not None else UNKNOWN
    finally:
        del frame


def _error_site(error: BaseException) -> str:
    """The user's line an exception was raised under (its traceback's innermost one)."""
    tb = error.__traceback__
    if tb is None:
        return UNKNOWN
    while tb.tb_next is not None:
        tb = tb.tb_next
    return site_of(tb.tb_frame)


@contextlib.contextmanager
def reading(outbox: fingerprints.Outbox | None) -> Any:
    """Read the recorder for ``outbox``'s task while the block runs."""
    if outbox is None or process_groups.recorder_size() == 0:
        yield None
        return
    global _reader
    reader = _reader = RecorderReader(outbox)
    reader.start()
    error = None
    try:
        yield reader
    except BaseException as raised:
        error = raised
        raise
    finally:
        _reader = None
        reader.stop(error)


_reader: RecorderReader | None = None


def current() -> RecorderReader | None:
    """The running task's reader, while the checks read the recorder."""
    return _reader


def _task_hook(context: this_rank.RankContext) -> contextlib.AbstractContextManager[Any]:
    # Registered after fingerprints' hook (worker.RANK_FEATURES): the task's outbox is open.
    # One rank has nobody to be compared with (no group of it has two ranks): nothing to read,
    # and a thread dumping the recorder beside a one-GPU training loop would cost it for nothing.
    return reading(fingerprints.current() if context.world_size > 1 else None)


this_rank.add_task_hook(_task_hook)
