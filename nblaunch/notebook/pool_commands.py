"""The ``%dist`` commands of the persistent pool: start, stop, restart, status, debug, pull,
push (registered in :mod:`nblaunch.notebook.dist_commands`; imported when first used).

Each parses its line, drives :class:`nblaunch.notebook.pool.Pool`, and turns a ``LaunchError`` into
IPython's one-line ``UsageError``.
"""

from __future__ import annotations

from typing import Any

from nblaunch.errors import LaunchError
from nblaunch.notebook.pool import Pool, current_pool, parse_ranks
from nblaunch.notebook.pool_start import start_pool
from nblaunch.options import DEVICE_TYPES, START_METHODS, START_NODES

# The options of a pool on several machines (start_pool's names).
NODE_OPTIONS = ("rdzv_endpoint", "rdzv_timeout", "rdzv_id", "start_nodes", "hostfile")


# --- %dist start / stop / status / restart ------------------------------------------------------


def _start_parser(prog: str) -> Any:
    from IPython.core.magic_arguments import MagicArgumentParser

    parser = MagicArgumentParser(
        prog=prog,
        description="Start ranks that stay alive across cells: %%distributed cells then run "
        "on them and keep their state (models, optimizers) from cell to cell.",
    )
    parser.add_argument("-n", "--num-processes", type=int, default=None, metavar="N")
    parser.add_argument("--debug", action="store_true", default=None)
    parser.add_argument("--start-method", choices=START_METHODS, default=None)
    parser.add_argument("--log-level", default=None, metavar="LEVEL")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="S")
    parser.add_argument(
        "--device-type",
        default=None,
        metavar="TYPE",
        help=", ".join(DEVICE_TYPES) + ", or a plug-in's",
    )
    parser.add_argument(
        "--nodes",
        dest="num_nodes",
        type=int,
        default=None,
        metavar="N",
        help="machines in the pool, this one included (each other one runs the printed join)",
    )
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT")
    parser.add_argument("--rdzv-timeout", type=float, default=None, metavar="S")
    parser.add_argument("--run-id", dest="rdzv_id", default=None, metavar="ID")
    parser.add_argument("--start-nodes", choices=START_NODES, default=None)
    parser.add_argument("--hostfile", default=None, metavar="PATH")
    parser.add_argument(
        "--cluster", choices=("ray", "slurm"), default=None, help="with --nodes: Ray or Slurm"
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        default=None,
        help="ranks under a run host of their own: they outlive the kernel (%%dist attach)",
    )
    parser.add_argument(
        "--idle-limit",
        type=float,
        default=None,
        metavar="S",
        help="with --detach: end the pool after S seconds without a cell (default 24 h)",
    )
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def _options_from(line: str, prog: str) -> dict[str, Any] | None:
    parser = _start_parser(prog)
    args = parser.parse_argstring(line)
    if args.help:
        print(parser.format_help())
        return None
    return {key: value for key, value in vars(args).items() if key != "help" and value is not None}


def _usage_error(exc: LaunchError) -> Exception:
    from IPython.core.error import UsageError

    return UsageError(str(exc))


def dist_start(line: str) -> None:
    """``%dist start -n N [--debug] [--start-method M] [--log-level L] [--hang-timeout S]``."""
    options = _options_from(line, "%dist start")
    if options is None:
        return
    try:
        pool = start_pool(options.pop("num_processes", None), display="auto", **options)
    except LaunchError as exc:
        raise _usage_error(exc) from None
    nodes = f" on {pool.nodes.options.num_nodes} nodes" if pool.nodes else ""
    print(
        f"nblaunch pool: {pool.world_size} rank(s){nodes} ready in {pool.start_s:.1f} s "
        f"(pids {', '.join(map(str, pool.pids))}). %%distributed cells now run on it and keep "
        "their state; %dist status, %dist restart, %dist stop."
    )


def dist_attach(line: str) -> None:
    """``%dist attach [ID] [--take-over]``: connect this kernel to a detached pool (default: the
    newest); ``--take-over`` also when another kernel drives it (that kernel is told)."""
    from IPython.core.error import UsageError

    from nblaunch.notebook.pool_start import attach_pool

    words = line.split()
    take_over = "--take-over" in words
    words = [word for word in words if word != "--take-over"]
    if len(words) > 1 or any(word.startswith("-") for word in words):
        raise UsageError(f"%dist attach [ID] [--take-over]: got {line!r}")
    try:
        pool = attach_pool(words[0] if words else None, take_over=take_over)
    except LaunchError as exc:
        raise _usage_error(exc) from None
    print(
        f"nblaunch pool: attached to {pool.describe()}. %%distributed cells run on it again, "
        "with the names earlier cells defined."
    )


