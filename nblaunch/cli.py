"""The ``nblaunch`` command.

``nblaunch env [--hostfile FILE]`` prints the environment report (see
:mod:`nblaunch.engine.plan.doctor`) and checks the hostfile's hosts (:mod:`nblaunch.cluster.hosts`);
``nblaunch run SCRIPT -n N [-- ARGS...]`` runs a script on N ranks through ``notebook_launcher``,
with every rank's output prefixed and the failing rank's own error at the end.

Each subcommand is a function in :data:`COMMANDS` that adds its parser; a new subcommand is one
more such function and one more entry.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

from nblaunch.options import DEVICE_TYPES, START_METHODS

# Subcommands: each adds its parser to the subparsers and sets ``handler`` (args -> exit code).
# An option-taking subcommand that forwards unknown arguments sets ``forward_extra=True``.
Subparsers = Any  # argparse._SubParsersAction, which argparse does not export


def add_env_command(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "env",
        help="print the environment report (paste it into bug reports)",
        description=(
            "Versions, OS and kernel, CPUs, RAM, GPUs, safe start methods and warnings. "
            "With --hostfile, also check passwordless SSH to every host and look for mpirun."
        ),
    )
    parser.add_argument(
        "--hostfile", metavar="FILE", help="MPI hostfile whose hosts to check over SSH"
    )
    parser.add_argument(
        "--ssh-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds each host gets to answer (default 5)",
    )
    parser.set_defaults(handler=run_env)


def run_env(args: argparse.Namespace) -> int:
    from nblaunch.engine.plan import doctor

    sys.stdout.write(doctor.report())
    if args.hostfile is None:
        return 0
    from nblaunch.cluster.hosts import check_hosts

    result = check_hosts(args.hostfile, timeout=args.ssh_timeout)
    sys.stdout.write("\n" + result.text())
    return 0 if result.ok else 1


def add_run_command(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a Python script on N ranks",
        description=(
            "Run SCRIPT as __main__ on every rank, with the process group set up and the "
            "torchrun variables (RANK, WORLD_SIZE, ...) set. Arguments nblaunch does not know, "
            "and everything after --, go to the script."
        ),
    )
    parser.add_argument("script", metavar="SCRIPT", help="the Python file to run")
    parser.add_argument(
        "-n", "--num-processes", type=int, default=None, metavar="N", help="number of ranks"
    )
    parser.add_argument("--debug", action="store_true", default=None, help="check collectives")
    parser.add_argument("--start-method", default=START_METHODS[0], choices=START_METHODS)
    parser.add_argument(
        "--device", default=None, metavar="TYPE", help=", ".join(DEVICE_TYPES) + ", or a plug-in's"
    )
    parser.add_argument("--timeout", type=float, default=None, metavar="S")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="S")
    parser.add_argument("--log-level", default=None)
    parser.set_defaults(handler=run_script_command, forward_extra=True)


def run_script_command(args: argparse.Namespace) -> int:
    import os

    from nblaunch.errors import LaunchError
    from nblaunch.notebook.launcher import notebook_launcher

    path = os.path.abspath(args.script)
    if not os.path.isfile(path):
        print(f"nblaunch: no such script: {args.script}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.hang_timeout is not None:
        options["hang_timeout"] = args.hang_timeout
    try:
        notebook_launcher(
            run_script,
            (path, list(args.extra)),
            args.num_processes,
            start_method=args.start_method,
            debug=args.debug,
            log_level=args.log_level,
            timeout=args.timeout,
            device_type=args.device,
            display="text",
            **options,
        )
    except KeyboardInterrupt:
        print("nblaunch: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except LaunchError as exc:
        print(f"nblaunch: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # the failing rank's own exception, with its traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        code = getattr(exc, "exitcode", None)  # a rank's sys.exit(code) is the script's too
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return 0


def run_script(path: str, argv: list[str]) -> None:
    """Inside a rank: run ``path`` as ``__main__`` with ``sys.argv = [path, *argv]``."""
    import os
    import runpy

    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` does
    runpy.run_path(path, run_name="__main__")  # sys.exit() is the rank's to report


def add_join_command(subparsers: Subparsers) -> None:
    """``nblaunch join ENDPOINT --run-id RUN``: this node joins a notebook's multi-node run."""
    from nblaunch.cluster.join import add_parser

    add_parser(subparsers)


def add_runs_command(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "runs",
        help="list this machine's detached runs and pools, or stop one",
        description=(
            "Detached runs (notebook_launcher(..., detach=True)) and pools "
            "(start_pool(..., detach=True)) outlive their kernel. 'nblaunch runs' lists them "
            "with their kind (run or pool) and state; 'nblaunch runs stop ID' stops one "
            "(ID or its start) as the view's Stop button would."
        ),
    )
    parser.add_argument("action", nargs="?", choices=["list", "stop"], default="list")
    parser.add_argument("run_id", nargs="?", metavar="ID", help="the run to stop")
    parser.add_argument(
        "--wait", type=float, default=15.0, metavar="S", help="seconds to wait for it to end"
    )
    parser.set_defaults(handler=run_runs)


def run_runs(args: argparse.Namespace) -> int:
    import time

    from nblaunch.engine.detached import registry as detached
    from nblaunch.errors import LaunchError

    if args.action == "list":
        try:
            listed = detached.entries()
        except LaunchError as exc:  # a registry it may not use: what to do, in one line
            print(f"nblaunch runs: {exc}", file=sys.stderr)
            return 1
        rows = [f"{'id':<28} {'kind':<4} {'state':<8} {'ranks':>5}  {'host pid':>8}  run directory"]
        for entry in listed:
            rows.append(
                f"{entry.run_id:<28} {entry.kind:<4} {entry.live_state:<8} {entry.world_size:>5}  "
                f"{entry.pid:>8}  {entry.run_dir}"
            )
        print("\n".join(rows) if len(rows) > 1 else "no detached runs or pools on this machine")
        return 0
    if not args.run_id:
        print("nblaunch runs stop: which run? (nblaunch runs lists them)", file=sys.stderr)
        return 2
    try:
        entry = detached.find(args.run_id)
    except LaunchError as exc:
        print(f"nblaunch runs stop: {exc}", file=sys.stderr)
        return 1
    ended = entry.live_state != "running"  # a host may still hold the outcome of an ended run
    if not detached.stop_host(entry):
        print(f"{entry.run_id} is not running ({entry.live_state})")
        return 0
    deadline = time.monotonic() + args.wait
    while detached.host_alive(entry.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if detached.host_alive(entry.pid):
        print(f"{entry.run_id}: its host (pid {entry.pid}) is still stopping", file=sys.stderr)
        return 1
    if ended:
        print(
            f"{entry.run_id} had ended ({entry.live_state}); its host, which kept the outcome "
            "the disk refused, let it go"
        )
    else:
        print(f"{entry.run_id} stopped")
    return 0


COMMANDS: list[Callable[[Subparsers], None]] = [
    add_env_command,
    add_run_command,
    add_join_command,
    add_runs_command,
]


def build_parser() -> argparse.ArgumentParser:
    from nblaunch import __version__

    parser = argparse.ArgumentParser(
        prog="nblaunch",
        description="Run distributed PyTorch from a notebook or a terminal, and check the setup.",
    )
    parser.add_argument("--version", action="version", version=f"nblaunch {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``nblaunch`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to the script, whatever it looks like.
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "forward_extra", False):
        args.extra = [*extra, *tail]
    elif extra or tail:
        parser.error(f"unrecognized arguments: {' '.join([*extra, *tail])}")
    return int(handler(args) or 0)
