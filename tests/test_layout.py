"""The layout's rules, read from the imports themselves (every import, also inside functions).

A file's folder says which process it runs in (docs/design.md, "Packages by process"):

- ``nblaunch/ranks/`` runs inside a rank: it imports only the shared vocabulary and itself;
- ``nblaunch/engine/`` runs in the notebook's process: shared, ranks and itself, never the
  front ends, IPython or ipywidgets;
- ``nblaunch/cluster/`` is the other machines: shared, ranks, engine and itself;
- ``nblaunch/host/`` is a detached run's host process: shared, ranks, engine and itself (a
  detached pool's host runs the engine's pool headless), never the notebook package, IPython or
  ipywidgets;
- ``nblaunch/notebook/`` is the front ends, the only package that imports IPython or ipywidgets;
- ``nblaunch/lab/`` is the Jupyter server's extension (the runs panel): shared, engine, itself;
- the shared modules (``errors``, ``events``, ``options``, ``tracebacks``, ``pickling``) import
  only each other.

Inside ``engine/`` and ``ranks/`` a folder holds one concept and imports only the leaves and the
folders below it (:data:`LAYERS`); inside a folder, no module imports another in a circle. An
import under ``TYPE_CHECKING`` counts like any other: a type a module names is a dependency.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

import nblaunch

PACKAGE = pathlib.Path(nblaunch.__file__).parent
SHARED = {"errors", "events", "options", "tracebacks", "pickling"}
# What each part may import of nblaunch ("shared" is the modules above).
ALLOWED = {
    "shared": {"shared"},
    "ranks": {"shared", "ranks"},
    "engine": {"shared", "ranks", "engine"},
    "cluster": {"shared", "ranks", "engine", "cluster"},
    # A detached run's host runs the engine headless (and, for a run on several machines, the
    # notebook node's side of it): nothing of the front ends.
    "host": {"shared", "ranks", "engine", "cluster", "host"},
    "notebook": {"shared", "ranks", "engine", "cluster", "notebook"},
    # The runs panel's server extension runs in the Jupyter server: it reads and stops runs
    # through the engine, never through the notebook's front ends (no kernel, no IPython).
    "lab": {"shared", "engine", "lab"},
}
FRONT_END_LIBRARIES = {"IPython", "ipywidgets", "ipykernel"}
# Inside a package, bottom to top: each folder imports only the leaves and the folders before it.
# The other modules at the top of ranks/ (the worker, ops, logging, ...) sit above its folders.
LAYERS = {
    "engine": (
        "processes",
        "plan",
        "output",
        "monitors",
        "run",
        "background",
        "pool",
        "detached",
    ),
    "ranks": ("device", "checks", "memory"),
}
# Modules at a package's top that every folder may read; they import only each other.
LEAVES = {
    "engine": {"clock", "verdict"},
    "ranks": {"this_rank", "failure", "containment", "semaphores"},
}
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 350


# Public import paths outside the packages: they may import anything.
ENTRY_POINTS = {"nblaunch", "nblaunch.__main__", "nblaunch.cli", "nblaunch.integrations"}


def part_of(module: str) -> str | None:
    """``nblaunch.engine.run.run`` -> ``engine``; the shared modules -> ``shared``; else None."""
    parts = module.split(".")
    if parts[0] != "nblaunch" or len(parts) < 2:
        return None
    if parts[1] in SHARED:
        return "shared"
    return parts[1] if parts[1] in ALLOWED else None


def imports_of(name: str, source: str) -> list[tuple[int, str]]:
    """Every module the module ``name`` imports, absolute, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: not used in nblaunch, but counted if it appears
                base = name.split(".")[: -node.level]
                module = ".".join([*base, module] if module else base)
            # ``from nblaunch import x`` may name a submodule: count ``nblaunch.x``.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, module))
    return found


def broken_rules(name: str, source: str) -> list[str]:
    """The imports of module ``name`` that break the rules, as ``line: module``."""
    part = part_of(name)
    if part is None:  # an entry point: it may import anything
        return []
    broken = []
    for line, imported in imports_of(name, source):
        target = part_of(imported)
        crosses = target is not None and target not in ALLOWED[part]
        front_end = imported.split(".")[0] in FRONT_END_LIBRARIES and part != "notebook"
        if crosses or front_end:
            broken.append(f"{line}: {imported}")
    return broken


