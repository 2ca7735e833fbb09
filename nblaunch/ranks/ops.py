"""Collectives that check themselves in debug mode, and a synchronised early stop.

The collectives here (:func:`gather`, :func:`broadcast`, :func:`all_reduce`, ...) work on single
tensors or nested lists/tuples/dicts of tensors, inside an nblaunch rank, under torchrun, and in a
plain single process (where they return their input).

**Debug mode** (``notebook_launcher(debug=True)``, ``%%distributed --debug``, ``NBLAUNCH_DEBUG=1``
or Accelerate's ``ACCELERATE_DEBUG_MODE=1``) verifies every collective before it runs: each rank
contributes one small record (operation, call site, shapes, dtypes, device types, arguments such
as ``src``) to a single fixed-size ``all_gather``, and when the records disagree every rank raises
the same :class:`~nblaunch.errors.DistributedOperationException`, instead of hanging or silently
corrupting tensors. Inside ranks, torch.distributed's own collectives (``dist.all_reduce``,
``dist.broadcast``, ...) are patched for the duration of each task while debug mode is on, so
collectives called by user code and libraries are verified too; the patches are removed when the
task ends.

:func:`set_trigger` / :func:`check_trigger` let one rank stop every rank at the same step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nblaunch.errors import DistributedOperationException
from nblaunch.options import debug_from_env
from nblaunch.ranks import worker

# Bytes each rank contributes to the verification all_gather; a record is ~200 bytes, and one
# that does not fit lists fewer tensors (the comparison still uses digests of all of them).
RECORD_BYTES = 2048
# Tensors listed per rank in a record (the rest are summarised).
MAX_LISTED = 16

# torch.distributed collectives verified inside ranks while debug mode is on.
PATCHED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
)

_CELL_FILE = re.compile(r"(ipykernel_\d+[/\\]\d+\.py$)|(^<ipython-input-\d+-)")
# nblaunch's own frames, in any of its packages.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep

# Set while a verified call runs: collectives that torch calls internally (all_gather_object
# calls all_gather) and the verification's own all_gather must not be verified again.
_guard = threading.local()
_trigger = False


# --- debug mode ----------------------------------------------------------------------------------


def debug_enabled() -> bool:
    """True when collectives are verified: the launch's ``debug`` or ``NBLAUNCH_DEBUG``."""
    context = worker.current()
    if context is not None:
        return context.debug
    return debug_from_env()


def _distributed(group: Any = None) -> bool:
    """True when a process group is up and this rank is part of ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_rank(group) >= 0


def _original(name: str) -> Callable[..., Any]:
    """torch.distributed's own function, never the debug-mode wrapper."""
    import torch.distributed as dist

    function = getattr(dist, name)
    return getattr(function, "__nblaunch_original__", function)


def _all_gather_flat() -> Callable[..., Any]:
    """All-gather into one tensor: ``all_gather_single`` where torch has it (the older name
    ``all_gather_into_tensor`` is deprecated there)."""
    import torch.distributed as dist

    return _original(
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )


@contextlib.contextmanager
def _verified_region() -> Iterator[None]:
    previous = getattr(_guard, "active", False)
    _guard.active = True
    try:
        yield
    finally:
        _guard.active = previous


