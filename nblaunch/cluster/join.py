"""``python -m nblaunch join ENDPOINT --run-id RUN``: another node joins a notebook's run.

The node connects to the store the notebook hosts, reads the run's settings and payload, takes
part in the c10d rendezvous, then runs its share of the ranks with the ordinary supervisor and
relay. Everything its ranks send (output lines, logs, heartbeats, results, failures) goes up to
the notebook through the store; the node stops its ranks when the notebook says so, or when it
loses the notebook (:mod:`nblaunch.cluster.node_run`). See :mod:`nblaunch.cluster.run` for the
whole picture.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from nblaunch.cluster.channel import (
    CONFIG_VERSION,
    CONTROL_STOP,
    GATHER_POLL_S,
    NOTEBOOK_SILENCE_S,
    Keys,
    Terminated,
    first_line,
    local_host_name,
    rank_span,
    read_reason,
)
from nblaunch.cluster.network import describe, route_to
from nblaunch.cluster.node_run import Ending, NodeRun
from nblaunch.cluster.plan import plan_for_joined_node
from nblaunch.cluster.store import (
    BoundedStore,
    connect_store,
    node_rank_of,
    parse_endpoint,
    rendezvous_handler,
    require_store_queues,
    unshared_rendezvous_store,
    wait_for_port,
)
from nblaunch.cluster.trust import RunSecret, secret_for_join
from nblaunch.engine.processes.supervisor import warm_up
from nblaunch.errors import AuthenticationError, LaunchError

# How long a joining node waits for the run's settings to appear in the store.
CONFIG_WAIT_S = 10.0
# Exit codes of the join command.
EXIT_OK = 0
EXIT_FAILED = 1  # the run failed, was stopped or interrupted, or the notebook went away
EXIT_USAGE = 2  # no such run, endpoint unreachable: nothing ran here
# Not an exit code: a pool restarts, and this node joins its next start.
REJOIN = -1
# The thread that waits in torch's rendezvous while the main thread watches the notebook.
GATHER_THREAD = "nblaunch-rendezvous"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``join`` subcommand to the ``nblaunch`` command's subparsers."""
    parser = subparsers.add_parser(
        "join",
        help="join a multi-node run started in a notebook",
        description=(
            "Join the multi-node run a notebook started with num_nodes > 1; the notebook prints "
            "this command, with its endpoint and run id."
        ),
    )
    configure_parser(parser)
    return parser


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="the notebook's rdzv_endpoint, host:port")
    parser.add_argument("--run-id", required=True, help="the run id the notebook printed")
    parser.add_argument(
        "--start-method",
        default="forkserver",
        choices=("forkserver", "spawn", "fork"),
        help="how this node starts its ranks (default: forkserver)",
    )
    parser.add_argument(
        "--local-addr",
        default=None,
        help="this node's address, as the rendezvous and the notebook show it (default: hostname)",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="a file holding the run's secret, '-' to read it from the first line of stdin "
        "(default: NBLAUNCH_RUN_SECRET, as the printed command sets it, or the notebook's own "
        "~/.nblaunch/secrets/RUN on a shared home)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying to reach the notebook (default: 60)",
    )
    parser.set_defaults(handler=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    code = join(
        args.endpoint,
        args.run_id,
        start_method=args.start_method,
        local_addr=args.local_addr,
        connect_timeout=args.connect_timeout,
        secret_file=args.secret_file,
    )
    gathering = any(t.name == GATHER_THREAD and t.is_alive() for t in threading.enumerate())
    if BoundedStore.any_stuck or gathering:
        # A thread is still in a call on the notebook's store (lost, or closed while this node
        # waited): the interpreter's exit would wait for it, seconds to minutes. The ranks, if
        # any, are stopped.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m nblaunch.cluster.join ENDPOINT --run-id RUN`` (the same as ``nblaunch join``)."""
    parser = argparse.ArgumentParser(prog="nblaunch join")
    configure_parser(parser)
    args = parser.parse_args(argv)
    return _run_from_args(args)


def join(
    endpoint: str,
    run_id: str,
    *,
    start_method: str = "forkserver",
    local_addr: str | None = None,
    connect_timeout: float = 60.0,
    secret_file: str | None = None,
    out: TextIO | None = None,
) -> int:
    """Join the run ``run_id`` hosted at ``endpoint``; return the command's exit code.

    A pool's node stays in the pool across its restarts (``%dist restart``): after each, it
    joins the next start, waiting up to ``connect_timeout`` for it; it ends when the pool is
    closed.

    Returns
    -------
    int
        0 when every rank of the run returned (or the pool was closed); 1 when the run failed,
        was interrupted or stopped, or the notebook went away; 2 when this node could not take
        part at all.
    """
    piped = None
    if secret_file == "-":  # read once: a pool's node joins again with it
        piped = sys.stdin.readline().strip()
    while True:
        code = _join_once(
            endpoint, run_id, start_method, local_addr, connect_timeout, secret_file, piped, out
        )
        if code != REJOIN:
            return code


def _join_once(
    endpoint: str,
    run_id: str,
    start_method: str,
    local_addr: str | None,
    connect_timeout: float,
    secret_file: str | None,
    piped_secret: str | None,
    out: TextIO | None,
) -> int:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousError,
        RendezvousGracefulExitError,
        RendezvousTimeoutError,
    )

    stream = out or sys.stderr

    def say(message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"nblaunch join [{stamp}]: {message}", file=stream, flush=True)

    try:
        require_store_queues()
        host, port = parse_endpoint(endpoint)
    except LaunchError as exc:
        say(str(exc))
        return EXIT_USAGE
    keys = Keys(run_id)
    if not wait_for_port(host, port, connect_timeout):
        say(
            f"cannot reach {endpoint} after {connect_timeout:g} s. Is the notebook cell running "
            "(it hosts the rendezvous), and may this machine connect to that port (firewall)?"
        )
        return EXIT_USAGE
    try:
        store = connect_store(host, port)
        store.wait([keys.config], datetime.timedelta(seconds=CONFIG_WAIT_S))
    except Exception as exc:
        say(
            f"no run {run_id!r} at {endpoint} ({first_line(exc)}); use the endpoint and run id "
            "the notebook printed for its current run"
        )
        return EXIT_USAGE
    if store.check([keys.complete]) or store.check([keys.control]):
        say(f"run {run_id} at {endpoint} is not taking nodes any more (complete or stopped)")
        return EXIT_USAGE
    try:
        if piped_secret is not None:
            secret = RunSecret(piped_secret)
        else:
            secret = secret_for_join(run_id, secret_file)
    except (AuthenticationError, OSError) as exc:
        say(str(exc))
        return EXIT_USAGE
    try:
        config = secret.open(store.get(keys.config), keys.config)
    except AuthenticationError:
        say(
            f"the settings of run {run_id} at {endpoint} failed authentication: this node has "
            f"another secret than the notebook's (run the join command exactly as printed), or "
            "another client wrote them; nothing was started"
        )
        return EXIT_USAGE
    if not isinstance(config, dict) or config.get("version") != CONFIG_VERSION:
        say(
            f"run {run_id} was started by another nblaunch version (settings format "
            f"{config.get('version')}, this node reads {CONFIG_VERSION}); install the same "
            "nblaunch on every node"
        )
        return EXIT_USAGE
    route = route_to(host, port)  # named by its address: the hostname may be the same everywhere
    name = local_host_name(local_addr or (route.address if route else None))
    try:  # check the devices before joining, so the notebook learns at once
        plan_for_joined_node(
            config, node_rank=1, run_id=run_id, master_addr=host, start_method=start_method
        )
    except LaunchError as exc:
        store.queue_push(keys.hello, secret.seal({"host": name, "error": str(exc)}, keys.hello))
        say(f"{exc}; the notebook was told")
        return EXIT_USAGE
    warm_up(start_method)
    store.queue_push(keys.hello, secret.seal({"host": name, "pid": os.getpid()}, keys.hello))
    say(f"joining run {run_id} at {endpoint} ({config['num_nodes']} nodes)")
    handler = rendezvous_handler(
        connect_store(host, port),
        run_id,
        config["num_nodes"],
        local_addr,
        config["rdzv_timeout"],
        secret,
        endpoint,
    )
    try:
        with unshared_rendezvous_store():
            info = _gather(handler, store, keys, secret)
        head_rank = int(secret.verify(store.get(keys.head_rank), keys.head_rank))
    except NotebookStopped as exc:
        say(f"the notebook stopped run {run_id} before it started: {exc}")
        return EXIT_FAILED
    except (RendezvousClosedError, RendezvousGracefulExitError, RendezvousTimeoutError) as exc:
        reason = _reason_soon(store, keys, secret)  # the notebook's words, when it said them
        if reason:
            say(f"the notebook stopped run {run_id} before it started: {reason}")
        elif isinstance(exc, RendezvousTimeoutError):
            say(f"not every node joined run {run_id} in time; nothing ran")
        else:
            say(f"run {run_id} was closed before every node joined (interrupted or timed out)")
        return EXIT_FAILED
    except KeyboardInterrupt:
        say("interrupted while the nodes gathered")
        return EXIT_FAILED
    except AuthenticationError as exc:
        say(str(exc))
        return EXIT_FAILED
    except (RendezvousError, RuntimeError) as exc:
        say(f"lost the rendezvous at {endpoint}: {first_line(exc)}")
        return EXIT_FAILED
    node_rank = node_rank_of(info.rank, head_rank)
    plan = plan_for_joined_node(
        config, node_rank=node_rank, run_id=run_id, master_addr=host, start_method=start_method
    )
    try:  # a pool's tasks come one by one, later
        payload = None if plan.pool else secret.open(store.get(keys.payload), keys.payload)
    except AuthenticationError as exc:
        say(f"{exc}; nothing was started")
        return EXIT_FAILED
    _terminate_as_interrupt()
    ranks = plan.local_ranks
    say(f"node {node_rank} of {plan.num_nodes}: {rank_span(ranks[0], ranks[-1])}")
    say(describe(plan.route))
    # A client whose calls give up soon: a partition is seen in seconds, not minutes.
    live = BoundedStore(connect_store(host, port), NOTEBOOK_SILENCE_S)
    ending = NodeRun(plan, payload, live, keys, name, say, secret, handler).run()
    if ending is Ending.REJOIN:
        return REJOIN
    return EXIT_OK if ending is Ending.FINISHED else EXIT_FAILED