def modules() -> list[tuple[str, pathlib.Path]]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        names.append((".".join(relative.parts).removesuffix(".__init__"), path))
    return names


def test_every_module_is_in_a_package_by_process_or_shared_or_an_entry_point():
    loose = [name for name, _ in modules() if part_of(name) is None and name not in ENTRY_POINTS]
    assert loose == []


def test_imports_follow_the_packages_by_process():
    broken = [
        f"{name}:{where}"
        for name, path in modules()
        for where in broken_rules(name, path.read_text())
    ]
    assert broken == []


def imports_for_circles(name: str, source: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere: at module level, inside
    functions and under ``TYPE_CHECKING`` alike, since a reader follows each of them and a
    change ripples through each."""
    found = {imported for _, imported in imports_of(name, source)}
    return {module for module in found if module in known and module != name}


def layer_of(module: str) -> tuple[str, int] | None:
    """``nblaunch.engine.run.run`` -> ("engine", 4): its package and its folder's place in
    :data:`LAYERS` (-1: a leaf; a ranks module above the folders: their count); None outside."""
    parts = module.split(".")
    if len(parts) < 3 or parts[0] != "nblaunch" or parts[1] not in LAYERS:
        return None
    package, below = parts[1], parts[2]
    if below in LAYERS[package]:
        return package, LAYERS[package].index(below)
    if below in LEAVES[package]:
        return package, -1
    return package, len(LAYERS[package])


def broken_layers(name: str, source: str) -> list[str]:
    """The imports of module ``name`` that reach a folder above its own, as ``line: module``."""
    here = layer_of(name)
    if here is None:
        return []
    broken = []
    for line, imported in imports_of(name, source):
        there = layer_of(imported)
        if there is not None and there[0] == here[0] and there[1] > here[1]:
            broken.append(f"{line}: {imported}")
    return broken


def test_each_folder_imports_only_the_leaves_and_the_folders_below_it():
    broken = [
        f"{name}:{where}"
        for name, path in modules()
        for where in broken_layers(name, path.read_text())
    ]
    assert broken == []


def test_every_engine_and_rank_folder_is_placed_in_the_layers():
    for package in LAYERS:
        folders = {p.name for p in (PACKAGE / package).iterdir() if (p / "__init__.py").exists()}
        assert folders == set(LAYERS[package])
    top = {p.stem for p in (PACKAGE / "engine").glob("*.py")} - {"__init__"}
    assert top == LEAVES["engine"]


def test_no_import_circle():
    # A package's __init__ runs before any of its modules: it is not a step in a circle.
    known = {name for name, path in modules() if path.name != "__init__.py"}
    graph = {
        name: imports_for_circles(name, path.read_text(), known)
        for name, path in modules()
        if name in known
    }
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


def test_no_module_or_class_is_too_long_to_read():
    too_long = []
    for _, path in modules():
        text = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= MAX_CLASS_LINES:
                too_long.append(
                    f"{where}: class {node.name}, {node.end_lineno - node.lineno} lines"
                )
    assert too_long == []


def test_a_circle_would_be_found():
    # An import inside a function makes a circle as much as one at the top.
    in_function = "def f():\n    from b import x\n"
    graph = {"a": imports_for_circles("a", in_function, {"b"}), "b": {"a"}}
    assert graph["a"] == {"b"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
    # A type named under TYPE_CHECKING is a dependency too.
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n"
    assert imports_for_circles("a", typing_only, {"b", "c"}) == {"b"}


def test_a_reach_into_a_folder_above_would_be_found():
    upward = "def f():\n    from nblaunch.engine.pool.pool_engine import PoolEngine\n"
    assert broken_layers("nblaunch.engine.run.run", upward) == [
        "2: nblaunch.engine.pool.pool_engine.PoolEngine",
        "2: nblaunch.engine.pool.pool_engine",
    ]
    typing = "if TYPE_CHECKING:\n    from nblaunch.engine.run.run import Run\n"
    assert broken_layers("nblaunch.engine.processes.stopper", typing) == [
        "2: nblaunch.engine.run.run.Run",
        "2: nblaunch.engine.run.run",
    ]
    assert broken_layers("nblaunch.engine.verdict", "from nblaunch.engine.plan import x\n") != []
    assert broken_layers("nblaunch.ranks.checks.waits", "from nblaunch.ranks import worker\n")
    assert (
        broken_layers("nblaunch.ranks.worker", "from nblaunch.ranks.memory import memory\n") == []
    )


def test_the_rules_catch_what_they_are_for():
    # The test above passes on a tree that follows the rules; check it would see a break.
    rank_module = (
        "import os\nfrom nblaunch import events\n\ndef f():\n    from nblaunch.engine import run\n"
    )
    assert broken_rules("nblaunch.ranks.bad", rank_module) == [
        "5: nblaunch.engine.run",
        "5: nblaunch.engine",
    ]
    engine_module = (
        "from nblaunch import launcher\nimport ipywidgets\nfrom nblaunch.notebook import pool\n"
    )
    assert broken_rules("nblaunch.engine.bad", engine_module) == [
        "2: ipywidgets",
        "3: nblaunch.notebook.pool",
        "3: nblaunch.notebook",
    ]
    assert broken_rules("nblaunch.notebook.ok", engine_module) == []
    assert broken_rules(
        "nblaunch.host.bad", "def f():\n    from nblaunch.notebook import pool\n"
    ) == [
        "2: nblaunch.notebook.pool",
        "2: nblaunch.notebook",
    ]
    assert broken_rules("nblaunch.cluster.bad", "from nblaunch.notebook.widgets import x\n") == [
        "1: nblaunch.notebook.widgets.x",
        "1: nblaunch.notebook.widgets",
    ]


# The public surface: moving modules into packages must not change it.
PUBLIC = [
    "AuthenticationError",
    "DistributedHangError",
    "DistributedOperationException",
    "LaunchError",
    "LaunchTimeoutError",
    "NblaunchError",
    "NoExecutableBatchSizeError",
    "Pool",
    "PoolRestartedError",
    "RankFailedError",
    "RayCluster",
    "RendezvousTimeoutError",
    "RunHandle",
    "RunStoppedError",
    "SlurmCluster",
    "all_reduce",
    "attach",
    "attach_pool",
    "breakpoint",
    "broadcast",
    "broadcast_object_list",
    "check_trigger",
    "debug_launcher",
    "device",
    "find_executable_batch_size",
    "free_memory",
    "gather",
    "gather_object",
    "get_logger",
    "is_main_process",
    "load_metrics",
    "local_rank",
    "log_metrics",
    "notebook_launcher",
    "pad_across_processes",
    "per_device_batch_size",
    "rank",
    "reduce",
    "runs",
    "set_seed",
    "set_trigger",
    "start_pool",
    "wait_for_everyone",
    "world_size",
]


def test_the_public_names_are_exactly_the_documented_ones():
    assert sorted(nblaunch.__all__) == PUBLIC
    assert all(getattr(nblaunch, name) is not None for name in PUBLIC)
    assert callable(nblaunch.rank) and nblaunch.rank() == 0  # the function, not the package


def test_what_travels_pickled_by_reference_resolves_in_a_fresh_process():
    # A cell task and the pool's rank-side tasks are pickled by reference: their module must be
    # importable by name in a rank, and must not be the notebook's.
    import pickle
    import subprocess
    import sys

    from nblaunch.ranks import namespace
    from nblaunch.ranks.cell import CellTask

    payload = pickle.dumps((CellTask, namespace.pull_value, namespace.run_cell))
    code = (
        "import pickle, sys; found = pickle.loads(sys.stdin.buffer.read()); "
        "print(*[f'{f.__module__}.{f.__qualname__}' for f in found]); "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.count('.') > 1 "
        "and m.startswith('nblaunch.')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    assert out.split() == [
        "nblaunch.ranks.cell.CellTask",
        "nblaunch.ranks.namespace.pull_value",
        "nblaunch.ranks.namespace.run_cell",
        "['ranks']",  # a rank loads no engine, cluster or notebook module
    ]
