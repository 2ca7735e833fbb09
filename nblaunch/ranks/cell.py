"""A notebook cell on the rank: :class:`CellTask` runs the cell in the rank's namespace.

The notebook builds the task (:mod:`nblaunch.notebook.cell`, which says what travels and
how); the task pickles by reference, so this module is what a rank imports to run it.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import importlib
import itertools
import linecache
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Bound by the task on every rank; never taken from the notebook.
INJECTED_NAMES = ("rank", "local_rank", "world_size", "device")
# Module attributes that describe the notebook itself, not data the cell uses.
MODULE_DUNDERS = frozenset(
    {"__name__", "__doc__", "__builtins__", "__spec__", "__loader__", "__package__", "__file__"}
)
# Where a pool's namespace remembers which values came from the notebook (see _bind_shipped).
_SHIPPED_KEY = "__nblaunch_shipped__"


@dataclass
class CellResult:
    """What the main rank sends back: the last expression and the ``-o`` values, pickled.

    Values are pickled on the rank, one by one, so a value that cannot travel is named there.
    """

    value: bytes | None = None  # None: the cell did not end with an expression
    outputs: dict[str, bytes] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # -o names the cell did not define


@dataclass
class ModuleRef:
    """A module the cell uses, sent by name and imported on the rank."""

    name: str

    def resolve(self, variable: str) -> types.ModuleType:
        try:
            return importlib.import_module(self.name)
        except ImportError as exc:
            raise ImportError(
                f"the cell uses {variable!r}, the module {self.name!r}, which cannot be "
                f"imported on this rank: {exc}"
            ) from exc


class _ReprOnly:
    """Stands in for a last-expression value that cannot travel back: shows its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


@dataclass
class CellTask:
    """A cell ready to run on the ranks; call it on each rank (it pickles by reference).

    Attributes
    ----------
    source
        The cell body (without the ``%%distributed`` line).
    filename
        The name the cell is compiled under; the notebook's ``linecache`` holds ``display``
        under it, so tracebacks show the cell's lines.
    display
        The text registered under ``filename`` (the magic line and the body).
    first_line
        Line number of the body's first line in ``display``.
    shipped
        The notebook names the cell reads, pickled together (see the module docstring).
    names
        Those names, for messages.
    outputs
        ``-o`` names to bring back from the main rank.
    main_rank
        The rank whose last expression and outputs come back.
    quiet
        The cell ends with ``;``: its last expression is not displayed.
    """

    source: str
    filename: str
    display: str
    first_line: int = 1
    shipped: bytes = b""
    names: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    main_rank: int = 0
    quiet: bool = False

    def __call__(self, namespace: dict[str, Any] | None = None) -> CellResult | None:
        """Run the cell on this rank (see the module docstring for ``namespace``)."""
        import cloudpickle

        from nblaunch import pickling
        from nblaunch.ranks import this_rank

        context = this_rank.current()
        if context is None:  # called in-process (tests, a single process): rank 0 of 1
            injected = {"rank": 0, "local_rank": 0, "world_size": 1, "device": this_rank.device()}
        else:
            injected = {
                "rank": context.rank,
                "local_rank": context.local_rank,
                "world_size": context.world_size,
                "device": context.device,
            }
        _register_source(self.filename, self.display)
        shipped = cloudpickle.loads(self.shipped) if self.shipped else {}
        for name, value in shipped.items():
            if isinstance(value, ModuleRef):
                shipped[name] = value.resolve(name)
        if namespace is None:
            namespace = _notebook_globals(shipped.values())
            namespace.update(shipped)
        else:
            _bind_shipped(namespace, shipped)
        namespace.setdefault("__name__", "__main__")
        namespace.setdefault("__builtins__", builtins)
        namespace.update(injected)
        for other in _globals_of(shipped.values()):
            other.update(injected)  # notebook classes' methods see the rank too
        value = _run(self.source, self.filename, self.first_line, namespace)
        if injected["rank"] != self.main_rank:
            return None
        result = CellResult()
        if value is not None and not self.quiet:
            value = to_notebook(value)
            try:
                result.value = pickling.dumps(value)
            except Exception as exc:  # only its text is needed for display
                result.value = pickling.dumps(
                    _ReprOnly(f"{value!r}\n(shown as text: {type(exc).__name__}: {exc})")
                )
        for name in self.outputs:
            if name not in namespace:
                result.missing.append(name)
                continue
            output = to_notebook(namespace[name])
            try:
                result.outputs[name] = pickling.dumps(output)
            except Exception as exc:
                raise TypeError(
                    f"-o {name}: rank {injected['rank']}'s {name} (a {type_name(output)}) "
                    f"cannot be sent back to the notebook: {type(exc).__name__}: {exc}. "
                    "Return plain data, tensors or a state_dict instead"
                ) from None
        return result


