"""torch.distributed and DDP's gradient all-reduce, verified inside ranks while checks are on.

nblaunch's own collectives (:mod:`nblaunch.ranks.ops`) verify themselves. So that collectives
called by user code and libraries are verified too, torch.distributed's own collectives
(``dist.all_reduce``, ``dist.broadcast``, ...) are patched for the duration of each task while
debug mode or the out-of-band checks (the default) are on; the patches are removed when the task
ends (a task hook does both). :func:`nblaunch.ranks.checks.debug_mode.verify` decides how: before
the call (debug mode) or by sending its record to the launcher (the checks).

DDP's gradient all-reduce runs in C++. Debug mode gives every DDP model made in the task a comm
hook that verifies each bucket before it is reduced. The out-of-band checks install no hook
(it cost a DDP step 5-20%: a Python call per bucket, and the scaling DDP fuses into its copy):
they read DDP's all-reduces from torch's flight recorder (:mod:`nblaunch.ranks.checks.recorder`),
and only note which process groups have a DDP model (:func:`ddp_groups`), so that an all-reduce
torch issued on one is named as DDP's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks import fingerprints
from nblaunch.ranks.checks.debug_mode import in_group, in_verified_region, verified_region, verify
from nblaunch.ranks.checks.debug_report import DDP_ALL_REDUCE, format_shape

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

# Those made of several torch calls (sizes, then data): an interrupt waits for the last one.
COMPOUND = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


# --- torch.distributed ---------------------------------------------------------------------------


def _spec(name: str, a: dict[str, Any], world: int, backend: str) -> dict[str, Any]:
    """What to verify for torch.distributed's ``name`` called with bound arguments ``a``."""
    if name == "all_reduce":
        return {"inputs": [a["tensor"]], "args": {"op": a.get("op")}}
    if name == "broadcast":
        return {"inputs": [a["tensor"]], "args": {"src": _root(a, "src", "group_src")}}
    if name == "reduce":
        return {
            "inputs": [a["tensor"]],
            "args": {"dst": _root(a, "dst", "group_dst"), "op": a.get("op")},
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
                f"output_tensor has shape {format_shape(list(out.shape))} but must hold "
                f"{world} x input {format_shape(list(inp.shape))}"
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
                f"input has shape {format_shape(list(inp.shape))} but must hold "
                f"{world} x output {format_shape(list(out.shape))}"
            )
        return {"inputs": [inp], "args": {"op": a.get("op")}, "problem": problem}
    if name == "gather":
        return {"inputs": [a["tensor"]], "args": {"dst": _root(a, "dst", "group_dst")}}
    if name == "scatter":
        return {"inputs": [a["tensor"]], "args": {"src": _root(a, "src", "group_src")}}
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
                "src": _root(a, "src", "group_src"),
                "len(object_list)": len(a["object_list"]),
            },
        }
    if name == "gather_object":
        return {"rule": "none", "args": {"dst": _root(a, "dst", "group_dst")}}
    if name == "scatter_object_list":
        return {"rule": "none", "args": {"src": _root(a, "src", "group_src")}}
    return {"rule": "none"}  # barrier


def _root(arguments: dict[str, Any], name: str, group_name: str) -> Any:
    """The call's root as a global rank, whether it was given as one (``src``) or as its rank
    in the group (``group_src``): records compare alike, and a release knows its root."""
    if arguments.get(name) is not None:
        return arguments[name]
    value = arguments.get(group_name)
    if value is None:
        return None
    import torch.distributed as dist

    try:
        group = arguments.get("group") or dist.distributed_c10d._get_default_group()
        return dist.get_global_rank(group, value)
    except (RuntimeError, ValueError, AttributeError):
        return value


