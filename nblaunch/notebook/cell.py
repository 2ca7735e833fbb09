"""A notebook cell as a task for the ranks: find what it reads, ship it, run it, bring back results.

``%%distributed`` turns its cell into a :class:`CellTask` with :func:`build_cell_task` in the
notebook, hands the task to ``notebook_launcher`` (or to a running pool), and each rank calls it.
The pieces are public so that the persistent pool runs cells the same way.

What travels
------------
Only the notebook names the cell *reads* (found from its code with :mod:`symtable` and
:mod:`ast`; names the cell binds before reading them are not sent), so a big unrelated object in
the notebook costs nothing:

- modules travel by name and are imported again on the rank;
- functions and classes defined in the notebook travel by value (cloudpickle, keeping their
  file names so tracebacks show their source), and see the cell's globals (``rank``,
  ``device``, ...) on the rank, as they would in the notebook;
- everything else travels pickled. A name that does not pickle is refused in the notebook,
  before anything starts, naming the variable and its type (:class:`~nblaunch.errors.LaunchError`).

The pool's contract
-------------------
::

    task = build_cell_task(cell, user_ns, filename=..., first_line=2, outputs=("model",))
    # on each rank, with the namespace that rank keeps between cells:
    result = task(namespace)            # CellResult on task.main_rank, None elsewhere
    # back in the notebook, with rank main_rank's result:
    value = finish_cell(task, result, user_ns)  # binds -o names, returns the value to display

``task(namespace)`` binds ``rank``, ``local_rank``, ``world_size`` and ``device`` and the shipped
names in ``namespace``, then runs the cell in it. Names a rank defined itself win over notebook
names of the same name; a name that came from the notebook before is refreshed. With
``namespace=None`` (a one-shot launch) the cell gets a fresh namespace. Set ``task.main_rank``
before sending the task when the cell runs on a subset of ranks (``--ranks``): that rank's last
expression and ``-o`` values come back. :func:`localize_tracebacks` trims a re-created remote
traceback (and those chained to it) to the cell's own frames.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import importlib
import itertools
import linecache
import symtable
import sys
import types
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nblaunch import tracebacks
from nblaunch.errors import LaunchError

# Bound by the task on every rank; never taken from the notebook.
INJECTED_NAMES = ("rank", "local_rank", "world_size", "device")
# Module attributes that describe the notebook itself, not data the cell uses.
_MODULE_DUNDERS = frozenset(
    {"__name__", "__doc__", "__builtins__", "__spec__", "__loader__", "__package__", "__file__"}
)
# Scopes symtable makes for comprehensions; they run where they stand, like class bodies.
_COMPREHENSIONS = frozenset({"listcomp", "setcomp", "dictcomp", "genexpr"})
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
class _ModuleRef:
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

        from nblaunch import pickling, worker

        context = worker.current()
        if context is None:  # called in-process (tests, a single process): rank 0 of 1
            injected = {"rank": 0, "local_rank": 0, "world_size": 1, "device": worker.device()}
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
            if isinstance(value, _ModuleRef):
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
                    f"-o {name}: rank {injected['rank']}'s {name} (a {_type_name(output)}) "
                    f"cannot be sent back to the notebook: {type(exc).__name__}: {exc}. "
                    "Return plain data, tensors or a state_dict instead"
                ) from None
        return result


def build_cell_task(
    cell: str,
    user_ns: dict[str, Any],
    *,
    filename: str = "<distributed-cell>",
    display: str | None = None,
    first_line: int = 1,
    outputs: Sequence[str] = (),
    hidden: Collection[str] = (),
    main_rank: int = 0,
) -> CellTask:
    """Turn a cell into a :class:`CellTask`: parse it, find the names it reads, pickle them.

    Parameters
    ----------
    cell
        The cell body, plain Python.
    user_ns
        The notebook's namespace, where the names the cell reads are looked up.
    filename
        The name to compile the cell under (register ``display`` under it in ``linecache``).
    display
        The text tracebacks show for ``filename``; default: the body.
    first_line
        Line number of the body's first line in ``display`` (2 below a ``%%`` line).
    outputs
        Names whose final values the main rank sends back (``-o``).
    hidden
        Notebook names never to send (IPython's own ``In``, ``Out``, ``get_ipython``, ...).
    main_rank
        The rank whose last expression and outputs come back.

    Raises
    ------
    SyntaxError
        The cell is not valid Python; line numbers are those of ``display``.
    LaunchError
        A name the cell reads cannot be pickled; the message names it and its type.
    """
    parse_cell(cell, filename, first_line)  # a SyntaxError here, with the cell's line numbers
    names = [
        name
        for name in names_read(cell)
        if name in user_ns
        and name not in INJECTED_NAMES
        and name not in _MODULE_DUNDERS
        and name not in hidden
    ]
    shipped = serialize_names({name: user_ns[name] for name in names})
    from IPython.core.displayhook import DisplayHook

    return CellTask(
        source=cell,
        filename=filename,
        display=cell if display is None else display,
        first_line=first_line,
        shipped=shipped,
        names=tuple(names),
        outputs=tuple(outputs),
        main_rank=main_rank,
        quiet=bool(DisplayHook.semicolon_at_end_of_expression(cell)),
    )


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


def names_read(cell: str) -> list[str]:
    """Global names the cell reads before (or without) binding them itself, in source order.

    A name read at the top level counts unless a top-level statement that always binds it (an
    assignment, import, ``def``, ``class``, ``with``, or a ``for`` target for reads in and after
    its body) bound it before the first read. A name
    read only inside a function the cell defines counts unless the cell binds it at the top
    level, since the function runs after those bindings. Names local to the cell's functions,
    lambdas and comprehensions never count.
    """
    tree = ast.parse(cell)
    immediate, deferred = _global_reads(cell)
    bound_at = _unconditional_bindings(tree)
    first_read = _first_top_level_reads(tree)
    # ``x += 1`` reads x, though symtable does not count it as a reference.
    immediate |= {
        node.target.id
        for node in tree.body
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
    }
    names = []
    for name in sorted(immediate | deferred, key=lambda n: first_read.get(n, (1 << 30, 0))):
        if name in bound_at:
            read = first_read.get(name) if name in immediate else None
            if read is None or read >= bound_at[name]:
                continue
        names.append(name)
    return names


def _global_reads(cell: str) -> tuple[set[str], set[str]]:
    """Names read from the cell's global scope: (read while the cell runs, read in functions)."""
    table = symtable.symtable(cell, "<cell>", "exec")
    immediate = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    deferred: set[str] = set()

    def visit(scope: symtable.SymbolTable, runs_now: bool) -> None:
        for child in scope.get_children():
            # Class bodies and comprehensions run where they stand; function bodies run later.
            now = runs_now and (child.get_type() == "class" or child.get_name() in _COMPREHENSIONS)
            for symbol in child.get_symbols():
                if symbol.is_referenced() and symbol.is_global():
                    (immediate if now else deferred).add(symbol.get_name())
            visit(child, now)

    visit(table, True)
    return immediate, deferred - immediate


def _unconditional_bindings(tree: ast.Module) -> dict[str, tuple[int, int]]:
    """Name -> end position of the first top-level statement that always binds it."""
    bound: dict[str, tuple[int, int]] = {}
    for statement in tree.body:
        names: list[str] = []
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if isinstance(statement, ast.Assign) or statement.value is not None:
                names = [n.id for t in targets for n in _target_names(t)]
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names = [
                alias.asname or alias.name.split(".")[0]
                for alias in statement.names
                if alias.name != "*"
            ]
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [statement.name]
        elif isinstance(statement, (ast.For, ast.AsyncFor)):
            # The target is bound before the body runs; reads in the body come after.
            names = [n.id for n in _target_names(statement.target)]
            iterable = statement.iter
            for name in names:
                bound.setdefault(name, (iterable.end_lineno or 0, iterable.end_col_offset or 0))
            continue
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            names = [
                n.id
                for item in statement.items
                if item.optional_vars is not None
                for n in _target_names(item.optional_vars)
            ]
        end = (statement.end_lineno or statement.lineno, statement.end_col_offset or 0)
        for name in names:
            bound.setdefault(name, end)
    return bound


def _target_names(target: ast.AST) -> Iterable[ast.Name]:
    if isinstance(target, ast.Name):
        yield target
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


def _first_top_level_reads(tree: ast.Module) -> dict[str, tuple[int, int]]:
    """Name -> position of its first read outside function and lambda bodies."""
    first: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Decorators, defaults and annotations run now; the body runs later.
            for part in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part)
            return
        if isinstance(node, ast.Lambda):
            for part in [*node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part)
            return
        reads = isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            first.setdefault(node.target.id, (node.lineno, node.col_offset))
        if reads:
            first.setdefault(node.id, (node.lineno, node.col_offset))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return first


