"""Collectives on tensors and nested structures of tensors, checked in debug mode.

The collectives here (:func:`gather`, :func:`broadcast`, :func:`all_reduce`, ...) work on single
tensors or nested lists/tuples/dicts of tensors, inside an nblaunch rank, under torchrun, and in a
plain single process (where they return their input). In debug mode each one is verified across
ranks before it runs (:mod:`nblaunch.ranks.checks.debug_mode`), and a mismatch raises the same
:class:`~nblaunch.errors.DistributedOperationException` on every rank instead of hanging.

The synchronised early stop (:func:`~nblaunch.ranks.trigger.set_trigger` /
:func:`~nblaunch.ranks.trigger.check_trigger`) is in :mod:`nblaunch.ranks.trigger`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks.debug_mode import (
    all_gather_flat,
    checks_enabled,
    in_group,
    unpatched,
    verified_region,
    verify,
)


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
    """``function`` on every tensor of ``data`` (one collective each), never stopped half-way
    by an interrupt (see :func:`nblaunch.ranks.this_rank.interrupts_deferred`). The checked
    call's claim on the flight recorder's entries ends with the region (ranks/checks/recorder.py):
    DDP's next all-reduce is not this call's."""
    with verified_region(), this_rank.interrupts_deferred():
        return _map_each(function, data, operation)


def _map_each(function: Callable[[Any], Any], data: Any, operation: str) -> Any:
    import torch

    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, (list, tuple)):
        mapped = [_map_each(function, item, operation) for item in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    if isinstance(data, dict):
        return type(data)({k: _map_each(function, v, operation) for k, v in data.items()})
    raise TypeError(
        f"{operation} works on tensors and nested lists/tuples/dicts of tensors, got "
        f"{type(data).__name__}; use gather_object / broadcast_object_list for other objects"
    )


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if in_group() else 1


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
    if checks_enabled():
        verify("nblaunch.ranks.ops.gather", inputs=_tensors(tensor))
    world = _world()
    gather_flat = all_gather_flat()

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
    if checks_enabled():
        verify("nblaunch.ranks.ops.gather_object", rule="none")
    gathered: list[Any] = [None] * dist.get_world_size()
    with verified_region(), this_rank.interrupts_deferred():
        unpatched("all_gather_object")(gathered, obj)
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
    if checks_enabled():
        verify(
            "nblaunch.ranks.ops.broadcast",
            inputs=_tensors(tensor),
            args={"from_process": from_process},
        )
    send = unpatched("broadcast")
    _map(lambda t: send(t, src=from_process), tensor, "broadcast")
    return tensor


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` on every rank by those of rank ``from_process``.

    Every rank must pass a list of the same length (checked in debug mode).
    """
    if _world() < 2:
        return object_list
    if checks_enabled():
        verify(
            "nblaunch.ranks.ops.broadcast_object_list",
            rule="none",
            args={"from_process": from_process, "len(object_list)": len(object_list)},
        )
    with verified_region(), this_rank.interrupts_deferred():
        unpatched("broadcast_object_list")(object_list, src=from_process)
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
    if checks_enabled():
        verify("nblaunch.ranks.ops.all_reduce", inputs=_tensors(tensor), args={"op": op})
    world = _world()
    send = unpatched("all_reduce")

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
    if world >= 2 and checks_enabled():
        verify("nblaunch.ranks.ops.reduce", inputs=_tensors(tensor), args={"reduction": reduction})
    send = unpatched("all_reduce") if world >= 2 else None

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
    if checks_enabled():
        verify(
            "nblaunch.ranks.ops.pad_across_processes",
            inputs=_tensors(tensor),
            rule="same_except_dim",
            dim=dim,
            args={"dim": dim},
        )
    world = _world()
    gather_sizes = all_gather_flat()

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
