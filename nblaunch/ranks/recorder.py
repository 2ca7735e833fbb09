"""The flight recorder's collectives, checked out of band: what DDP, FSDP and C++ code issue.

torch records every collective its process groups issue, from Python or from C++ (DDP's
gradient all-reduce in ``backward()``, its broadcasts, FSDP's all-gathers), in its flight
recorder (on for gloo and NCCL while ``TORCH_FR_BUFFER_SIZE`` > 0; nblaunch turns it on,
:mod:`nblaunch.ranks.process_groups`). While the out-of-band checks are on, a thread of each
task (:class:`RecorderReader`) looks at the groups' counts 50 times a second and reads the
entries made since its last read once half the recorder is new or the oldest is a quarter of a
second old (see ``POLL_S``), and sends each one's fingerprint (operation, input
sizes, dtypes, its number on its group: ``collective_seq_id``) down the checks' pipe
(:mod:`nblaunch.ranks.fingerprints`), where the launcher compares them as it compares the
calls checked in Python (:mod:`nblaunch.engine.checks`). Nothing runs in the training step:
DDP keeps its own C++ all-reduce, and a user's comm hook stays the one DDP reports.

An entry issued by a call checked in Python (``dist.all_reduce``, nblaunch's own collectives)
is sent with that call's facts, so that the report names the call and its line; the entry is
that call's when it was made on the same thread, on the same group, while the call ran (a
:class:`~nblaunch.ranks.fingerprints.Claim`). Any other entry was issued by torch itself: an
all-reduce on a group with a DDP model is DDP's gradient all-reduce; its call site is the line
the task's thread is on when the entry is read (the ``loss.backward()`` a rank waits in).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import sys
import threading
import time
from typing import Any

from nblaunch.ranks import fingerprints, process_groups, this_rank
from nblaunch.ranks.debug_report import DDP_ALL_REDUCE, RECORDED

# How often the thread looks at the groups' counts (a few µs), and when it reads the new entries:
# a read takes about 5 µs per entry the recorder holds (0.32 ms for 64 on this project's CPU),
# however few are new, so it waits until half the recorder is new, or the oldest unread entry is
# ``MAX_LAG_S`` old (a rank that hangs or waits has its last entries read by then).
POLL_S = 0.02
MAX_LAG_S = 0.25
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


def recorder_size(environ: dict[str, str] | None = None) -> int | None:
    """The recorder's size as this process's environment sets it (None: torch's default)."""
    import os

    env = os.environ if environ is None else environ
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = env.get(name)
        if value:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


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
        self.counts_seen: Any = None  # the counts at the last look
        # (when, the task thread's line) at each look that saw a count move, since the last read
        self.sites: list[tuple[int, str]] = []
        self._size = recorder_size() or process_groups.FLIGHT_RECORDER_ENTRIES
        self._dumps = _dump_functions()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nblaunch-recorder", daemon=True)

    def start(self) -> None:
        """Skip what earlier tasks recorded, then read in the background."""
        if not self._dumps:
            return
        if self.outbox is not None:
            self.outbox.predicting = True
        with contextlib.suppress(Exception):
            self.counts = self._counts()
            self.issued = _issued(self.counts)
            for entry in self._entries():
                self.newest = max(self.newest, int(entry.get("record_id", -1)))
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; read what the task issued last (its final calls)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():  # never two readers sending at once
            with contextlib.suppress(Exception):
                self.read()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.paused:
                continue
            try:
                self.read(lazily=True)
            except Exception:
                return  # the launcher went away, or torch's dump failed: nothing to check

    def pause(self) -> None:
        """Stop reading (bench_debug's unchecked blocks); :meth:`resume` skips what came since."""
        self.paused = True

    def resume(self) -> None:
        with contextlib.suppress(Exception):
            self.counts = self._counts()
            self.issued = _issued(self.counts)
            for entry in self._entries():
                self.newest = max(self.newest, int(entry.get("record_id", -1)))
        self.paused = False

    def read(self, lazily: bool = False) -> None:
        """Send the entries recorded since the last read, if a group's count moved; ``lazily``:
        only once half the recorder is new or the oldest new entry waited ``MAX_LAG_S``."""
        counts = self._counts()
        if counts != self.counts_seen:  # a count moved since the last look
            self.counts_seen = counts
            # Where the task's thread is now: the line of what torch issued since then.
            self.sites.append((time.time_ns(), _task_site(self.target)))
        if counts == self.counts:
            return  # nothing new since the last read
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        if lazily:
            new = _issued(counts) - self.issued
            if 2 * new < self._size and time.monotonic() - self.waiting_since < MAX_LAG_S:
                return
        self.counts, self.waiting_since = counts, None
        self.issued = _issued(counts)
        began = time.perf_counter()
        entries = [e for e in self._entries() if int(e.get("record_id", -1)) > self.newest]
        self.reads += 1
        if not entries:
            self.read_s += time.perf_counter() - began
            return
        entries.sort(key=lambda e: int(e.get("record_id", -1)))
        first = int(entries[0].get("record_id", -1))
        if self.newest >= 0 and first > self.newest + 1:
            self.lost += first - self.newest - 1
        self.newest = int(entries[-1].get("record_id", -1))
        sites, self.sites = self.sites, []
        for entry in entries:
            if entry.get("is_p2p"):
                continue  # sends and receives differ by design
            name, _ = [*(str(v) for v in entry.get("process_group") or ()), "", ""][:2]
            route = self._route(name)
            if route is None:
                continue
            seq = int(entry.get("collective_seq_id", -1))
            claim = self._claim(name, entry)
            if claim is not None:
                if not claim.matched:  # its first entry: what the next calls' numbers will be
                    claim.matched = True
                    fingerprints.learn_offset(claim, seq)
                self.outbox.add_recorded(route, seq, claim.facts)
            else:
                site = _site_after(sites, int(entry.get("time_created_ns", 0)))
                self.outbox.add_recorded(route, seq, self._facts(entry, name, site))
            self.sent += 1
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

    def _claim(self, name: str, entry: dict[str, Any]) -> fingerprints.Claim | None:
        """The checked call that issued ``entry``, if one did."""
        created = int(entry.get("time_created_ns", 0))
        try:
            thread = int(entry.get("thread_id", 0))
        except ValueError:
            thread = 0
        claims = self.outbox.claims
        # Calls that ended before this entry cannot have issued it or any later one.
        while claims and claims[0].end and claims[0].end < created:
            with contextlib.suppress(IndexError):
                claims.popleft()
        for claim in list(claims):
            if claim.start > created:
                break
            if claim.group == name and claim.thread == thread and not 0 < claim.end < created:
                return claim
        return None

    def _facts(self, entry: dict[str, Any], group: str, site: str) -> tuple[Any, ...]:
        """The facts (``debug_report.FACTS``) of an entry torch issued itself."""
        operation = str(entry.get("profiling_name", "")).split(":")[-1] or "collective"
        if operation in ("all_reduce", "allreduce") and _has_ddp_model(group):
            label = DDP_ALL_REDUCE
        else:
            label = RECORDED.format(operation)
        shapes: tuple[Any, ...] = ()
        dtypes: tuple[Any, ...] = ()
        rule = "none"
        if operation in SAME_INPUTS:
            rule = "same"
            shapes = tuple(tuple(int(n) for n in s) for s in entry.get("input_sizes") or ())
            dtypes = tuple(DTYPES.get(str(d), str(d)) for d in entry.get("input_dtypes") or ())
        return (label, site, rule, 0, shapes, dtypes, (), None, (), None)


def _site_after(sites: list[tuple[int, str]], created: int) -> str:
    """The line the task's thread was on at the first look after ``created`` (ns)."""
    for when, site in sites:
        if when >= created:
            return site
    return sites[-1][1] if sites else "unknown location"


def _issued(counts: Any) -> int:
    """Collectives issued on every group, from the recorders' counts (``_counts``)."""
    total = 0
    for status in counts or ():
        with contextlib.suppress(Exception):
            for group in (json.loads(status).get("pg_status") or {}).values():
                total += max(int(group.get("last_enqueued_collective", -1)), 0)
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
    from nblaunch.ranks.debug_patches import ddp_groups

    return group in ddp_groups()


def _task_site(target: int) -> str:
    """The user's line the task's thread is on now (what a collective torch issued from C++ was
    issued under, when the rank still waits in it)."""
    from nblaunch.ranks.debug_mode import site_of

    frame = sys._current_frames().get(target)
    try:
        return site_of(frame) if frame is not None else "unknown location"
    finally:
        del frame


@contextlib.contextmanager
def reading(outbox: fingerprints.Outbox | None) -> Any:
    """Read the recorder for ``outbox``'s task while the block runs."""
    if outbox is None or recorder_size() == 0:
        yield None
        return
    global _reader
    reader = _reader = RecorderReader(outbox)
    reader.start()
    try:
        yield reader
    finally:
        _reader = None
        reader.stop()


_reader: RecorderReader | None = None


def current() -> RecorderReader | None:
    """The running task's reader, while the checks read the recorder."""
    return _reader


def _task_hook(context: this_rank.RankContext) -> contextlib.AbstractContextManager[Any]:
    # Registered after fingerprints' hook (worker.RANK_FEATURES): the task's outbox is open.
    return reading(fingerprints.current())


this_rank.add_task_hook(_task_hook)
