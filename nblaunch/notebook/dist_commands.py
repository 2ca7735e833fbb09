"""The ``%dist`` line magic's sub-commands: a registry, and the ones nblaunch brings.

``%dist`` is one dispatcher (:mod:`nblaunch.notebook.magics`); a sub-command is registered with
:func:`register_dist_command`. The pool's commands (:mod:`nblaunch.notebook.pool_commands`) are
registered by name and imported when first run, so ``%load_ext nblaunch`` stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError


@dataclass(frozen=True)
class DistCommand:
    """A ``%dist`` sub-command: ``function(line)`` gets the rest of the line after its name.

    ``function`` may be a callable or a ``"module:attribute"`` string, imported when the
    command first runs.
    """

    name: str
    function: Callable[[str], Any] | str
    help: str

    def resolve(self) -> Callable[[str], Any]:
        if callable(self.function):
            return self.function
        module, _, attribute = self.function.partition(":")
        return getattr(importlib.import_module(module), attribute)


_commands: dict[str, DistCommand] = {}


def register_dist_command(name: str, function: Callable[[str], Any] | str, help: str) -> None:
    """Add (or replace) the sub-command ``%dist NAME``.

    Parameters
    ----------
    name
        One word, e.g. ``"start"``.
    function
        Called with the rest of the line (a string) when a person runs ``%dist NAME ...``;
        what it returns is displayed like a line magic's result. A ``"module:attribute"``
        string is imported when the command first runs. Raise ``UsageError`` for bad input.
    help
        One line for the ``%dist`` overview.
    """
    if not name.isidentifier():
        raise ValueError(f"a %dist command is one word, got {name!r}")
    _commands[name] = DistCommand(name, function, help)


def unregister_dist_command(name: str) -> None:
    """Remove ``%dist NAME`` (nothing happens when it does not exist)."""
    _commands.pop(name, None)


def dist_commands() -> dict[str, DistCommand]:
    """The ``%dist`` sub-commands, by name."""
    return dict(sorted(_commands.items()))


def overview() -> str:
    """What ``%dist`` prints: the magics and every sub-command."""
    lines = [
        "nblaunch magics:",
        "  %%distributed [-n N] [--debug] [-o NAMES] ...   run the cell on every rank "
        "(%%distributed? for options)",
        "  %dist COMMAND ...                               the commands below",
    ]
    commands = dist_commands()
    if commands:
        width = max(len(name) for name in commands)
        lines.append("")
        lines.append("%dist commands:")
        lines += [f"  %dist {c.name:<{width}}  {c.help}" for c in commands.values()]
    return "\n".join(lines)


def _dist_env(line: str) -> None:
    """``%dist env [HOSTFILE]``: the environment report (and a check of the hosts in HOSTFILE)."""
    try:
        from nblaunch.engine.plan import doctor
    except ModuleNotFoundError as exc:
        if exc.name != "nblaunch.engine.plan.doctor":
            raise
        raise UsageError(
            "%dist env: the environment report (nblaunch.engine.plan.doctor) is not available"
        ) from None
    print(doctor.report(), end="")
    hostfile = line.strip()
    if hostfile:
        from nblaunch.cluster.hosts import check_hosts

        print("\n" + check_hosts(hostfile).text(), end="")


register_dist_command(
    "env",
    _dist_env,
    "[HOSTFILE]  torch, devices, backends and start methods; what to fix first",
)
# Background and detached runs (nblaunch.notebook.handle), imported when first used.
register_dist_command(
    "runs", "nblaunch.notebook.handle:dist_runs", "this kernel's runs and the detached ones"
)
register_dist_command(
    "wait", "nblaunch.notebook.handle:dist_wait", "[ID]  wait for a background run's result"
)
register_dist_command(
    "view", "nblaunch.notebook.handle:dist_view", "[ID]  show a run's live view in this cell"
)
# The persistent pool's commands, imported when first used.
register_dist_command(
    "start",
    "nblaunch.notebook.pool_commands:dist_start",
    "-n N [--debug] [--start-method M] [--nodes N ...]  ranks that keep their state across cells",
)
register_dist_command(
    "status", "nblaunch.notebook.pool_commands:dist_status", "the pool's ranks, pids, memory"
)
register_dist_command(
    "restart", "nblaunch.notebook.pool_commands:dist_restart", "fresh ranks, same options"
)
register_dist_command("stop", "nblaunch.notebook.pool_commands:dist_stop", "stop the pool's ranks")
register_dist_command(
    "attach",
    "nblaunch.notebook.pool_commands:dist_attach",
    "[ID]  this kernel back on a detached pool (%dist start --detach)",
)
register_dist_command(
    "debug",
    "nblaunch.notebook.pool_commands:dist_debug",
    "[--rank R]  post-mortem of the last failed cell",
)
register_dist_command(
    "pull",
    "nblaunch.notebook.pool_commands:dist_pull",
    "NAME [--rank R]  a rank's variable, copied to the notebook",
)
register_dist_command(
    "push",
    "nblaunch.notebook.pool_commands:dist_push",
    "NAME [--ranks R]  a notebook variable, sent to the ranks",
)
