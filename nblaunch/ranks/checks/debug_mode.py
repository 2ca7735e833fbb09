"""Debug mode: every rank checks a collective call against the others' before it runs.

**Debug mode** (``notebook_launcher(debug=True)``, ``%%distributed --debug``, ``NBLAUNCH_DEBUG=1``
or Accelerate's ``ACCELERATE_DEBUG_MODE=1``) verifies every collective before it runs: each rank
contributes one small record (operation, call site, shapes, dtypes, device types, arguments such
as ``src``) to a single fixed-size ``all_gather``, and when the records disagree every rank raises
the same :class:`~nblaunch.errors.DistributedOperationException`, instead of hanging or silently
corrupting tensors.

Without debug mode the same records are checked out of band (on by default): :func:`verify`
sends this rank's record to the launcher (:mod:`nblaunch.ranks.checks.fingerprints`) and returns at
once; the launcher compares the ranks' records and raises the same exception.

This module owns that check (:func:`verify`) and the helpers every collective of nblaunch shares
(torch's own functions, never debug mode's wrappers). The report's wording is in
:mod:`nblaunch.ranks.checks.debug_report`; torch.distributed and DDP, patched inside ranks while
debug mode is on, in :mod:`nblaunch.ranks.checks.debug_patches`. Heartbeats recognise a rank waiting
in the check by :func:`verify`'s frame (``nblaunch.ranks.heartbeat``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nblaunch.errors import DistributedOperationException
from nblaunch.options import debug_from_env
from nblaunch.ranks import this_rank
from nblaunch.ranks.checks import fingerprints
from nblaunch.ranks.checks.debug_report import FRAME_MARK, mismatch_message, record_of

# Bytes each rank contributes to the verification all_gather; a record is ~200 bytes, and one
# that does not fit lists fewer tensors (the comparison still uses digests of all of them).
RECORD_BYTES = 2048
_CELL_FILE = re.compile(r"(ipykernel_\d+[/\\]\d+\.py$)|(^<ipython-input-\d+-)")
# nblaunch's own frames, in any of its packages.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
UNKNOWN = "unknown location"  # a call site where no frame is the user's
_skipped_dirs: tuple[str, ...] | None = None  # the above and torch's, once torch is imported
_Tensor: Any = None  # torch.Tensor, once a collective was checked
_dtype_names: dict[Any, str] = {}  # str() of each dtype seen: every checked tensor names one
# Call sites named so far, by code object (its id) and line, with the code object and the name:
# every checked collective names its site.
_sites: dict[tuple[int, int], tuple[Any, str, str]] = {}
MAX_SITES = 10_000
# A file of an installed package, and what each file seen was.
_LIBRARY_PATH = re.compile(r"[/\\](site|dist)-packages[/\\]")
_libraries: dict[str, bool] = {}

# Set while a verified call runs: collectives that torch calls internally (all_gather_object
# calls all_gather) and the verification's own all_gather must not be verified again.
_guard = threading.local()


def debug_enabled() -> bool:
    """True when collectives are verified: the launch's ``debug`` or ``NBLAUNCH_DEBUG``."""
    context = this_rank.current()
    if context is not None:
        return context.debug
    return debug_from_env()


def checks_enabled() -> bool:
    """True when collectives are checked: by debug mode, or out of band (the default)."""
    return fingerprints.current() is not None or debug_enabled()


def in_group(group: Any = None) -> bool:
    """True when a process group is up and this rank is part of ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_rank(group) >= 0


def unpatched(name: str) -> Callable[..., Any]:
    """torch.distributed's own function, never the debug-mode wrapper."""
    import torch.distributed as dist

    function = getattr(dist, name)
    return getattr(function, "__nblaunch_original__", function)


def all_gather_flat() -> Callable[..., Any]:
    """All-gather into one tensor: ``all_gather_single`` where torch has it (the older name
    ``all_gather_into_tensor`` is deprecated there)."""
    import torch.distributed as dist

    return unpatched(
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )


def verified_region() -> contextlib.AbstractContextManager[None]:
    """Inside this block, collectives are not verified (they are part of a verified call)."""
    return _VerifiedRegion()


class _VerifiedRegion:
    # A class, not a generator: every checked call enters one.
    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = getattr(_guard, "active", False)
        _guard.active = True

    def __exit__(self, *exc: object) -> None:
        _guard.active = self.previous
        if not self.previous:
            claim = getattr(_guard, "claim", None)
            if claim is not None:  # the checked call is over: what it issued is recorded
                claim.end = time.time_ns()
                _guard.claim = None


