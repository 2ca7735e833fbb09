"""What torch's process groups know about their collectives, read from inside a rank.

Real training issues most collectives from C++ (DDP's gradient all-reduce in ``backward()``, its
bucket rebuild, FSDP's hooks, ``work.wait()``), where no ``torch.distributed`` frame is on the
Python stack. The process groups themselves count what was issued and what completed, and
PyTorch's flight recorder (on for gloo and NCCL when ``TORCH_FR_BUFFER_SIZE`` > 0) keeps the last
collectives with their operation and shapes. :func:`group_status` reads the counts, and the
entries for the groups' names (0.36 ms with 64 entries, so once a heartbeat); :func:`in_flight`
reads the recorder's entry for the collective a rank waits in and names it as a user knows it
("DDP gradient all-reduce").
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks.waits import posted_in_sequence

# Collectives the flight recorder keeps per rank: a hang report needs only the last few.
FLIGHT_RECORDER_ENTRIES = 64
_BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# The default group's name in the recorder's status.
DEFAULT_GROUP = "0"


def enable_flight_recorder(env: dict[str, str]) -> None:
    """Turn the flight recorder on in a rank's environment unless the user chose a size."""
    if not any(env.get(name) for name in _BUFFER_VARIABLES):
        env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def recorder_size(environ: dict[str, str] | None = None) -> int | None:
    """The recorder's size as this process's environment sets it (None: torch's default)."""
    env = os.environ if environ is None else environ
    for name in _BUFFER_VARIABLES:
        value = env.get(name)
        if value:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _dumps(**kwargs: Any) -> list[dict[str, Any]]:
    """Every recorder this torch has (gloo's and NCCL's), unpickled; none when unavailable."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    import torch._C._distributed_c10d as c10d

    dumps = []
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        with contextlib.suppress(Exception):
            dumps.append(pickle.loads(dump(**kwargs)))
    return dumps


def sequence_number(group: Any) -> int | None:
    """``group``'s sequence number (its last collective's, as its backend counts), or ``None``
    where torch has none.

    A group with a backend per device type (``"cpu:gloo,cuda:nccl"``, and what torch sometimes
    makes of ``init_process_group("gloo")`` once the default group was destroyed) has no default
    backend to ask ("ProcessGroup undefined does not yet support sequence numbers"): its
    backend for this rank's device is asked instead.
    """
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:
        pass
    try:
        return int(group._get_backend(this_rank.device())._get_sequence_number_for_group())
    except Exception:
        return None


# Each group destroyed during the task, with its counts just before: torch forgets them with the
# group, and a rank that destroyed its group (the DDP tutorial's clean-up) and returned still
# issued them (a peer waiting in one more is told how many the rank issued).
_destroyed: dict[str, tuple[int, int]] = {}


@contextlib.contextmanager
def _forget_destroyed(context: this_rank.RankContext) -> Iterator[None]:
    _destroyed.clear()
    yield


this_rank.add_task_hook(_forget_destroyed)


def before_destroy() -> None:
    """Keep the groups' counts: ``destroy_process_group`` is about to run (see ``_destroyed``)."""
    with contextlib.suppress(Exception):
        _destroyed.update(group_status() or {})


def group_status() -> dict[str, tuple[int, int]] | None:
    """Per process group (by name, ``"0"`` is the default group): the number of the last
    collective issued and of the last one completed. ``None`` without a process group.

    A group whose last issued collective is past its last completed one has work in flight.
    Collectives only: gloo's counts take in its sends and receives, which are taken out again
    (:func:`nblaunch.ranks.checks.waits.posted_in_sequence`), so that ranks that post unevenly (a
    pipeline's stages) give the same number to the same collective, as its recorder does.
    """
    status: dict[str, tuple[int, int]] = {}
    for recorder, dump in enumerate(_dumps(includeCollectives=True, includeStackTraces=False)):
        for name, group in _status_by_name(recorder, dump).items():
            posted = posted_in_sequence(name)
            issued = int(group.get("last_enqueued_collective", -1)) - posted
            done = max(int(group.get("last_completed_collective", -1)) - posted, -1)
            old = status.get(name, (-1, -1))
            status[name] = (max(old[0], issued), max(old[1], done))
    for name, counts in _destroyed.items():  # gone from the recorder; a group made again wins
        status.setdefault(name, counts)
    return status or None


# (recorder, its number of a process group) -> the group's name. A recorder keys its status by
# its own numbers, which count the groups made in the process; their entries name them. The two
# part when a group is made again (the default group destroyed and made again is named "0"
# again, with the next number) and for names that are not numbers.
_group_names: dict[tuple[int, str], str] = {}