def call_site() -> str:
    """Where user code called into the collective: ``train.py:12`` or ``cell line 4``.

    Frames of nblaunch, torch and the standard library are skipped, so a collective that a library
    calls is reported at the library's line.
    """
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_PACKAGE_DIR, torch_dir, _STDLIB_DIR)):
            if _CELL_FILE.search(filename):
                return f"cell line {frame.f_lineno}"
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown location"


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

    One fixed-size ``all_gather`` of a small record per rank. Every rank receives every record
    and reaches the same verdict, so either all ranks go on or all raise.

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
        On every rank, when the records disagree.
    """
    import torch.distributed as dist

    if not _distributed(group) or dist.get_world_size(group) < 2:
        return
    record = _record(operation, list(inputs), rule, dim, args or {}, problem, outputs)
    with _verified_region():
        records = _exchange(record, group)
    message = mismatch_message(records)
    if message:
        raise DistributedOperationException(message)


def _record(
    operation: str,
    inputs: list[Any],
    rule: str,
    dim: int,
    args: dict[str, Any],
    problem: str | None,
    outputs: list[Any] | None,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    shapes = [list(t.shape) for t in inputs]
    dtypes = [str(t.dtype) for t in inputs]
    devices = [t.device.type for t in inputs]
    if rule == "same_except_dim":
        compared = [
            [("*" if i == dim % max(len(s), 1) else n) for i, n in enumerate(s)] for s in shapes
        ]
    elif rule in ("same", "all_gather", "all_gather_even"):
        compared = shapes
    else:
        compared = []
    return {
        "op": operation,
        "rank": dist.get_rank(),
        "site": call_site(),
        "rule": rule,
        "n": len(inputs),
        "shapes": shapes[:MAX_LISTED],
        "dtypes": dtypes[:MAX_LISTED],
        "devices": devices[:MAX_LISTED],
        "key": {
            "shape": _digest(compared),
            "dtype": _digest(dtypes),
            "device": _digest(devices),
        },
        "out": _digest([list(getattr(t, "shape", ())) for t in outputs])
        if outputs is not None
        else None,
        "args": {k: _plain(v) for k, v in args.items()},
        "problem": problem,
    }


def _digest(value: Any) -> str:
    return hashlib.sha1(json.dumps(value).encode()).hexdigest()[:16]


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
        data = json.dumps(record).encode()[: RECORD_BYTES - 4]
    buffer = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buffer[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    device = _collective_device(group)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    _all_gather_flat()(gathered, buffer.to(device), group=group)
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


def _collective_device(group: Any = None) -> Any:
    """A device every backend of ``group`` can use: CPU for gloo, the rank's GPU for nccl."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    context = worker.current()
    if context is not None and context.device.type == "cuda":
        return context.device
    return torch.device("cuda", torch.cuda.current_device())


# --- the report ---------------------------------------------------------------------------------


def mismatch_message(records: list[dict[str, Any]]) -> str | None:
    """The report for records that disagree, or ``None`` when the call is consistent."""
    first = records[0]
    if len({r["op"] for r in records}) > 1:
        said = (" while " if len(records) == 2 else ", ").join(
            f"rank {r['rank']} {_entered(r['op'])} at {r['site']}" for r in records
        )
        return (
            "Cannot apply desired operation: processes called different collectives at the same "
            f"step ({said}).\n\nOperations:\n"
            + "".join(
                f"  - Process {r['rank']}: `{r['op']}` at {r['site']}, input shapes "
                f"{_listing(r, 'shapes')}\n"
                for r in records
            )
            + "\nEvery rank must call the same collectives in the same order; look for a branch "
            "on the rank or a loop that runs a different number of times on some ranks."
        )
    operation = first["op"]
    for name in sorted({k for r in records for k in r["args"]}):
        values = [r["args"].get(name) for r in records]
        if any(v != values[0] for v in values):
            return _table(
                f"Cannot apply desired operation due to argument mismatches. Every process must "
                f"pass the same {name}.",
                operation,
                "Arguments",
                records,
                lambda r, name=name: f"{name}={r['args'].get(name)}",
            )
    if any(r.get("problem") for r in records):
        return _table(
            "Cannot apply desired operation due to invalid arguments.",
            operation,
            "Problems",
            records,
            lambda r: r.get("problem") or "ok",
        )
    rule = first.get("rule", "same")
    if rule in ("all_gather", "all_gather_even"):
        inputs = [r["shapes"][0] if r["shapes"] else [] for r in records]
        if any(r["out"] != _digest(inputs) for r in records):
            return _shape_table(operation, records)
        if rule == "all_gather_even" and _differs(records, "shape"):
            return _shape_table(operation, records)
    elif rule != "none" and _differs(records, "shape"):
        return _shape_table(operation, records)
    if _differs(records, "dtype"):
        return _table(
            "Cannot apply desired operation due to dtype mismatches. All dtypes across devices "
            "must be the same.",
            operation,
            "Input dtypes",
            records,
            lambda r: _listing(r, "dtypes"),
        )
    if _differs(records, "device"):
        return _table(
            "Cannot apply desired operation due to device mismatches. All tensors must be on "
            "the same type of device on every process.",
            operation,
            "Input devices",
            records,
            lambda r: _listing(r, "devices"),
        )
    return None


def _differs(records: list[dict[str, Any]], field: str) -> bool:
    values = [(r.get("n"), r["key"].get(field)) for r in records]
    return any(v != values[0] for v in values)


def _shape_table(operation: str, records: list[dict[str, Any]]) -> str:
    return _table(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices "
        "must be valid.",
        operation,
        "Input shapes",
        records,
        lambda r: _listing(r, "shapes"),
    )