def in_verified_region() -> bool:
    """True inside :func:`verified_region` on this thread."""
    return getattr(_guard, "active", False)


def call_site() -> str:
    """Where user code called into the collective: ``train.py:12`` or ``cell line 4``.

    Frames of nblaunch, torch and the standard library are skipped, so a collective that a library
    calls is reported at the library's line.
    """
    return site_of(sys._getframe(1))


def site_of(frame: Any) -> str:
    """The first frame of user code from ``frame`` outwards, as :func:`call_site` names it.

    A collective that a library (a package under site-packages: Accelerate, Transformers,
    Lightning) calls is named at the library's line and at the first frame of the user's code
    further out, which called the library: ``cell line 57, through
    accelerate/utils/operations.py:345``. The name is followed by :data:`FRAME_MARK` and that
    user frame's file, line and function
    (:func:`nblaunch.ranks.checks.debug_report.split_site`), so the notebook can show the user's
    line as the error's traceback.
    """
    global _skipped_dirs
    if _skipped_dirs is None:
        import torch

        torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
        _skipped_dirs = (_PACKAGE_DIR, torch_dir, _STDLIB_DIR)
    library = None
    while frame is not None:
        code = frame.f_code
        # (a forked rank's outermost frame is the forkserver's `python -c` command: no user's)
        if not code.co_filename.startswith(_skipped_dirs) and not (
            frame.f_back is None and code.co_filename == "<string>"
        ):
            name, marked = _site_entry(frame, code)
            if not _is_library(code.co_filename):
                if library is None:
                    return marked
                return f"{name}, through {library}{marked[len(name) :]}"
            if library is None:
                library = name
        frame = frame.f_back
    return UNKNOWN if library is None else library


def _site_entry(frame: Any, code: Any) -> tuple[str, str]:
    """A frame's name in a report, and the same followed by the frame (:data:`FRAME_MARK`)."""
    # By the code's id, kept alive by the entry: hashing a code object hashes its
    # constants (1.6 µs for a 300-line module's).
    line = frame.f_lineno
    entry = _sites.get((id(code), line))
    if entry is None or entry[0] is not code:
        if len(_sites) > MAX_SITES:
            _sites.clear()
        if _is_library(code.co_filename):
            name = marked = _library_name(code.co_filename, line)
        else:
            name = _site_name(code.co_filename, line)
            marked = FRAME_MARK.join((name, code.co_filename, str(line), code.co_name))
        entry = _sites[(id(code), line)] = (code, name, marked)
    return entry[1], entry[2]


def _is_library(filename: str) -> bool:
    """A file of an installed package (not torch's, not nblaunch's: those are skipped)."""
    library = _libraries.get(filename)
    if library is None:
        library = _libraries[filename] = bool(_LIBRARY_PATH.search(filename))
    return library


def _library_name(filename: str, line: int) -> str:
    """``accelerate/utils/operations.py:345``: the path inside site-packages."""
    match = _LIBRARY_PATH.search(filename)
    inside = filename[match.end() :] if match else os.path.basename(filename)
    return f"{inside}:{line}"


def _site_name(filename: str, line: int) -> str:
    if _CELL_FILE.search(filename):
        return f"cell line {line}"
    return f"{os.path.basename(filename)}:{line}"


