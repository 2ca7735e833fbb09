"""Releasing peers from collectives that a rank's ended task still owed them.

When a pool's task ends on one rank (``q`` in its debugger, an exception, an interrupt) while a
peer waits in a collective the first rank never issued, no signal frees the peer: it waits in C
until the collective completes. The launcher knows from the out-of-band checks
(:mod:`nblaunch.ranks.checks.fingerprints`) exactly which calls each rank issued on each group, so
it sends the rank whose task ended a ``release`` message: the calls it owes, in order. This module
issues them with throwaway tensors of the recorded shapes and dtypes, with the same operation,
group, root and reduce op, so the peer's call completes (with meaningless values, as an
interrupted step has) and the group's own numbering stays in step for the next cell. The peer
was interrupted first, so it raises ``KeyboardInterrupt`` as soon as its call returns and keeps
its names. The launcher decides which calls are owed; :func:`unsupported` says which it cannot
ask for, so that the pool falls back to a restart and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nblaunch.events import Released
from nblaunch.ranks import this_rank
from nblaunch.ranks.checks.debug_report import DDP_ALL_REDUCE

# How long one release may wait for its peers (they are waiting already: it is quick).
RELEASE_TIMEOUT_S = 10.0

_TORCH = "torch.distributed."
_OPS = "nblaunch.ranks.ops."
# Calls released with throwaway tensors of the recorded shapes.
_TENSOR_CALLS = {
    _TORCH + name
    for name in (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "gather",
        "scatter",
    )
} | {DDP_ALL_REDUCE, _OPS + "all_reduce", _OPS + "reduce", _OPS + "broadcast", _OPS + "gather"}
# Calls whose payload is pickled objects: released with ``None`` objects.
_OBJECT_CALLS = {
    _TORCH + name
    for name in (
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
    )
} | {_OPS + "gather_object", _OPS + "broadcast_object_list"}
_NO_PAYLOAD = {_TORCH + "barrier"}


def unsupported(record: dict[str, Any]) -> str | None:
    """Why the call of ``record`` (debug mode's record) cannot be released; ``None`` if it can."""
    op = record.get("op", "?")
    if op not in _TENSOR_CALLS | _OBJECT_CALLS | _NO_PAYLOAD:
        return f"{op}, which nblaunch cannot release"
    if op in _TENSOR_CALLS and len(record.get("shapes", ())) < record.get("n", 0):
        return f"{op} with {record['n']} tensors (only the first ones' shapes are known)"
    if op == DDP_ALL_REDUCE and record.get("args", {}).get("hook"):
        return f"{op} through the comm hook {record['args']['hook']}"
    if op == DDP_ALL_REDUCE and record.get("args", {}).get("first step"):
        # DDP rebuilds its buckets after its first backward, and broadcasts them in the next
        # forward: released here, one rank would make that broadcast and the others would not.
        return f"{op} of a model's first step, after which DDP rebuilds its buckets"
    return None


def handle(message: dict[str, Any]) -> None:
    """Between tasks, on a rank: issue the calls of a ``release`` message; say how it went."""
    event: Released = {"kind": "released", "rank": this_rank.rank(), "ok": True, "problem": ""}
    try:
        release(message["calls"], message.get("timeout_s", RELEASE_TIMEOUT_S))
    except Exception as exc:
        event.update(ok=False, problem=f"{type(exc).__name__}: {exc}")
    this_rank.emit(event)


def release(calls: list[dict[str, Any]], timeout_s: float) -> None:
    """Issue each call (a ``CollectiveCall`` of the checks: ``group``, ``record``) in order.

    Raises
    ------
    TimeoutError
        A call did not complete within ``timeout_s`` (its peers were not waiting in it).
    LookupError, ValueError
        The call's group is gone, or the call cannot be released.
    """
    from nblaunch.ranks.checks.debug_mode import verified_region

    deadline = time.monotonic() + timeout_s
    with verified_region():  # nothing here is checked or counted: it is not the person's call
        for call in calls:
            problem = unsupported(call["record"]) or _first_ddp_step(call)
            if problem:
                raise ValueError(problem)
            _issue(call["record"], _group(call["group"]), deadline)


def _first_ddp_step(call: dict[str, Any]) -> str | None:
    """Why DDP's all-reduce of ``call`` cannot be released here: this rank's model on its group
    has not taken its first step (the flight recorder's entries do not say; this rank knows)."""
    if call["record"].get("op") != DDP_ALL_REDUCE:
        return None
    from nblaunch.ranks.checks.debug_patches import ddp_models, first_step

    if any(first_step(model) for model in ddp_models(call["group"])):
        return unsupported(dict(call["record"], args={"first step": True}))
    return None


def _group(name: str) -> Any:
    """The process group called ``name`` on this rank."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    for group, group_name in c10d._world.pg_names.items():
        if group_name == name:
            return group
    raise LookupError(f"no process group named {name!r} on rank {this_rank.rank()}")


def _issue(record: dict[str, Any], group: Any, deadline: float) -> None:
    """Issue one throwaway call matching ``record`` on ``group``; wait for it until ``deadline``."""
    import torch
    import torch.distributed as dist

    from nblaunch.ranks.checks.debug_mode import collective_device, unpatched

    op = record["op"]
    device = collective_device(group)
    world = dist.get_world_size(group)
    me = dist.get_rank()
    args = record.get("args", {})
    tensors = [
        torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        for shape, dtype in zip(record.get("shapes", ()), record.get("dtypes", ()), strict=True)
    ]

    def run(name: str, *call_args: Any, **kwargs: Any) -> None:
        work = unpatched(name)(*call_args, group=group, async_op=True, **kwargs)
        _wait(work, deadline, op)

    if op in (_TORCH + "all_reduce", DDP_ALL_REDUCE):
        run("all_reduce", tensors[0], op=_reduce_op(args.get("op")))
    elif op == _TORCH + "broadcast":
        run("broadcast", tensors[0], src=args["src"])
    elif op == _TORCH + "reduce":
        run("reduce", tensors[0], dst=args["dst"], op=_reduce_op(args.get("op")))
    elif op == _TORCH + "all_gather":
        run("all_gather", [torch.zeros_like(tensors[0]) for _ in range(world)], tensors[0])
    elif op in (_TORCH + "all_gather_into_tensor", _TORCH + "all_gather_single"):
        inp = tensors[0]
        out = inp.new_zeros((world * inp.numel(),)) if inp.ndim == 0 else _stacked(inp, world)
        run(op.removeprefix(_TORCH), out, inp)
    elif op == _TORCH + "reduce_scatter":
        run("reduce_scatter", tensors[0], tensors[1:], op=_reduce_op(args.get("op")))
    elif op in (_TORCH + "reduce_scatter_tensor", _TORCH + "reduce_scatter_single"):
        inp = tensors[0]
        out = inp.new_zeros((inp.numel() // world,))
        run(op.removeprefix(_TORCH), out, inp.reshape(-1), op=_reduce_op(args.get("op")))
    elif op == _TORCH + "gather":
        dst = args["dst"]
        gather_list = [torch.zeros_like(tensors[0]) for _ in range(world)] if dst == me else None
        run("gather", tensors[0], gather_list, dst=dst)
    elif op == _TORCH + "scatter":
        src = args["src"]
        scatter_list = [torch.zeros_like(tensors[0]) for _ in range(world)] if src == me else None
        run("scatter", tensors[0], scatter_list, src=src)
    elif op == _TORCH + "barrier":
        run("barrier")
    elif op.startswith(_OPS):
        _release_nblaunch_op(op.removeprefix(_OPS), tensors, args, group)
    else:
        _release_objects(op.removeprefix(_TORCH), args, world, me, group)


def _stacked(tensor: Any, world: int) -> Any:
    return tensor.new_zeros((world * tensor.shape[0], *tensor.shape[1:]))


def _reduce_op(name: Any) -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.SUM if name is None else getattr(dist.ReduceOp, str(name))


def _wait(work: Any, deadline: float, op: str) -> None:
    """Wait for ``work`` until ``deadline``, without blocking past it (a peer may not come)."""
    if work is None:
        return
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{op} did not complete: its peers were not waiting in it")
        time.sleep(0.002)
    work.wait()  # raises what the backend saw


def _release_nblaunch_op(name: str, tensors: list[Any], args: dict[str, Any], group: Any) -> None:
    """nblaunch's own collectives issue one torch call per tensor: the same calls again."""
    from nblaunch.ranks import ops

    if name == "all_reduce":
        ops.all_reduce(tensors, op=args.get("op", "sum"))
    elif name == "reduce":
        ops.reduce(tensors, reduction=args.get("reduction", "mean"))
    elif name == "broadcast":
        ops.broadcast(tensors, from_process=args.get("from_process", 0))
    elif name == "gather":
        ops.gather(tensors)
    elif name == "gather_object":
        ops.gather_object(None)
    elif name == "broadcast_object_list":
        ops.broadcast_object_list([None] * args["len(object_list)"], args.get("from_process", 0))


def _release_objects(name: str, args: dict[str, Any], world: int, me: int, group: Any) -> None:
    """The object collectives size their own messages: ``None`` objects match any."""
    from nblaunch.ranks.checks.debug_mode import unpatched

    call: Callable[..., Any] = unpatched(name)
    if name == "all_gather_object":
        call([None] * world, None, group=group)
    elif name == "broadcast_object_list":
        call([None] * args["len(object_list)"], src=args["src"], group=group)
    elif name == "gather_object":
        dst = args["dst"]
        call(None, [None] * world if dst == me else None, dst=dst, group=group)
    elif name == "scatter_object_list":
        src = args["src"]
        call([None], [None] * world if src == me else None, src=src, group=group)