def _table(
    headline: str,
    operation: str,
    what: str,
    records: list[dict[str, Any]],
    cell: Callable[[dict[str, Any]], str],
) -> str:
    lines = [headline, "", f"Operation: `{operation}`", f"{what}:"]
    lines += [f"  - Process {r['rank']}: {cell(r)}" for r in records]
    lines += ["", "Called at:"]
    lines += [f"  - Process {r['rank']}: {r['site']}" for r in records]
    return "\n".join(lines)


def _listing(record: dict[str, Any], field: str) -> str:
    items = record.get(field) or []
    n = record.get("n", len(items))
    if n == 0:
        return "(no tensors)"
    text = ", ".join(_format_item(item) for item in items)
    if n > len(items):
        text += f", ... ({n} tensors)"
    return text


def _format_item(item: Any) -> str:
    if isinstance(item, list):
        return "[" + ", ".join(str(n) for n in item) + "]"
    return str(item)


def _short(operation: str) -> str:
    return operation.rsplit(".", 1)[-1]


def _entered(operation: str) -> str:
    """``called all_reduce``; a collective a library issues itself is ``entered``."""
    if operation == DDP_ALL_REDUCE:
        return f"entered {operation}"
    return f"called {_short(operation)}"


# --- torch.distributed, patched inside ranks in debug mode ---------------------------------------


def _spec(name: str, a: dict[str, Any], world: int, backend: str) -> dict[str, Any]:
    """What to verify for torch.distributed's ``name`` called with bound arguments ``a``."""
    if name == "all_reduce":
        return {"inputs": [a["tensor"]], "args": {"op": a.get("op")}}
    if name == "broadcast":
        return {"inputs": [a["tensor"]], "args": {"src": _first(a, "src", "group_src")}}
    if name == "reduce":
        return {
            "inputs": [a["tensor"]],
            "args": {"dst": _first(a, "dst", "group_dst"), "op": a.get("op")},
        }
    if name == "all_gather":
        outputs = list(a["tensor_list"])
        problem = None
        if len(outputs) != world:
            problem = f"tensor_list has {len(outputs)} tensors for {world} processes"
        return {
            "inputs": [a["tensor"]],
            # NCCL gathers tensors of different sizes into matching outputs; gloo refuses them
            "rule": "all_gather" if "nccl" in backend else "all_gather_even",
            "outputs": outputs,
            "problem": problem,
        }
    if name in ("all_gather_into_tensor", "all_gather_single"):
        out, inp = a["output_tensor"], a["input_tensor"]
        problem = None
        if out.numel() != world * inp.numel():
            problem = (
                f"output_tensor has shape {_format_item(list(out.shape))} but must hold "
                f"{world} x input {_format_item(list(inp.shape))}"
            )
        return {"inputs": [inp], "problem": problem}
    if name == "reduce_scatter":
        inputs = list(a["input_list"])
        problem = None
        if len(inputs) != world:
            problem = f"input_list has {len(inputs)} tensors for {world} processes"
        return {"inputs": [a["output"], *inputs], "args": {"op": a.get("op")}, "problem": problem}
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        out, inp = a["output"], a["input"]
        problem = None
        if inp.numel() != world * out.numel():
            problem = (
                f"input has shape {_format_item(list(inp.shape))} but must hold "
                f"{world} x output {_format_item(list(out.shape))}"
            )
        return {"inputs": [inp], "args": {"op": a.get("op")}, "problem": problem}
    if name == "gather":
        return {"inputs": [a["tensor"]], "args": {"dst": _first(a, "dst", "group_dst")}}
    if name == "scatter":
        return {"inputs": [a["tensor"]], "args": {"src": _first(a, "src", "group_src")}}
    if name == "all_to_all_single":
        return {"inputs": [a["input"]], "rule": "same_except_dim", "dim": 0}
    if name == "all_to_all":
        return {"inputs": list(a["input_tensor_list"]), "rule": "dtype"}
    if name == "all_gather_object":
        problem = None
        if len(a["object_list"]) != world:
            problem = f"object_list has {len(a['object_list'])} slots for {world} processes"
        return {"rule": "none", "problem": problem}
    if name == "broadcast_object_list":
        return {
            "rule": "none",
            "args": {
                "src": _first(a, "src", "group_src"),
                "len(object_list)": len(a["object_list"]),
            },
        }
    if name == "gather_object":
        return {"rule": "none", "args": {"dst": _first(a, "dst", "group_dst")}}
    if name == "scatter_object_list":
        return {"rule": "none", "args": {"src": _first(a, "src", "group_src")}}
    return {"rule": "none"}  # barrier


