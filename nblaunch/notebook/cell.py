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
import symtable
import sys
import types
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from nblaunch import tracebacks
from nblaunch.errors import LaunchError
from nblaunch.ranks.cell import (
    INJECTED_NAMES,
    MODULE_DUNDERS,
    CellResult,
    CellTask,
    ModuleRef,
    parse_cell,
    type_name,
)

# Scopes symtable makes for comprehensions; they run where they stand, like class bodies.
_COMPREHENSIONS = frozenset({"listcomp", "setcomp", "dictcomp", "genexpr"})


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
        and name not in MODULE_DUNDERS
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
    first_read, comprehension_targets = _first_top_level_reads(tree)
    # Since Python 3.12 (PEP 709) list, set and dict comprehensions are inlined: symtable puts
    # their targets in the cell's own table, as if the cell read a global ``j`` in
    # ``[j * j for j in js]``. A target the cell never reads outside its comprehension is not
    # a global read on any Python.
    immediate -= comprehension_targets - first_read.keys()
    deferred -= immediate
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
    return immediate, deferred


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


def _first_top_level_reads(tree: ast.Module) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """Name -> position of its first read outside function and lambda bodies, and the names
    comprehensions bind (a read of a comprehension's own target is not a read of the cell's).
    """
    first: dict[str, tuple[int, int]] = {}
    comprehension_targets: set[str] = set()

    def visit(node: ast.AST, local: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Decorators, defaults and annotations run now; the body runs later.
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            arguments += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            annotations = [a.annotation for a in arguments] + [node.returns]
            for part in [
                *node.decorator_list,
                *node.args.defaults,
                *node.args.kw_defaults,
                *annotations,
            ]:
                if part is not None:
                    visit(part, local)
            return
        if isinstance(node, ast.Lambda):
            for part in [*node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part, local)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            # The first iterable runs in the enclosing scope; each target is bound for the
            # iterables, conditions and element after it.
            inner = local
            for generator in node.generators:
                visit(generator.iter, inner)
                targets = {n.id for n in _target_names(generator.target)}
                comprehension_targets.update(targets)
                inner = inner | targets
                visit(generator.target, inner)
                for condition in generator.ifs:
                    visit(condition, inner)
            parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for part in parts:
                visit(part, inner)
            return
        target = node.target if isinstance(node, ast.AugAssign) else None
        if isinstance(target, ast.Name) and target.id not in local:
            first.setdefault(target.id, (node.lineno, node.col_offset))
        reads = isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)
        if reads and node.id not in local:
            first.setdefault(node.id, (node.lineno, node.col_offset))
        for child in ast.iter_child_nodes(node):
            visit(child, local)

    visit(tree, frozenset())
    return first, comprehension_targets


def serialize_names(values: dict[str, Any]) -> bytes:
    """Pickle the notebook values a cell reads, all at once (notebook functions share globals).

    Raises
    ------
    LaunchError
        Naming the first variable that does not pickle, what inside it does not, and its type.
    """
    from nblaunch import pickling

    prepared = {
        name: ModuleRef(value.__name__) if _importable_module(value) else value
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
    from nblaunch.engine.plan.launch_plan import find_unpicklable, first_unpicklable

    culprit = None
    if isinstance(value, types.FunctionType):
        culprit = find_unpicklable(value, (), {})
    culprit = culprit or first_unpicklable(name, value, depth=0)
    what = f"variable {name!r} (a {type_name(value)})"
    if not culprit.startswith(f"{name} ("):
        what += f": {culprit}"
    return (
        f"the cell uses {what}, which cannot be sent to the ranks: {type(exc).__name__}: "
        f"{exc}. Ranks are separate processes: create it inside the cell instead."
    )


def _importable_module(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value


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