def serialize_names(values: dict[str, Any]) -> bytes:
    """Pickle the notebook values a cell reads, all at once (notebook functions share globals).

    Raises
    ------
    LaunchError
        Naming the first variable that does not pickle, what inside it does not, and its type.
    """
    from nblaunch import pickling

    prepared = {
        name: _ModuleRef(value.__name__) if _importable_module(value) else value
        for name, value in values.items()
    }
    try:
        return pickling.dumps(prepared)
    except Exception as exc:
        error = exc
    for name, value in prepared.items():
        try:
            pickling.dumps(value)
        except Exception as exc:
            raise LaunchError(_unpicklable_message(name, value, exc)) from None
    raise LaunchError(
        f"the variables the cell uses ({', '.join(values)}) cannot be sent to the ranks "
        f"together: {type(error).__name__}: {error}"
    )


def _unpicklable_message(name: str, value: Any, exc: Exception) -> str:
    from nblaunch.plan import find_unpicklable, first_unpicklable

    culprit = None
    if isinstance(value, types.FunctionType):
        culprit = find_unpicklable(value, (), {})
    culprit = culprit or first_unpicklable(name, value, depth=0)
    what = f"variable {name!r} (a {_type_name(value)})"
    if not culprit.startswith(f"{name} ("):
        what += f": {culprit}"
    return (
        f"the cell uses {what}, which cannot be sent to the ranks: {type(exc).__name__}: "
        f"{exc}. Ranks are separate processes: create it inside the cell instead."
    )


