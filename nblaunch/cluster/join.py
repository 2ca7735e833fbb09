"""``python -m nblaunch join ENDPOINT --run-id RUN``: another node joins a notebook's run.

The node connects to the store the notebook hosts, reads the run's settings and payload, takes
part in the c10d rendezvous, then runs its share of the ranks with the ordinary supervisor and
relay. Everything its ranks send (output lines, logs, heartbeats, results, failures) goes up to
the notebook through the store; the node stops its ranks when the notebook says so, or when it
loses the notebook. See :mod:`nblaunch.cluster.multinode` for the whole picture.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, TextIO

from nblaunch.cluster.multinode import (
    BEAT_INTERVAL_S,
    CONFIG_VERSION,
    CONTROL_INTERRUPT,
    CONTROL_OK,
    CONTROL_REJOIN,
    CONTROL_STOP,
    PUSH_INTERVAL_S,
    Keys,
    MultiNodePlan,
    connect_store,
    local_host_name,
    node_rank_of,
    parse_endpoint,
    plan_for_joined_node,
    rank_span,
    rendezvous_handler,
    unshared_rendezvous_store,
)
from nblaunch.cluster.trust import RunSecret, secret_for_join
from nblaunch.engine.relay import Relay
from nblaunch.engine.run import STOP_GRACE_S
from nblaunch.engine.supervisor import Supervisor, signal_pid, warm_up
from nblaunch.errors import AuthenticationError, LaunchError
from nblaunch.events import STOP, task_message

# How long a joining node waits for the run's settings to appear in the store.
CONFIG_WAIT_S = 10.0
# A batch holds at most this many events, so one push stays small.
MAX_BATCH = 2000
# How often the node looks at the notebook's control key.
CONTROL_INTERVAL_S = 0.1
# Exit codes of the join command.
EXIT_OK = 0
EXIT_FAILED = 1  # the run failed, was stopped or interrupted, or the notebook went away
EXIT_USAGE = 2  # no such run, endpoint unreachable: nothing ran here
# Not an exit code: a pool restarts, and this node joins its next start.
REJOIN = -1
# How long a pool's node waits for the old rendezvous to close before joining the next one.
OLD_STORE_WAIT_S = 30.0


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
    return join(
        args.endpoint,
        args.run_id,
        start_method=args.start_method,
        local_addr=args.local_addr,
        connect_timeout=args.connect_timeout,
        secret_file=args.secret_file,
    )


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
            f"no run {run_id!r} at {endpoint} ({_first_line(exc)}); use the endpoint and run id "
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
    name = local_host_name(local_addr)
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
            info = handler.next_rendezvous()
        head_rank = int(secret.verify(store.get(keys.head_rank), keys.head_rank))
    except (RendezvousClosedError, RendezvousGracefulExitError):
        say(f"run {run_id} was closed before every node joined (interrupted or timed out)")
        return EXIT_FAILED
    except RendezvousTimeoutError:
        say(f"not every node joined run {run_id} in time; nothing ran")
        return EXIT_FAILED
    except KeyboardInterrupt:
        say("interrupted while the nodes gathered")
        return EXIT_FAILED
    except AuthenticationError as exc:
        say(str(exc))
        return EXIT_FAILED
    except (RendezvousError, RuntimeError) as exc:
        say(f"lost the rendezvous at {endpoint}: {_first_line(exc)}")
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
    return NodeRun(plan, payload, store, keys, name, say, secret, handler).run()


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Wait until something accepts connections on ``host:port``; False after ``timeout`` s.

    Probing with a plain socket first keeps torch's store client from logging a C++ error with
    a stack trace for each attempt while the notebook is not there yet.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


class Uplink:
    """The relay's sink on a joined node: batches events and pushes them to the notebook.

    One push per ``PUSH_INTERVAL_S`` at most (or per ``MAX_BATCH`` events). A thread of its own,
    on its own connection, pushes an empty batch every ``BEAT_INTERVAL_S``: the notebook knows
    the node is alive even while starting the ranks blocks this node's main thread. ``lost`` is
    set when the store cannot be reached any more: the notebook has gone.
    """

    def __init__(
        self, store: Any, key: str, node: int, secret: RunSecret, beat_store: Any = None
    ) -> None:
        self.store = store
        self.key = key
        self.node = node
        self.secret = secret
        # Events pushed so far: each record says where it starts, so the notebook sees a gap
        # if someone else takes records off the queue. Pushes and beats take turns.
        self.pushed = 0
        self._push_lock = threading.Lock()
        self.buffer: list[dict[str, Any]] = []
        self.last_push = 0.0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if beat_store is not None:
            self._beat = threading.Thread(
                target=self._beat_loop, args=(beat_store,), name="nblaunch-beat", daemon=True
            )
            self._beat.start()

    def _beat_loop(self, store: Any) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            try:
                with self._push_lock:
                    store.queue_push(self.key, self._record([]))
            except Exception as exc:
                self.lost = _first_line(exc)
                return

    def handle(self, event: Any) -> None:
        self.buffer.append(event)

    def news(self, what: str, **fields: Any) -> None:
        """A record about the node itself (``started``, ``done``), not about one rank."""
        self.buffer.append({"kind": "node", "what": what, **fields})

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.buffer and (
            force or now - self.last_push >= PUSH_INTERVAL_S or len(self.buffer) >= MAX_BATCH
        ):
            self.push()

    def push(self) -> None:
        if self.lost is not None:
            return
        batch, self.buffer = self.buffer, []
        self.last_push = time.monotonic()
        try:
            with self._push_lock:
                self.store.queue_push(self.key, self._record(batch))
                self.pushed += len(batch)
        except Exception as exc:
            self.lost = _first_line(exc)

    def _record(self, batch: list[dict[str, Any]]) -> bytes:
        return self.secret.seal((self.node, self.pushed, batch), self.key)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5.0)
        self.push()


class NodeRun:
    """This node's ranks: start them, forward what they send, stop them when told to."""

    def __init__(
        self,
        plan: MultiNodePlan,
        payload: bytes | None,
        store: Any,
        keys: Keys,
        name: str,
        say: Any,
        secret: RunSecret,
        handler: Any = None,
    ) -> None:
        self.plan = plan
        self.payload = payload
        self.store = store
        self.keys = keys
        self.name = name
        self.say = say
        self.handler = handler  # the rendezvous, left once the ranks stopped
        self.secret = secret
        self.uplink = Uplink(store, keys.up, plan.node_rank, secret, beat_store=_beat_store(store))
        self._forged_control = False
        self.finished: set[int] = set()
        self.returned: set[int] = set()
        self._last_control_check = 0.0
        self._control_value: str | None = None  # the last one the notebook set
        # A pool's tasks, numbered from 0 at each start: the next to take, the one running.
        self.next_task = 0
        self.task: int | None = None
        self.task_interrupted = False  # the notebook interrupted the running task here

    def run(self) -> int:
        plan = self.plan
        uplink = self.uplink
        supervisor = Supervisor(plan.world_size, plan.start_method)
        relay = None
        outcome = "stopped"
        uplink.news("started", host=self.name, ranks=plan.local_ranks, pid=os.getpid())
        uplink.push()
        try:
            supervisor.start(plan.local_ranks)
            relay = Relay(supervisor.ranks, uplink, None)
            for rank in supervisor.ranks:
                supervisor.send(rank, plan.setup_message(rank.rank))
                if self.payload is not None:  # a one-shot run's task: on every rank of the run
                    every = list(range(plan.world_size))
                    supervisor.send(rank, task_message(self.payload, 0, every, plan.world_size))
            interrupted = False
            while True:
                self._note(relay.poll(0.05))
                for rank in supervisor.reap():
                    self._note(relay.drain_events(rank.rank))
                    # A pool's rank waits for tasks until told to stop: any exit is a death.
                    if plan.pool or rank.rank not in self.finished:
                        self.finished.add(rank.rank)
                        uplink.handle(
                            {"kind": "death", "rank": rank.rank, "exitcode": rank.exitcode}
                        )
                if uplink.lost is not None:
                    self.say(f"lost the notebook ({uplink.lost}); stopping this node's ranks")
                    break
                control = self._control()
                if control is None and plan.pool:
                    self._take_tasks(supervisor)
                if control == CONTROL_INTERRUPT and not interrupted:
                    interrupted = True
                    supervisor.interrupt()
                elif control == CONTROL_OK:
                    outcome = "finished"
                    for rank in supervisor.ranks:
                        supervisor.send(rank, {"kind": STOP})
                    deadline = time.monotonic() + 5.0
                    while supervisor.alive() and time.monotonic() < deadline:
                        relay.poll(0.02)
                        supervisor.reap()
                    break
                elif control == CONTROL_STOP:
                    outcome = "interrupted" if interrupted else "stopped by the notebook"
                    break
                elif control == CONTROL_REJOIN:
                    outcome = "stopped: the pool restarts"
                    break
        except KeyboardInterrupt:
            outcome = "interrupted on this node"
        except Exception as exc:  # starting the ranks failed: the notebook must hear why
            outcome = f"failed on this node: {_first_line(exc)}"
            raise
        finally:
            supervisor.stop(grace=STOP_GRACE_S)
            if relay is not None:
                relay.drain_output(timeout=1.0)
            if self.handler is not None:  # before "done": the notebook closes the store then
                with contextlib.suppress(Exception):
                    self.handler.shutdown()
            uplink.news("done", outcome=outcome)
            uplink.close()
            if relay is not None:
                relay.close()
            supervisor.close()
        self.say(f"run {plan.run_id}: {outcome}")
        if self._control_value == CONTROL_REJOIN:
            self._wait_for_old_store()
            self.say("joining the pool's next start")
            return REJOIN
        return EXIT_OK if outcome == "finished" else EXIT_FAILED

    def _take_tasks(self, supervisor: Supervisor) -> None:
        """A pool's next task, and the notebook's interrupt of the running one (from the store)."""
        try:
            key = self.keys.task(self.next_task)
            if self.store.check([key]):
                record = self.secret.open(self.store.get(key), key)
                ranks = record["ranks"]
                message = task_message(
                    record["payload"], record["task_id"], ranks, self.plan.world_size
                )
                for rank in supervisor.ranks:
                    if rank.rank in ranks:
                        supervisor.send(rank, message)
                self.task, self.next_task, self.task_interrupted = (
                    self.next_task,
                    self.next_task + 1,
                    False,
                )
            if self.task is not None and not self.task_interrupted:
                key = self.keys.interrupt(self.task)
                if self.store.check([key]):
                    ranks = self.secret.open(self.store.get(key), key)
                    self.task_interrupted = True
                    for rank in supervisor.ranks:
                        if rank.rank in ranks and not rank.ended:
                            signal_pid(rank.pid, signal.SIGINT)
        except AuthenticationError as exc:
            self.say(f"ignored a task record: {exc}")
            self.next_task += 1
        except Exception as exc:
            self.uplink.lost = _first_line(exc)

    def _wait_for_old_store(self) -> None:
        """Until the notebook closed this start's rendezvous: joining again before would find
        the old one (bounded by ``OLD_STORE_WAIT_S``)."""
        deadline = time.monotonic() + OLD_STORE_WAIT_S
        while time.monotonic() < deadline:
            try:
                self.store.check([self.keys.control])
            except Exception:
                return
            time.sleep(0.1)

    def _note(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if event["kind"] == "finished":
                self.finished.add(event["rank"])
            elif event["kind"] == "result":
                self.returned.add(event["rank"])

    def _control(self) -> str | None:
        """What the notebook wants (checked every ``CONTROL_INTERVAL_S``); None: carry on."""
        now = time.monotonic()
        if now - self._last_control_check < CONTROL_INTERVAL_S:
            return None
        self._last_control_check = now
        try:
            if not self.store.check([self.keys.control]):
                return None
            value = self.store.get(self.keys.control)
        except Exception as exc:
            self.uplink.lost = _first_line(exc)
            return None
        try:
            self._control_value = self.secret.verify(value, self.keys.control).decode()
            return self._control_value
        except AuthenticationError:
            if not self._forged_control:  # ignored, and said once
                self._forged_control = True
                self.say(
                    "ignored a control value that failed authentication: another client is "
                    "writing to the run's store"
                )
                self.uplink.news(
                    "forged_control", message="a forged control value was ignored on this node"
                )
            return None


def _terminate_as_interrupt() -> None:
    """Take SIGTERM (``scancel``, ``kill``) like Ctrl-C: stop the ranks, tell the notebook."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def _beat_store(store: Any) -> Any:
    """A second connection to the store, for the beat thread (a client is not shared)."""
    try:
        return store.clone()
    except Exception:
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


if __name__ == "__main__":  # pragma: no cover - python -m nblaunch.cluster.join
    sys.exit(main())