def verify(
    operation: str,
    *,
    inputs: Sequence[Any] = (),
    rule: str = "same",
    dim: int = 0,
    args: dict[str, Any] | None = None,
    problem: str | None = None,
    outputs: list[Any] | None = None,
    group: Any = None,
) -> None:
    """Check that every rank of ``group`` makes the same collective call; raise if not.

    In debug mode, one fixed-size ``all_gather`` of a small record per rank: every rank
    receives every record and reaches the same verdict, so either all ranks go on or all raise.
    Otherwise the record goes to the launcher, which compares the ranks' records out of band
    (:mod:`nblaunch.ranks.checks.fingerprints`), and this returns at once.

    Parameters
    ----------
    operation
        Shown in the report, e.g. ``"nblaunch.ranks.ops.broadcast"``.
    inputs
        The tensors this rank passes.
    rule
        How input shapes must relate across ranks: ``"same"``; ``"same_except_dim"`` (all but
        ``dim``); ``"all_gather"`` (rank r's ``outputs[j]`` has rank j's input shape);
        ``"all_gather_even"`` (that, and the same input shapes everywhere);
        ``"dtype"`` (only dtypes and devices must agree); ``"none"`` (nothing to compare).
    args
        Arguments that must be equal on every rank (``src``, reduce ``op``, list length).
    problem
        Something wrong that this rank found on its own (a wrong output size).
    outputs
        Output tensors, for ``rule="all_gather"``.
    group
        The process group of the call.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when the records disagree.
    """
    outbox = fingerprints.current()
    if outbox is not None:  # the out-of-band checks (never with debug mode): send, go on
        route = outbox.route(group)
        if route is not None:
            claim = outbox.add(route, _facts(operation, inputs, rule, dim, args, problem, outputs))
            if claim is not None and not in_verified_region():
                previous = getattr(_guard, "claim", None)
                if previous is not None and not previous.end:  # a call that never ran
                    previous.end = claim.start  # (a thread's calls come one after another)
                _guard.claim = claim  # closed when the call's verified region ends
        return
    import torch.distributed as dist

    if not debug_enabled() or not in_group(group) or dist.get_world_size(group) < 2:
        return
    facts = _facts(operation, inputs, rule, dim, args, problem, outputs)
    with verified_region():
        records = _exchange(record_of(facts, dist.get_rank()), group)
    message = mismatch_message(records)
    if message:
        raise DistributedOperationException(message)


def _facts(
    operation: str,
    inputs: Sequence[Any],
    rule: str,
    dim: int,
    args: dict[str, Any] | None,
    problem: str | None,
    outputs: list[Any] | None,
) -> tuple[Any, ...]:
    """The call's facts (``debug_report.FACTS``): plain tuples, the cheapest to build and send
    (every collective pays this with the checks on)."""
    global _Tensor
    if _Tensor is None:
        import torch

        _Tensor = torch.Tensor
    shapes, dtypes, devices = [], [], []  # one loop: comprehensions cost a frame each
    for t in inputs:
        if isinstance(t, _Tensor):
            shapes.append(tuple(t.shape))
            dtype = t.dtype
            name = _dtype_names.get(dtype)
            if name is None:
                name = _dtype_names[dtype] = str(dtype)
            dtypes.append(name)
            devices.append("cpu" if t.is_cpu else t.device.type)  # t.device: a new object
    return (
        operation,
        call_site(),
        rule,
        dim,
        tuple(shapes),
        tuple(dtypes),
        tuple(devices),
        None if outputs is None else tuple([tuple(getattr(t, "shape", ())) for t in outputs]),
        tuple([(k, _plain(v)) for k, v in args.items()]) if args else (),
        problem,
    )


def _plain(value: Any) -> Any:
    """JSON-safe rendering of an argument (a ReduceOp prints as ``SUM``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value).split(".")[-1]


def _exchange(record: dict[str, Any], group: Any) -> list[dict[str, Any]]:
    """All-gather one fixed-size JSON record per rank; return the records in group order."""
    import torch
    import torch.distributed as dist

    data = json.dumps(record).encode()
    if len(data) > RECORD_BYTES - 4:
        record = dict(record, shapes=record["shapes"][:2], dtypes=record["dtypes"][:2])
        record["devices"] = record["devices"][:2]
        record["args"] = {k: str(v)[:40] for k, v in record["args"].items()}
        record["problem"] = (record["problem"] or "")[:200] or None
        record["site"] = record["site"][-120:]
        record["frame"] = None  # the report keeps its text; the traceback does without
        data = json.dumps(record).encode()[: RECORD_BYTES - 4]
    buffer = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buffer[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    device = collective_device(group)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    all_gather_flat()(gathered, buffer.to(device), group=group)
    raw = _to_bytes(gathered)
    records = []
    for i in range(world):
        chunk = raw[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]
        size = int.from_bytes(chunk[:4], "little")
        try:
            records.append(json.loads(chunk[4 : 4 + size]))
        except ValueError:  # a record cut to size: compare what is known
            records.append({"op": "?", "rank": i, "site": "?", "key": {}, "args": {}})
    return records


def _to_bytes(tensor: Any) -> bytes:
    tensor = tensor.cpu()
    try:
        return tensor.numpy().tobytes()
    except RuntimeError:  # torch built without numpy
        return bytes(tensor.tolist())


def collective_device(group: Any = None) -> Any:
    """A device every backend of ``group`` can use: CPU for gloo, the rank's GPU for nccl."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    context = this_rank.current()
    if context is not None and context.device.type == "cuda":
        return context.device
    return torch.device("cuda", torch.cuda.current_device())