def _importable_module(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


# --- on the rank ---------------------------------------------------------------------------------


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
        if name not in _MODULE_DUNDERS
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


# --- back in the notebook ------------------------------------------------------------------------


def finish_cell(task: CellTask, result: CellResult | None, user_ns: dict[str, Any]) -> Any:
    """Bind the ``-o`` values in the notebook and return the value to display (or None).

    Raises
    ------
    UsageError
        An ``-o`` name the cell did not define on the main rank (the others are bound).
    """
    import cloudpickle

    if result is None:
        return None
    for name, data in result.outputs.items():
        user_ns[name] = cloudpickle.loads(data)
    if result.missing:
        names = ", ".join(result.missing)
        from IPython.core.error import UsageError

        raise UsageError(
            f"-o {names}: the cell did not define {names} on rank {task.main_rank}; "
            "check the spelling, or define it in the cell"
        )
    return None if result.value is None else cloudpickle.loads(result.value)


def localize_tracebacks(exc: BaseException, filename: str) -> BaseException:
    """Give ``exc`` and the exceptions chained to it tracebacks that start in the cell.

    See :func:`cell_traceback`. When ``exc`` did not come from the cell's code (a rank that
    died, a hang, a timeout), its traceback is the cell's first line, the ``%%distributed``
    line, instead of the launcher's internals. Returns ``exc``.
    """
    exc.__traceback__ = cell_traceback(exc.__traceback__, filename) or tracebacks.rebuild(
        [(filename, "<module>", 1, {})]
    )
    pending: list[BaseException | None] = [exc.__cause__, exc.__context__]
    seen: set[int] = {id(exc)}
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = cell_traceback(current.__traceback__, filename)
        pending += [current.__cause__, current.__context__]
    return exc


def cell_traceback(tb: types.TracebackType | None, filename: str) -> types.TracebackType | None:
    """The traceback from the cell's first frame on, or None when no frame is the cell's.

    The frames are rebuilt so that IPython shows each one's own source lines: the traceback a
    rank sent (re-created by tblib) gives every frame a code object that starts at the failing
    line, which makes IPython number a cell file's lines wrongly (it shows the cell's first
    lines against the failing line's number).
    """
    entries = tracebacks.frames(tb)
    for start, (frame_file, *_) in enumerate(entries):
        if frame_file == filename:
            return tracebacks.rebuild(entries[start:])
    return None