def _first(arguments: dict[str, Any], *names: str) -> Any:
    for name in names:
        if arguments.get(name) is not None:
            return arguments[name]
    return None


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def verified(*args: Any, **kwargs: Any) -> Any:
        if getattr(_guard, "active", False):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            group = bound.arguments.get("group")
            ready = _distributed(group)
        except (TypeError, ValueError, RuntimeError):
            ready = False  # let torch report a bad call in its own words
        if not ready:
            return original(*args, **kwargs)
        import torch.distributed as dist

        try:
            backend = str(dist.get_backend(group)).lower()
            spec = _spec(name, bound.arguments, dist.get_world_size(group), backend)
        except (AttributeError, KeyError, TypeError):
            return original(*args, **kwargs)  # not tensors where torch wants them: torch says so
        verify(f"torch.distributed.{name}", group=group, **spec)
        with _verified_region():
            return original(*args, **kwargs)

    verified.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return verified


@contextlib.contextmanager
def verified_collectives() -> Iterator[None]:
    """Verify torch.distributed's own collectives inside this block (debug mode does this).

    Replaces ``torch.distributed.all_reduce``, ``broadcast``, ... (see ``PATCHED``) by wrappers
    that verify each call first, gives every DDP model made inside the block a comm hook that
    verifies its gradient all-reduce (:class:`_VerifiedGradientHook`), and restores the
    originals on exit.
    """
    global _verifying
    import torch.distributed as dist

    saved: dict[str, Any] = {}
    for name in PATCHED:
        original = getattr(dist, name, None)
        if original is None or hasattr(original, "__nblaunch_original__"):
            continue
        saved[name] = original
        setattr(dist, name, _wrap(name, original))
    restore_ddp = _verify_ddp_models()
    previous, _verifying = _verifying, True
    try:
        yield
    finally:
        _verifying = previous
        restore_ddp()
        for name, original in saved.items():
            setattr(dist, name, original)


# --- DDP's gradient all-reduce, verified in debug mode -------------------------------------------
# DDP all-reduces gradients from C++ inside backward(), where no Python collective can be
# patched. Its one Python entry point is the communication hook: debug mode registers one that
# verifies each bucket like any other collective, then all-reduces it as DDP's default does
# (divide by the world size, sum), so the gradients are the same bits as without the hook.

DDP_ALL_REDUCE = "DDP's backward all-reduce"
_verifying = False  # inside verified_collectives(): hooks made earlier stop verifying outside