def _status_by_name(recorder: int, dump: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A recorder's status of each group, by the group's name: of the newest group where two
    had one name (the older one was destroyed; its status stays in the recorder)."""
    for entry in dump.get("entries") or []:
        name = str((entry.get("process_group") or ("",))[0])
        _group_names[(recorder, str(entry.get("pg_id")))] = name
    newest: dict[str, tuple[int, dict[str, Any]]] = {}
    for key, group in (dump.get("pg_status") or {}).items():
        name = _group_names.get((recorder, str(key)), str(key))
        number = int(key) if str(key).isdigit() else -1
        if name not in newest or newest[name][0] < number:
            newest[name] = (number, group)
    return {name: group for name, (_, group) in newest.items()}


def pending(
    status: dict[str, tuple[int, int]] | None, *, calling: bool = False
) -> tuple[str, int] | None:
    """The group and number of the oldest collective issued and not completed, if any.

    With ``calling`` (the rank's thread is inside a blocking ``torch.distributed`` call), the
    number is the last one issued on that group instead: the call issued it and waits for it.
    Gloo's count of completed collectives is not reliable there: its worker threads store it
    without ordering, so it can stay one behind (a finished #2 counted as not done) for as long
    as the next collective waits.
    """
    # Collectives are numbered from 1; -1 means none completed yet.
    waiting = [
        (issued if calling else max(done, 0) + 1, name)
        for name, (issued, done) in (status or {}).items()
        if issued > done
    ]
    if not waiting:
        return None
    seq, name = min(waiting, key=lambda item: (item[1] != DEFAULT_GROUP, item[0]))
    return name, seq


@dataclass
class InFlight:
    """A collective a rank issued and that has not completed, as the flight recorder has it."""

    group: str  # process group name, "0" for the default group
    group_desc: str  # "default_pg", or the description a subgroup was created with
    seq: int  # its number on that group
    operation: str  # "all_reduce", "broadcast", ...
    shapes: list[list[int]]  # input tensor shapes
    # NCCL's progress on it, from the recorder's pg_status: "enqueued, not started on the GPU"
    # or "started on the GPU, not completed"; "" where the backend does not say (gloo)
    progress: str = ""


def in_flight(group: str, seq: int) -> InFlight | None:
    """The flight recorder's entry for collective ``seq`` on ``group``; ``None`` when the
    recorder is off or no longer holds it.

    ``seq`` is the number :func:`group_status` gives, the entry's ``collective_seq_id``.
    Where the recorder marks that collective retired (completed) while a later one is not, the
    later one is returned: gloo's count of completed collectives can stay one behind while the
    next one waits (seen once in 30 hangs under load, the entry retired and the count not).

    Read without the issuing stacks: symbolising them takes a second on first use, and the
    waiting thread's own stack says the same.
    """
    for recorder, dump in enumerate(_dumps(includeCollectives=True, includeStackTraces=False)):
        entries = [
            entry
            for entry in dump.get("entries") or []
            if str((entry.get("process_group") or ("",))[0]) == group
        ]
        # The newest group of that name (an older one made its own numbers; see _group_names).
        newest = max((int(entry.get("pg_id", -1)) for entry in entries), default=-1)
        numbered: dict[int, dict[str, Any]] = {}  # this group's entries from seq on
        for entry in entries:
            number = int(entry.get("collective_seq_id", -1))
            # (NCCL records sends and receives too, under the last collective's number)
            if number >= seq and int(entry.get("pg_id", -1)) == newest and not entry.get("is_p2p"):
                numbered[number] = entry
        entry = numbered.get(seq)
        if entry is None:
            continue
        if entry.get("retired"):
            later = [n for n, e in numbered.items() if not e.get("retired")]
            if later:
                seq = min(later)
                entry = numbered[seq]
        desc = str([*(entry.get("process_group") or ()), "", ""][1])
        backend, _, operation = str(entry.get("profiling_name", "")).rpartition(":")
        status = _status_by_name(recorder, dump).get(group) or {}
        return InFlight(
            group,
            desc,
            seq,
            operation or "collective",
            list(entry.get("input_sizes") or []),
            _progress(backend, seq, status),
        )
    return None


def _progress(backend: str, seq: int, status: dict[str, Any]) -> str:
    """Where NCCL is with collective ``seq`` of a group whose recorder status is ``status``
    (``last_enqueued_collective``, ``last_started_collective``, ``last_completed_collective``).
    gloo does not track starts (always -1): nothing to say there."""
    if backend != "nccl":
        return ""
    started = int(status.get("last_started_collective", -1))
    completed = int(status.get("last_completed_collective", -1))
    if completed >= seq:
        return ""
    if started >= seq:
        return "started on the GPU, waiting for its peers"
    return (
        f"enqueued, not started on the GPU: it waits behind earlier work (collective "
        f"#{started} started, #{completed} completed)"
    )


def collective_label(
    operation: str, functions: list[str], files: list[str], checked: str | None = None
) -> str:
    """Name a collective by who issued it, from the functions and files on the issuing stack.

    DDP's reducer issues its gradient all-reduce from C++ during ``backward()``; its forward
    syncs buffers and rebuilds buckets; FSDP's collectives come from its own modules. In debug
    mode the waiting collective may be the check (``nblaunch.ranks.checks.debug_mode.verify``) run
    before the operation ``checked``.
    """
    normalised = [file.replace("\\", "/") for file in files]
    if checked is None:
        return _issuer_label(operation, functions, normalised)
    if "." in checked:  # torch.distributed.<name>: say who called it
        checked = _issuer_label(checked.rsplit(".", 1)[-1], functions, normalised)
    return f"debug mode's check before {checked}"


def _issuer_label(operation: str, functions: list[str], normalised: list[str]) -> str:
    op = operation.replace("_", "-")
    if any("/torch/distributed/fsdp/" in file for file in normalised):
        return f"FSDP {op}"
    ddp = [
        name
        for name, file in zip(functions, normalised, strict=False)
        if file.endswith("torch/nn/parallel/distributed.py")
    ]
    if ddp:
        if "__init__" in ddp or "_sync_module_states" in ddp:
            return f"DDP parameter {op} at construction"
        return f"DDP {op} in forward (bucket rebuild or buffer sync)"
    if "_engine_run_backward" in functions or any(
        file.endswith(("torch/autograd/__init__.py", "torch/autograd/graph.py"))
        for file in normalised
    ):
        return f"DDP gradient {op}" if "all-reduce" in op else f"{op} in backward()"
    return operation
