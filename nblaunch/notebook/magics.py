"""The IPython extension: the ``%%distributed`` cell magic and the ``%dist`` line magic.

``%load_ext nblaunch`` calls :func:`register`; ``%unload_ext`` / ``%reload_ext`` call
:func:`unregister` first. Loading is cheap: torch is imported when a cell runs, not before.

``%%distributed`` turns its cell into a :class:`~nblaunch.ranks.cell.CellTask` (see
:mod:`nblaunch.notebook.cell`) and runs it with
:func:`~nblaunch.notebook.launcher.notebook_launcher`, or, when
``nblaunch.notebook.pool.current_pool()`` returns a pool, on that pool with
``pool.run_cell(task, ranks=SPEC_OR_NONE, timeout=..., hang_timeout=...)``, which returns one
value per rank of the pool (``None`` where the cell did not run) and sets ``task.main_rank``.

``%dist`` is one dispatcher over the sub-commands of :mod:`nblaunch.notebook.dist_commands`.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nblaunch.errors import LaunchError
from nblaunch.notebook.dist_commands import dist_commands, overview
from nblaunch.options import DEFAULT_HANG_TIMEOUT_S, LOG_LEVELS, START_METHODS, START_NODES

if TYPE_CHECKING:
    from nblaunch.ranks.cell import CellTask

# --- the magics ----------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise ValueError(text)
    return text.upper()


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not all(n.isidentifier() for n in names):
        raise ValueError(text)
    return names


# argparse names the type in its message ("invalid _positive_int value"); say it in words.
_positive_int.__name__ = "positive whole number"
_positive_float.__name__ = "positive number of seconds"
_log_level.__name__ = "log level (" + ", ".join(LOG_LEVELS) + ")"
_names.__name__ = "comma-separated list of names"


@magics_class
class DistributedMagics(Magics):
    """``%%distributed`` and ``%dist``."""

    @magic_arguments.magic_arguments(name="%distributed")  # the usage line reads %%distributed
    @magic_arguments.argument(
        "-n",
        "--num-processes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="number of ranks (default: one per GPU, else 1)",
    )
    @magic_arguments.argument(
        "--debug",
        action="store_true",
        default=None,
        help="check every collective for mismatched shapes, dtypes and operations",
    )
    @magic_arguments.argument(
        "--pdb",
        action="store_true",
        default=None,
        help="a rank that raises opens the debugger at the failing frame (post-mortem) before "
        "the others are stopped; on a pool, use %%dist debug after the cell failed",
    )
    @magic_arguments.argument(
        "--log-level",
        type=_log_level,
        default=None,
        metavar="LEVEL",
        help="level of nblaunch.get_logger loggers on the ranks (DEBUG, INFO, ...)",
    )
    @magic_arguments.argument(
        "--start-method",
        choices=START_METHODS,
        default=None,
        metavar="M",
        help="forkserver (default), spawn or fork",
    )
    @magic_arguments.argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="stop the cell after S seconds (LaunchTimeoutError)",
    )
    @magic_arguments.argument(
        "--hang-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="stop with DistributedHangError after S seconds without progress in collectives "
        "(default 300; inf turns the check off)",
    )
    @magic_arguments.argument(
        "-o",
        "--outputs",
        type=_names,
        default=[],
        metavar="NAMES",
        help="bind rank 0's final values of these names in the notebook, e.g. -o model,history "
        "(tensors and modules moved to the CPU)",
    )
    @magic_arguments.argument(
        "--nodes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run on N machines, -n ranks on each; the cell prints the command to run on the "
        "other nodes (see docs/multinode.md)",
    )
    @magic_arguments.argument(
        "--run-id",
        default=None,
        metavar="RUN",
        help="with --nodes: the run id, so that 'join --run-id RUN' can start before the cell",
    )
    @magic_arguments.argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="with --nodes: the address on this machine where the other nodes join",
    )
    @magic_arguments.argument(
        "--rdzv-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="with --nodes: how long to wait for every node to join (default 600)",
    )
    @magic_arguments.argument(
        "--start-nodes",
        choices=START_NODES,
        default=None,
        help="with --nodes: start join on the other nodes from here, over ssh (with "
        "--hostfile) or srun (inside a Slurm allocation)",
    )
    @magic_arguments.argument(
        "--hostfile",
        default=None,
        metavar="PATH",
        help="with --start-nodes ssh: the other machines, one per line",
    )
    @magic_arguments.argument(
        "--cluster",
        choices=("ray", "slurm"),
        default=None,
        help="with --nodes: the engine that places the other nodes (a Ray cluster: the Ray this "
        "kernel initialised, else RAY_ADDRESS or this node's cluster; slurm: a step of this "
        "allocation, else a batch job on the default partition)",
    )
    @magic_arguments.argument(
        "--bg",
        action="store_true",
        help="run in the background: the cell returns a RunHandle at once and other cells "
        "run meanwhile; %%dist wait (or handle.result()) gives the cell's result",
    )
    @magic_arguments.argument(
        "--ranks",
        default=None,
        metavar="SPEC",
        help="with a pool running (%%dist start): run on these ranks only, e.g. 0 or 0,2 or "
        "1-3; collectives need every rank",
    )
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every rank, as if each rank were the notebook.

        The cell sees ``rank``, ``local_rank``, ``world_size`` and ``device``, plus the
        notebook's names that it reads: modules are imported again on each rank, functions
        and classes defined in the notebook travel by value, data travels pickled. A name
        that cannot be pickled is refused before anything starts.

        Rank 0's last expression is the cell's result; ``-o NAMES`` brings rank 0's final
        values of those names into the notebook. When a rank fails, its own exception is
        raised here, with the cell's line numbers. A running pool (``%dist start``) runs the
        cell on its ranks, keeping their state between cells.

        Example::

            %%distributed -n 2 -o model
            model = torch.nn.Linear(4, 1).to(device)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ...
            loss.item()
        """
        __tracebackhide__ = True
        args = magic_arguments.parse_argstring(self.distributed, line)
        shell = self.shell
        pool = _current_pool()
        if pool is None and args.ranks is not None:
            raise UsageError(
                "--ranks needs a running pool: start one with %dist start -n N, "
                "or leave --ranks out to run on every rank"
            )
        if pool is not None:
            _refuse_launch_options(args)

        try:
            pinned = pool.pinned_names(shell.user_ns) if pool is not None else ()
            task = prepare_cell(shell, line, cell, outputs=args.outputs, pinned=pinned)
        except LaunchError as exc:  # a name the cell reads does not pickle: nothing started
            raise UsageError(str(exc)) from None
        try:
            if pool is not None:
                # The pool sets task.main_rank to the lowest rank --ranks chose.
                results = pool.run_cell(
                    task,
                    ranks=args.ranks,
                    timeout=args.timeout,
                    hang_timeout=args.hang_timeout,
                    background=args.bg,
                )
            else:
                from nblaunch.notebook.launcher import notebook_launcher

                results = notebook_launcher(
                    task,
                    num_processes=args.num_processes,
                    start_method=args.start_method or "forkserver",
                    debug=args.debug,
                    log_level=args.log_level,
                    timeout=args.timeout,
                    hang_timeout=(
                        DEFAULT_HANG_TIMEOUT_S if args.hang_timeout is None else args.hang_timeout
                    ),
                    display="auto",
                    debug_on_error=bool(args.pdb),
                    num_nodes=args.nodes,
                    rdzv_endpoint=args.rdzv_endpoint,
                    rdzv_timeout=args.rdzv_timeout,
                    rdzv_id=args.run_id,
                    start_nodes=args.start_nodes,
                    hostfile=args.hostfile,
                    cluster=args.cluster,
                    block=not args.bg,
                )
        except KeyboardInterrupt:
            raise
        except LaunchError as exc:
            # Nothing ran (a name that does not pickle, more ranks than GPUs, a busy port):
            # a one-line UsageError, like a bad option, without the extension's frames.
            raise UsageError(str(exc)) from None
        except BaseException as exc:
            from nblaunch.notebook.cell import localize_tracebacks

            # Show the cell's frames, not the launcher's, like a cell run in the notebook. No
            # "from None": a cause the cell itself chained (raise ... from ...) stays.
            raise localize_tracebacks(exc, task.filename)  # noqa: B904
        from nblaunch.notebook.cell import finish_cell, localize_tracebacks

        if args.bg:  # a RunHandle: its result() finishes the cell as a blocking one would
            by_rank = results.finish or (lambda values: values)
            results.finish = lambda values: finish_cell(
                task, by_rank(values)[task.main_rank], shell.user_ns
            )
            results.localize = lambda exc: localize_tracebacks(exc, task.filename)
            return results
        return finish_cell(task, results[task.main_rank], shell.user_ns)

    @line_magic
    def dist(self, line: str) -> Any:
        """``%dist [COMMAND ...]``: nblaunch's commands; ``%dist`` alone lists them."""
        words = line.strip().split(maxsplit=1)
        if not words or words[0] in ("help", "-h", "--help"):
            print(overview())
            return None
        name, rest = words[0], (words[1] if len(words) > 1 else "")
        command = dist_commands().get(name)
        if command is None:
            known = ", ".join(dist_commands()) or "none yet"
            raise UsageError(f"%dist {name}: no such command (available: {known}); see %dist")
        return command.resolve()(rest)