class _VerifiedGradientHook:
    """A DDP model's comm hook state: verify the bucket, then run the hook the user chose.

    DDP takes one hook per model, and this one is registered first; a hook the user registers
    later (``register_comm_hook``, or a built-in such as FP16 compression) is kept here and runs
    in place of the default all-reduce.
    """

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.user_state: Any = None
        self.user_hook: Callable[[Any, Any], Any] | None = None

    def __call__(self, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if _verifying:
            verify(DDP_ALL_REDUCE, inputs=[bucket.buffer()], group=self.process_group)
        with _verified_region():  # the hook's own all_reduce is not verified again
            if self.user_hook is not None:
                return self.user_hook(self.user_state, bucket)
            return default_hooks.allreduce_hook(self.process_group, bucket)


def _ddp_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP refuses a hook whose ``bucket`` is annotated as anything but GradBucket.
    return state(bucket)


def _verify_ddp_models() -> Callable[[], None]:
    """Patch ``DistributedDataParallel`` so new models get the verifying hook; return the undo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if hasattr(DDP.__init__, "__nblaunch_original__"):
        return lambda: None
    original_init = DDP.__init__
    original_register = DDP.register_comm_hook
    original_builtin = DDP._register_builtin_comm_hook

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._nblaunch_hook = _VerifiedGradientHook(self.process_group)
        original_register(self, self._nblaunch_hook, _ddp_comm_hook)

    @functools.wraps(original_register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        ours = getattr(self, "_nblaunch_hook", None)
        if ours is None or ours.user_hook is not None:
            return original_register(self, state, hook)  # torch explains a second hook
        ours.user_state, ours.user_hook = state, hook

    @functools.wraps(original_builtin)
    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ours = getattr(self, "_nblaunch_hook", None)
        python_hook = {
            "ALLREDUCE": default_hooks.allreduce_hook,
            "FP16_COMPRESS": default_hooks.fp16_compress_hook,
        }.get(getattr(comm_hook_type, "name", ""))
        if ours is None or ours.user_hook is not None or python_hook is None:
            return original_builtin(self, comm_hook_type)
        ours.user_state, ours.user_hook = self.process_group, python_hook

    __init__.__nblaunch_original__ = original_init  # type: ignore[attr-defined]
    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = register_builtin_comm_hook

    def restore() -> None:
        DDP.__init__ = original_init
        DDP.register_comm_hook = original_register
        DDP._register_builtin_comm_hook = original_builtin

    return restore


def _task_hook(context: worker.RankContext) -> contextlib.AbstractContextManager[Any]:
    global _trigger
    _trigger = False  # a trigger set in a previous cell must not stop this one
    if context.debug:
        return verified_collectives()
    return contextlib.nullcontext()


worker.add_task_hook(_task_hook)


# --- the collectives -----------------------------------------------------------------------------


def _tensors(data: Any) -> list[Any]:
    """The tensors in a nested list/tuple/dict, in order."""
    import torch

    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, (list, tuple)):
        return [t for item in data for t in _tensors(item)]
    if isinstance(data, dict):
        return [t for item in data.values() for t in _tensors(item)]
    return []


def _map(function: Callable[[Any], Any], data: Any, operation: str) -> Any:
    import torch

    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, (list, tuple)):
        mapped = [_map(function, item, operation) for item in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    if isinstance(data, dict):
        return type(data)({k: _map(function, v, operation) for k, v in data.items()})
    raise TypeError(
        f"{operation} works on tensors and nested lists/tuples/dicts of tensors, got "
        f"{type(data).__name__}; use gather_object / broadcast_object_list for other objects"
    )


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _distributed() else 1


def gather(tensor: Any) -> Any:
    """Gather ``tensor`` from every rank, concatenated along the first dimension.

    Parameters
    ----------
    tensor
        A tensor, or a nested list/tuple/dict of tensors; the same shapes on every rank.
        A 0-d tensor is gathered as a 1-d tensor of ``world_size`` values.

    Returns
    -------
    The same structure, each tensor ``world_size`` times longer; the input itself outside a
    distributed run.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when ranks pass different shapes, dtypes or devices.
    """
    import torch

    if _world() < 2:
        return tensor
    if debug_enabled():
        verify("nblaunch.ranks.ops.gather", inputs=_tensors(tensor))
    world = _world()
    gather_flat = _all_gather_flat()

    def one(t: Any) -> Any:
        t = (t[None] if t.ndim == 0 else t).contiguous()
        out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        gather_flat(out, t)
        return out

    return _map(one, tensor, "gather")


def gather_object(obj: Any) -> list[Any]:
    """Gather any picklable object from every rank.

    Returns
    -------
    list
        One entry per rank, in rank order; when ``obj`` is a list or tuple on every rank the
        lists are concatenated instead (as Accelerate's ``gather_object`` does).
    """
    import torch.distributed as dist

    if _world() < 2:
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    if debug_enabled():
        verify("nblaunch.ranks.ops.gather_object", rule="none")
    gathered: list[Any] = [None] * dist.get_world_size()
    with _verified_region():
        _original("all_gather_object")(gathered, obj)
    if all(isinstance(item, (list, tuple)) for item in gathered):
        return [x for item in gathered for x in item]
    return gathered


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy ``tensor`` from rank ``from_process`` into ``tensor`` on every other rank (in place).

    Every rank must pass tensors of the same shapes and dtypes: torch does not check this, and
    gloo silently fills only part of a larger tensor. Debug mode checks it.

    Returns
    -------
    ``tensor``, filled with rank ``from_process``'s values.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when shapes, dtypes, devices or ``from_process`` differ.
    """
    if _world() < 2:
        return tensor
    if debug_enabled():
        verify(
            "nblaunch.ranks.ops.broadcast",
            inputs=_tensors(tensor),
            args={"from_process": from_process},
        )
    send = _original("broadcast")
    _map(lambda t: send(t, src=from_process), tensor, "broadcast")
    return tensor


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` on every rank by those of rank ``from_process``.

    Every rank must pass a list of the same length (checked in debug mode).
    """
    if _world() < 2:
        return object_list
    if debug_enabled():
        verify(
            "nblaunch.ranks.ops.broadcast_object_list",
            rule="none",
            args={"from_process": from_process, "len(object_list)": len(object_list)},
        )
    with _verified_region():
        _original("broadcast_object_list")(object_list, src=from_process)
    return object_list


_REDUCTIONS = ("sum", "mean", "max", "min", "product")


def _reduce_op(reduction: str) -> Any:
    import torch.distributed as dist

    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    return {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }[reduction]


def all_reduce(tensor: Any, op: str = "sum") -> Any:
    """Reduce ``tensor`` across ranks in place; every rank gets the result.

    Parameters
    ----------
    tensor
        A tensor or nested structure of tensors, the same shapes on every rank.
    op
        ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when shapes, dtypes, devices or ``op`` differ.
    """
    reduce_op = _reduce_op(op)
    if _world() < 2:
        return tensor
    if debug_enabled():
        verify("nblaunch.ranks.ops.all_reduce", inputs=_tensors(tensor), args={"op": op})
    world = _world()
    send = _original("all_reduce")

    def one(t: Any) -> Any:
        send(t, op=reduce_op)
        if op == "mean":
            t.div_(world) if t.is_floating_point() else t.floor_divide_(world)
        return t

    _map(one, tensor, "all_reduce")
    return tensor


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce a copy of ``tensor`` across ranks (like Accelerate's ``reduce``); input unchanged.

    Parameters
    ----------
    reduction
        ``"mean"`` (default), ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
    scale
        Multiplies the result.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when shapes, dtypes, devices or ``reduction`` differ.
    """
    reduce_op = _reduce_op(reduction)
    world = _world()
    if world >= 2 and debug_enabled():
        verify("nblaunch.ranks.ops.reduce", inputs=_tensors(tensor), args={"reduction": reduction})
    send = _original("all_reduce") if world >= 2 else None

    def one(t: Any) -> Any:
        t = t.clone()
        if send is not None:
            send(t, op=reduce_op)
            if reduction == "mean":
                t = t / world
        return t * scale if scale != 1.0 else t

    return _map(one, tensor, "reduce")


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad ``tensor`` along ``dim`` to the largest size any rank has, so it can be gathered.

    Parameters
    ----------
    dim
        The dimension that may differ between ranks; all others must match.
    pad_index
        The value to pad with.
    pad_first
        Pad at the start instead of the end.

    Raises
    ------
    DistributedOperationException
        In debug mode, on every rank, when dimensions other than ``dim`` differ.
    """
    import torch

    if _world() < 2:
        return tensor
    if debug_enabled():
        verify(
            "nblaunch.ranks.ops.pad_across_processes",
            inputs=_tensors(tensor),
            rule="same_except_dim",
            dim=dim,
            args={"dim": dim},
        )
    world = _world()
    gather_sizes = _all_gather_flat()

    def one(t: Any) -> Any:
        if t.ndim == 0 or dim >= t.ndim or dim < -t.ndim:
            return t
        size = torch.tensor(t.shape, device=t.device, dtype=torch.int64)
        sizes = torch.empty(world * t.ndim, device=t.device, dtype=torch.int64)
        gather_sizes(sizes, size)
        longest = int(sizes.view(world, t.ndim)[:, dim].max())
        if longest == t.shape[dim]:
            return t
        new_shape = list(t.shape)
        new_shape[dim] = longest
        padded = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        start = longest - t.shape[dim] if pad_first else 0
        index[dim] = slice(start, start + t.shape[dim])
        padded[tuple(index)] = t
        return padded

    return _map(one, tensor, "pad_across_processes")


# --- synchronised early stop ----------------------------------------------------------------------


def set_trigger() -> None:
    """Ask every rank to stop: the next :func:`check_trigger` returns True on all of them.

    Any rank may call it, e.g. the one whose validation loss stopped improving.
    """
    global _trigger
    _trigger = True


def check_trigger() -> bool:
    """True on every rank, at the same step, once any rank called :func:`set_trigger`.

    One small ``all_reduce``; every rank must call it at the same step. The trigger is reset
    when it fires (and at the start of every task).

    Raises
    ------
    DistributedOperationException
        In debug mode, when other ranks make a different collective call at this step.
    """
    global _trigger
    import torch

    if _world() < 2:
        fired = _trigger
    else:
        if debug_enabled():
            verify("nblaunch.ranks.ops.check_trigger", rule="none")
        flag = torch.tensor([1 if _trigger else 0], dtype=torch.int32, device=_collective_device())
        _original("all_reduce")(flag)
        fired = bool(flag.item())
    if fired:
        _trigger = False
    return fired