def dist_stop(line: str) -> None:
    """``%dist stop``: stop the pool's ranks; ``%%distributed`` cells launch one-shot again."""
    pool = current_pool()
    if pool is None:
        print("nblaunch pool: none is running")
        return
    n = pool.world_size
    try:
        pool.close()
    except LaunchError as exc:  # a detached pool another kernel took, or that ended elsewhere
        print(f"nblaunch pool: nothing stopped here: {exc}")
        return
    print(f"nblaunch pool: stopped {n} rank(s); %%distributed cells now launch fresh ranks")


def dist_restart(line: str) -> None:
    """``%dist restart [options]``: fresh ranks; same options, except those given."""
    options = _options_from(line, "%dist restart")
    if options is None:
        return
    from IPython.core.error import UsageError

    pool = current_pool()
    if pool is None:
        raise UsageError("%dist restart: no pool is running; start one with %dist start -n N")
    if "num_processes" in options:
        pool.num_processes = options.pop("num_processes")
    num_nodes = options.pop("num_nodes", None)
    node_options = {k: options.pop(k) for k in NODE_OPTIONS if k in options}
    if node_options and pool.nodes is None:
        raise UsageError(
            "%dist restart: --rdzv-endpoint, --rdzv-timeout, --run-id, --start-nodes and "
            "--hostfile are for a pool started with --nodes"
        )
    try:
        pool.options = pool.options.replace(**options)
        if pool.nodes is not None:
            pool.nodes = pool.nodes.replace(**node_options)
        pool.restart(num_nodes=num_nodes)
    except LaunchError as exc:
        raise _usage_error(exc) from None
    print(
        f"nblaunch pool: restarted: {pool.world_size} fresh rank(s) in {pool.start_s:.1f} s "
        f"(pids {', '.join(map(str, pool.pids))}); names from earlier cells are gone"
    )


def dist_status(line: str) -> None:
    """``%dist status``: ranks, pids, state, memory, and the names cells defined."""
    pool = current_pool()
    if pool is None:
        print("nblaunch pool: none is running; %dist start -n N starts one")
        return
    try:
        print(pool.status_text())
    except LaunchError as exc:  # a detached pool another kernel took, or that ended elsewhere
        print(f"nblaunch pool: {exc}")


# --- %dist debug / pull / push ------------------------------------------------------------------


def _running_pool(command: str) -> Pool:
    from IPython.core.error import UsageError

    pool = current_pool()
    if pool is None:
        raise UsageError(f"%dist {command}: no pool is running; start one with %dist start -n N")
    return pool


def _name_and_ranks(line: str, command: str) -> tuple[str, str | None]:
    """``NAME [--rank R]`` (``--ranks`` for push), as the %dist commands take them."""
    from IPython.core.error import UsageError

    words = line.split()
    flag = "--ranks" if command == "push" else "--rank"
    ranks = None
    if flag in words:
        at = words.index(flag)
        if at + 1 >= len(words):
            raise UsageError(f"%dist {command}: {flag} needs a value, e.g. {flag} 1")
        ranks = words[at + 1]
        del words[at : at + 2]
    if len(words) != 1 or not words[0].isidentifier():
        raise UsageError(f"%dist {command} NAME [{flag} R]: one variable name, got {line!r}")
    return words[0], ranks


def dist_debug(line: str) -> None:
    """``%dist debug [--rank R]``: post-mortem of the last failed cell, on the rank it failed."""
    from IPython.core.error import UsageError

    pool = _running_pool("debug")
    words = line.split()
    rank = None
    if words:
        if len(words) != 2 or words[0] != "--rank" or not words[1].isdigit():
            raise UsageError(f"%dist debug [--rank R]: got {line!r}")
        rank = int(words[1])
    try:
        pool.debug(rank)
    except LaunchError as exc:
        raise _usage_error(exc) from None


def dist_pull(line: str) -> None:
    """``%dist pull NAME [--rank R]``: bind a CPU copy of a rank's variable in the notebook."""
    from IPython import get_ipython

    name, rank = _name_and_ranks(line, "pull")
    pool = _running_pool("pull")
    (chosen,) = parse_ranks(rank if rank is not None else 0, pool.world_size)
    try:
        value = pool.pull(name, chosen)
    except LaunchError as exc:
        raise _usage_error(exc) from None
    except TypeError as exc:  # the value cannot be pickled back: the person's input, not a bug
        from IPython.core.error import UsageError

        raise UsageError(f"%dist pull: {exc}") from None
    get_ipython().user_ns[name] = value
    print(f"nblaunch pool: {name} from rank {chosen}")


def dist_push(line: str) -> None:
    """``%dist push NAME [--ranks R]``: send a notebook variable to every rank (or ``R``)."""
    from IPython import get_ipython
    from IPython.core.error import UsageError

    name, ranks = _name_and_ranks(line, "push")
    pool = _running_pool("push")
    namespace = get_ipython().user_ns
    if name not in namespace:
        raise UsageError(f"%dist push: the notebook has no variable {name!r}")
    try:
        pool.push(name, namespace[name], ranks)
    except LaunchError as exc:
        raise _usage_error(exc) from None
    print(f"nblaunch pool: {name} sent to rank(s) {ranks or 'all'}")