class NotebookStopped(Exception):
    """The notebook stopped the run while this node waited for the others; the message is the
    notebook's reason."""


def _gather(handler: Any, store: Any, keys: Keys, secret: RunSecret) -> Any:
    """``handler.next_rendezvous()``, on a thread while this one watches the notebook's control
    key: a run that fails in the notebook before every node joined (a timeout, a node that
    cannot take part, an interrupt) ends the wait at once, with the notebook's reason.

    Raises
    ------
    NotebookStopped
        When the notebook stopped the run.
    """
    outcome: dict[str, Any] = {}

    def gather() -> None:
        try:
            outcome["info"] = handler.next_rendezvous()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=gather, name=GATHER_THREAD, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(GATHER_POLL_S)
        if thread.is_alive() and store.check([keys.control]):
            try:
                value = secret.verify(store.get(keys.control), keys.control).decode()
            except AuthenticationError:
                continue  # forged: the rendezvous goes on
            if value == CONTROL_STOP:
                raise NotebookStopped(read_reason(store, keys, secret) or "no reason given")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["info"]


def _reason_soon(store: Any, keys: Keys, secret: RunSecret) -> str:
    """The notebook's reason for stopping the run, waited for a moment (its own timeout may
    fire just after this node's); "" when it gives none or is gone."""
    deadline = time.monotonic() + 4 * GATHER_POLL_S
    while True:
        try:
            reason = read_reason(store, keys, secret)
        except Exception:
            return ""
        if reason or time.monotonic() > deadline:
            return reason
        time.sleep(GATHER_POLL_S / 2)


def _terminate_as_interrupt() -> None:
    """Take SIGTERM (``scancel``, ``kill``) like Ctrl-C: stop the ranks, tell the notebook."""

    def interrupt(signum: int, frame: Any) -> None:
        # Once: Slurm sends more than one (srun passes scancel's or a preemption's on, then
        # its own as it forces the step's end), and a second one raised inside the ranks' stop
        # broke it: the join died with a traceback before telling the notebook.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":  # pragma: no cover - python -m nblaunch.cluster.join
    sys.exit(main())