def _register_source(filename: str, text: str) -> None:
    """Put the cell in ``linecache`` so tracebacks formatted on the rank show its lines."""
    lines = [line + "\n" for line in text.splitlines()]
    # mtime None: linecache.checkcache never drops it (IPython caches its cells the same way).
    linecache.cache[filename] = (len(text), None, lines, filename)


def _run(source: str, filename: str, first_line: int, namespace: dict[str, Any]) -> Any:
    """Execute the cell like IPython does: all statements, then the last expression's value."""
    tree = parse_cell(source, filename, first_line)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(last, filename, "eval"), namespace)


def _notebook_globals(values: Iterable[Any]) -> dict[str, Any]:
    """The globals dict the notebook's functions share after unpickling, or a fresh one.

    cloudpickle gives all ``__main__`` functions pickled in one call one shared globals dict;
    running the cell in that very dict makes them see what the cell defines, like in a notebook.
    """
    for found in _globals_of(values):
        return found
    return {}


def _globals_of(values: Iterable[Any]) -> list[dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for value in values:
        functions: Iterable[Any] = ()
        if isinstance(value, types.FunctionType):
            functions = (value,)
        elif isinstance(value, type) and value.__module__ == "__main__":
            functions = (v for v in vars(value).values() if isinstance(v, types.FunctionType))
        for function in functions:
            if function.__globals__.get("__name__") == "__main__":
                found.setdefault(id(function.__globals__), function.__globals__)
    return list(found.values())


def _bind_shipped(namespace: dict[str, Any], shipped: dict[str, Any]) -> None:
    """Add notebook values to a namespace a rank keeps between cells (the pool's case).

    What the rank defined itself wins; what came from the notebook earlier is refreshed. The
    notebook's functions are rebound to ``namespace`` so they see the rank's state, and the
    globals they brought along are added the same way.
    """
    before = namespace.setdefault(_SHIPPED_KEY, {})
    carried = {
        name: value
        for g in _globals_of(shipped.values())
        for name, value in g.items()
        if name not in MODULE_DUNDERS
    }
    for name, value in itertools.chain(carried.items(), shipped.items()):
        if name in namespace and not (name in before and namespace[name] is before[name]):
            continue
        if isinstance(value, types.FunctionType) and value.__globals__.get("__name__") == (
            "__main__"
        ):
            value = _rebind(value, namespace)
        namespace[name] = value
        before[name] = value


def _rebind(function: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    rebound = types.FunctionType(
        function.__code__,
        namespace,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    rebound.__module__ = function.__module__
    rebound.__dict__.update(function.__dict__)
    with contextlib.suppress(AttributeError):
        rebound.__annotations__ = function.__annotations__
    return rebound


def to_notebook(value: Any) -> Any:
    """A value ready to travel back to the notebook: modules and tensors on the CPU.

    ``DistributedDataParallel`` is unwrapped to its module; a module on an accelerator is
    copied to the CPU (the rank keeps its own); tensors are detached and moved to the CPU.
    Lists, tuples and dicts are converted item by item.
    """
    torch = sys.modules.get("torch")
    if torch is None:  # no tensors can exist on this rank
        return value
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        value = value.module
    if isinstance(value, torch.nn.Module):
        tensors = list(itertools.chain(value.parameters(), value.buffers()))
        if all(t.device.type == "cpu" for t in tensors):
            return value
        # Pre-seed deepcopy's memo with CPU copies: the module is never duplicated on the GPU.
        memo: dict[int, Any] = {}
        for t in tensors:
            cpu = t.detach().cpu()
            if isinstance(t, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=t.requires_grad)
            memo[id(t)] = cpu
        return copy.deepcopy(value, memo)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and (value.is_leaf or not value.requires_grad):
            return value
        moved = value.detach().cpu()
        return moved.requires_grad_(value.requires_grad and value.is_leaf)
    if type(value) in (list, tuple):
        return type(value)(to_notebook(v) for v in value)
    if type(value) is dict:
        return {k: to_notebook(v) for k, v in value.items()}
    return value


def parse_cell(cell: str, filename: str, first_line: int = 1) -> ast.Module:
    """Parse the cell body with line numbers as they appear in the whole cell.

    Raises
    ------
    SyntaxError
        With ``filename`` and the line number in the whole cell.
    """
    try:
        tree = ast.parse(cell, filename, "exec")
    except SyntaxError as exc:
        if exc.lineno is not None:
            exc.lineno += first_line - 1
            if getattr(exc, "end_lineno", None) is not None:
                exc.end_lineno += first_line - 1
        raise
    return ast.increment_lineno(tree, first_line - 1)


def type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