def prepare_cell(
    shell: Any,
    line: str,
    cell: str,
    *,
    outputs: list[str] | tuple[str, ...] = (),
    pinned: Collection[str] = (),
) -> CellTask:
    """Build the :class:`~nblaunch.ranks.cell.CellTask` for a ``%%distributed`` cell.

    The cell is registered with IPython's compiler under a name of its own, as the person
    sees it (the ``%%distributed`` line, then the body), so tracebacks read
    ``Cell In[N], line L`` with the cell's own lines and numbers. ``pinned`` names are not
    sent: the ranks hold them already (a pool's pushed values).

    Raises
    ------
    SyntaxError
        The body is not valid Python.
    UsageError
        The body uses IPython syntax (``%magic``, ``!shell``), which ranks cannot run.
    LaunchError
        A name the cell reads cannot be sent to the ranks.
    """
    __tracebackhide__ = True
    from nblaunch.notebook.cell import build_cell_task
    from nblaunch.ranks.cell import parse_cell

    display = f"%%distributed {line}".rstrip() + "\n" + cell
    number = _cell_number(shell)
    # A raw text of its own: ipykernel names cells after a hash of it, and the name must not
    # collide with the enclosing cell's.
    filename = shell.compile.cache(display, number, raw_code=f"# nblaunch\n{display}")
    try:
        parse_cell(cell, filename, first_line=2)
        error = None
    except SyntaxError as exc:
        error = exc
    if error is not None:  # raised outside the handler, so no "during handling" chain shows
        _check_ipython_syntax(shell, cell, error)
        raise error.with_traceback(None)
    hidden = {
        name
        for name, value in getattr(shell, "user_ns_hidden", {}).items()
        if shell.user_ns.get(name, value) is value
    } | set(pinned)
    return build_cell_task(
        cell,
        shell.user_ns,
        filename=filename,
        display=display,
        first_line=2,
        outputs=tuple(outputs),
        hidden=hidden,
    )