def _binder(original: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """What ``inspect.signature(original).bind(...)`` with its defaults gives, as a dict, or None
    for a call that does not fit (torch then explains it): the same, in a tenth of the time
    (every checked torch.distributed call pays it)."""
    signature = inspect.signature(original)
    parameters = list(signature.parameters.values())
    kinds = {p.kind for p in parameters}
    if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds:

        def bind_slowly(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return None
            bound.apply_defaults()
            return dict(bound.arguments)

        return bind_slowly
    positional = [p.name for p in parameters if p.kind != inspect.Parameter.KEYWORD_ONLY]
    by_keyword = {p.name for p in parameters if p.kind != inspect.Parameter.POSITIONAL_ONLY}
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    required = [p.name for p in parameters if p.default is p.empty]

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(args) > len(positional) or not by_keyword.issuperset(kwargs):
            return None
        arguments = dict(defaults)
        arguments.update(zip(positional[: len(args)], args, strict=True))
        if kwargs:
            if any(name in kwargs for name in positional[: len(args)]):
                return None  # given twice
            arguments.update(kwargs)
        if any(name not in arguments for name in required):
            return None
        return arguments

    return bind


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    bind = _binder(original)
    operation = f"torch.distributed.{name}"

    @functools.wraps(original)
    def verified(*args: Any, **kwargs: Any) -> Any:
        if in_verified_region():
            return original(*args, **kwargs)
        arguments = bind(args, kwargs)
        if arguments is None:
            return original(*args, **kwargs)  # let torch report a bad call in its own words
        group = arguments.get("group")
        outbox = fingerprints.current()
        if outbox is not None:  # the out-of-band checks: torch asked once per group
            route = outbox.route(group)
            ready, world = route is not None, route.size if route is not None else 0
        else:
            ready, world = _ready(group)
        if not ready:
            return original(*args, **kwargs)
        try:
            spec = _spec(name, arguments, world, _backend(group) if name == "all_gather" else "")
        except (AttributeError, KeyError, TypeError):
            return original(*args, **kwargs)  # not tensors where torch wants them: torch says so
        verify(operation, group=group, **spec)
        whole = this_rank.interrupts_deferred() if name in COMPOUND else contextlib.nullcontext()
        with verified_region(), whole:
            return original(*args, **kwargs)

    verified.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return verified


def _ready(group: Any) -> tuple[bool, int]:
    """Whether this rank can check a call on ``group``, and the group's size."""
    import torch.distributed as dist

    try:
        if in_group(group):
            return True, dist.get_world_size(group)
    except (TypeError, ValueError, RuntimeError):
        pass  # let torch report a bad call in its own words
    return False, 0


def _backend(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


@contextlib.contextmanager
def verified_collectives(ddp_hook: bool | None = None) -> Iterator[None]:
    """Verify torch.distributed's own collectives inside this block (debug mode does this).

    Replaces ``torch.distributed.all_reduce``, ``broadcast``, ... (see ``PATCHED``) by wrappers
    that verify each call first, gives every DDP model made inside the block in debug mode a
    comm hook that verifies its gradient all-reduce (:class:`_VerifiedGradientHook`; with the
    out-of-band checks, DDP is only noted, see the module), and restores the originals on exit.
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
    restore_ddp = _verify_ddp_models(hook=_debugging() if ddp_hook is None else ddp_hook)
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
# (multiply by 1/world size, sum), so the gradients are the same bits as without the hook.

_verifying = False  # inside verified_collectives(): hooks made earlier stop verifying outside


class _VerifiedGradientHook:
    """A DDP model's comm hook state: verify the bucket, then run the hook the user chose.

    DDP takes one hook per model, and this one is registered first; a hook the user registers
    later (``register_comm_hook``, or a built-in such as FP16 compression) is kept here and runs
    in place of the default all-reduce.
    """

    def __init__(self, process_group: Any, model: Any = None) -> None:
        self.process_group = process_group
        self.size = process_group.size()
        self.scale = 1.0 / self.size
        self.user_state: Any = None
        self.user_hook: Callable[[Any, Any], Any] | None = None
        self.model = weakref.ref(model) if model is not None else lambda: None

    def first_step(self) -> bool:
        """True in a backward that DDP follows with a rebuild of its buckets (its first)."""
        return first_step(self.model())

    def __call__(self, bucket: Any) -> Any:
        tensor = bucket.buffer()
        if _verifying:
            hook = self.user_hook
            # What a pool's release of this call must know (nblaunch.ranks.release): another
            # hook's all-reduce may differ from the buffer (fp16 compression), and a first step
            # is followed by collectives out of the checks' sight.
            said = {} if hook is None or _is_allreduce_hook(hook) else {"hook": _name(hook)}
            if self.first_step():
                said["first step"] = True
            verify(DDP_ALL_REDUCE, inputs=[tensor], group=self.process_group, args=said)
        if self.user_hook is not None:
            with verified_region():  # the hook's own all_reduce is not verified again
                return self.user_hook(self.user_state, bucket)
        # DDP's C++ default, from Python: scale by 1/size (the same bits as its scaling copy;
        # a division costs twice a multiplication), then the group's own allreduce, not
        # dist.all_reduce (patched, and logged), with a module-level callback. Every step pays
        # this hook in place of the default.
        tensor.mul_(self.scale)
        return self.process_group.allreduce([tensor]).get_future().then(_first_tensor)


def _first_tensor(future: Any) -> Any:
    return future.value()[0]  # the bucket, summed (a list of one tensor otherwise)


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _is_allreduce_hook(hook: Any) -> bool:
    """True for torch's own all-reduce hook: registered by hand, it does what the default does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return hook is default_hooks.allreduce_hook


def _ddp_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP refuses a hook whose ``bucket`` is annotated as anything but GradBucket.
    return state(bucket)


def first_step(model: Any) -> bool:
    """True while DDP ``model`` has not taken its first backward: DDP rebuilds its buckets
    after it, and the next forward broadcasts them, a collective no record shows."""
    if model is None or getattr(model, "_has_rebuilt_buckets", True):
        return False
    return bool(getattr(model, "static_graph", False)) or not getattr(
        model, "find_unused_parameters", False
    )


# The DDP models made in tasks with checks on (debug mode's or the out-of-band ones).
_ddp_models: weakref.WeakSet[Any] = weakref.WeakSet()


def ddp_models(group: str | None = None) -> list[Any]:
    """The live DDP models made in tasks with checks on; those on process group ``group``."""
    models = []
    for model in list(_ddp_models):
        name = getattr(getattr(model, "process_group", None), "group_name", None)
        if group is None or name == group:
            models.append(model)
    return models


# The process groups that DDP models made in this process all-reduce on, kept after the models
# are gone: the flight recorder's reader names their all-reduces after a model may have been
# deleted, and every rank must name them alike.
_ddp_groups: set[str] = set()


def ddp_groups() -> set[str]:
    """The names of the process groups that DDP models made in this process all-reduce on."""
    return _ddp_groups


def _debugging() -> bool:
    context = this_rank.current()
    return context is not None and bool(context.debug)


def _verify_ddp_models(hook: bool = True) -> Callable[[], None]:
    """Patch ``DistributedDataParallel`` so new models are noted and, with ``hook``, get the
    verifying hook; return the undo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if hasattr(DDP.__init__, "__nblaunch_original__"):
        return lambda: None
    original_init = DDP.__init__
    original_register = DDP.register_comm_hook
    original_builtin = DDP._register_builtin_comm_hook

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _ddp_models.add(self)
        _ddp_groups.add(str(getattr(self.process_group, "group_name", "")))
        if hook:
            self._nblaunch_hook = _VerifiedGradientHook(self.process_group, self)
            original_register(self, self._nblaunch_hook, _ddp_comm_hook)

    if not hook:  # DDP's own all-reduce, and the user's hook as the user registered it
        __init__.__nblaunch_original__ = original_init  # type: ignore[attr-defined]
        DDP.__init__ = __init__

        def restore_init() -> None:
            DDP.__init__ = original_init

        return restore_init

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


def _task_hook(context: this_rank.RankContext) -> contextlib.AbstractContextManager[Any]:
    if context.debug or context.options.get("checks"):
        return verified_collectives(ddp_hook=bool(context.debug))
    return contextlib.nullcontext()


this_rank.add_task_hook(_task_hook)