def _cell_number(shell: Any) -> int:
    """The ``In[N]`` number of the cell being run.

    IPython counts the cell before running it (so ``execution_count`` is one ahead when history
    is stored, and not otherwise); the enclosing cell's frame knows its number for sure.
    """
    numbers = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if number is not None:
            return number
        frame = frame.f_back
    return shell.execution_count


def _check_ipython_syntax(shell: Any, cell: str, error: SyntaxError) -> None:
    """Turn a SyntaxError caused by ``%magic`` or ``!shell`` lines into a clear UsageError."""
    try:
        transformed = shell.transform_cell(cell)
        compile(transformed, "<cell>", "exec")
    except Exception:
        return  # a real syntax error: the caller raises it
    if "get_ipython()" in transformed:
        raise UsageError(
            f"line {error.lineno}: IPython syntax (%magics, !commands, ?help) cannot run on "
            "the ranks, which are plain Python processes; run it in a cell of its own"
        )


def _refuse_launch_options(args: Any) -> None:
    """Options a running pool fixed when it started cannot change for one cell."""
    given = [
        option
        for option, value in (
            ("-n", args.num_processes),
            ("--start-method", args.start_method),
            ("--debug", args.debug),
            ("--log-level", args.log_level),
            ("--nodes", None if args.nodes == 1 else args.nodes),
            ("--rdzv-endpoint", args.rdzv_endpoint),
            ("--run-id", args.run_id),
        )
        if value is not None
    ]
    if args.pdb:
        raise UsageError(
            "--pdb: a pool keeps the failing rank's frames; after the cell fails, %dist debug "
            "opens the debugger there"
        )
    if given:
        raise UsageError(
            f"{', '.join(given)}: a pool is running (%dist status) and keeps the options it "
            "was started with; %dist restart with new options, or %dist stop to run "
            "one-shot cells"
        )


def _current_pool() -> Any:
    """The running pool, if the pool module was loaded and holds one."""
    pool_module = sys.modules.get("nblaunch.notebook.pool")
    current = getattr(pool_module, "current_pool", None)
    return current() if current is not None else None


# --- the extension -------------------------------------------------------------------------------


def register(ipython: Any) -> None:
    """Register ``%%distributed`` and ``%dist`` in ``ipython`` (``%load_ext nblaunch``)."""
    ipython.register_magics(DistributedMagics)


def unregister(ipython: Any) -> None:
    """Remove the magics again (``%unload_ext nblaunch``; ``%reload_ext`` then re-registers)."""
    manager = ipython.magics_manager
    for kind, name in (("cell", "distributed"), ("line", "dist")):
        function = manager.magics[kind].get(name)
        if isinstance(getattr(function, "__self__", None), DistributedMagics):
            del manager.magics[kind][name]
    manager.registry.pop(DistributedMagics.__name__, None)
