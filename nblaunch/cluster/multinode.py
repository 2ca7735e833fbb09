"""Runs across several machines: the notebook node hosts, the other nodes join.

A multi-node run is the single-node run of :mod:`nblaunch.engine.run` on every node, tied together
by PyTorch's own elastic rendezvous (``torch.distributed.elastic``'s c10d rendezvous)::

    notebook node (node 0)                                   other nodes
      TCPStore on rdzv_endpoint ◀── c10d rendezvous ──────── python -m nblaunch join ENDPOINT
        config + payload        ───────────────────────────▶   --run-id RUN (nblaunch.cluster.join)
        "up" queue              ◀── events, output lines ────   Supervisor + Relay → store
        "control" key           ─── ok / stop / interrupt ──▶   stops its ranks
      Supervisor: ranks 0..n-1                                 Supervisor: ranks k*n..k*n+n-1
      Run: root cause, view, results of every rank

- **Rendezvous**: the notebook node listens on the address of ``rdzv_endpoint`` only (torch's
  ``TCPStore`` would listen on every interface; we hand it a socket bound to that address). Node
  membership, the join timeout and node ranks come from the elastic ``DynamicRendezvousHandler``
  with the ``C10dRendezvousBackend`` on that store, as under ``torchrun --rdzv-backend c10d``.
  Node ranks are its ranks, rotated so the notebook node is node 0 and holds global rank 0.
- **Payload**: the function and its arguments (cloudpickle bytes) wait in the store; a joining
  node needs only nblaunch installed, not the notebook.
- **Process group**: every rank connects to the same store as a client, the contract of
  ``TORCHELASTIC_USE_AGENT_STORE=True``; so one port serves rendezvous and process group.
- **Events**: each joined node runs the ordinary supervisor and relay; its relay's sink pushes
  the events and output lines of its ranks, in batches, onto a queue in the store, which the
  notebook's relay pops alongside its own pipes. No second connection, no extra port.
- **Decisions** are taken in one place, the notebook's :class:`~nblaunch.engine.run.Run`: the first
  primary failure on any node is the root cause; the notebook then sets the control key and
  every node stops its ranks. (An elastic agent per node would hide a remote failure from the
  notebook node behind its exit barrier; here no node decides on its own.)

We use the elastic *rendezvous* but not the elastic *agent*: the agent's worker management would
replace the supervisor that captures output, finds the root cause and restores the notebook's
signal handlers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from nblaunch.cluster.node_start import NodeStarter, start_joins
from nblaunch.cluster.trust import SECRET_ENV, RunSecret, SigningStore, remove_secret_file
from nblaunch.engine.plan import LaunchPlan, detect_devices, plan_launch, serialize_payload
from nblaunch.engine.relay import Relay
from nblaunch.engine.run import Run
from nblaunch.engine.run_files import open_private
from nblaunch.engine.supervisor import warm_up
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import (
    AuthenticationError,
    LaunchError,
    RankFailedError,
    RendezvousTimeoutError,
)
from nblaunch.events import Event, EventSink, NullView, RunState, diagnosis
from nblaunch.options import DEFAULT_RDZV_PORT, LaunchOptions, NodeOptions

# Where the notebook node's news about the other nodes is kept, in the run directory.
NODES_LOG = "nodes.log"
# Timeout of single store operations (a get, a push); generous, the network may be slow.
STORE_TIMEOUT_S = 60.0
# A node that sent nothing (not even its once-a-second beat) for this long is taken as lost.
NODE_SILENCE_S = 30.0
# How long the notebook waits for the other nodes to report their ranks stopped.
NODE_STOP_WAIT_S = 8.0
# How often a joined node pushes the events it collected, and its liveness beat.
PUSH_INTERVAL_S = 0.05
BEAT_INTERVAL_S = 1.0
# The format of the settings a joining node reads; a node refuses a run of another format.
CONFIG_VERSION = 1
# Control values the notebook sets for the other nodes, in the order they may follow each other.
CONTROL_INTERRUPT = "interrupt"
CONTROL_OK = "ok"
CONTROL_STOP = "stop"
# A pool's nodes: stop the ranks and join the pool's next start (a restart, a broken pool).
CONTROL_REJOIN = "rejoin"


class Keys:
    """Names of the store keys of one run (all under ``nblaunch/<run id>/``)."""

    def __init__(self, run_id: str) -> None:
        base = f"nblaunch/{run_id}/"
        self.config = base + "config"  # pickled dict: what the nodes need to start their ranks
        self.payload = base + "payload"  # cloudpickle bytes of (function, args, kwargs)
        self.hello = base + "hello"  # queue: one record per node arriving (or refusing)
        self.head_rank = base + "head_rank"  # the notebook node's rank in the rendezvous
        self.complete = base + "complete"  # set once every node joined: latecomers are refused
        self.up = base + "up"  # queue: batches of events from the other nodes
        self.control = base + "control"  # what the notebook tells the other nodes to do
        self._base = base

    def task(self, number: int) -> str:
        """A pool's ``number``-th task since it started: its ranks and payload (sealed)."""
        return f"{self._base}task/{number}"

    def interrupt(self, number: int) -> str:
        """The ranks of a pool's ``number``-th task that the notebook interrupts (sealed)."""
        return f"{self._base}interrupt/{number}"


# --- endpoints and stores ------------------------------------------------------------------------


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[v6]:port"``; port 29400 when left out).

    Raises
    ------
    LaunchError
        When the endpoint is empty or malformed.
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if not isinstance(endpoint, str) or not endpoint.strip():
        raise LaunchError(
            f"rdzv_endpoint must be 'host:port', an address of this machine that the other "
            f"nodes can reach, e.g. 'head-node:{DEFAULT_RDZV_PORT}'; got {endpoint!r}"
        )
    try:
        return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_RDZV_PORT)
    except ValueError as exc:
        raise LaunchError(f"rdzv_endpoint={endpoint!r} is not 'host:port': {exc}") from None


def listen_on(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` only.

    Raises
    ------
    LaunchError
        When this machine cannot listen there (not one of its addresses, port busy).
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise LaunchError(
            f"cannot listen on rdzv_endpoint {host}:{port}: {exc.strerror or exc}. It must be an "
            "address of this (the notebook's) machine that the other nodes can reach, and a "
            "free port"
        ) from None


def host_store(host: str, port: int) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` only.

    ``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host`` says;
    handing it a socket we bound ourselves keeps the rendezvous on the address the person gave.

    Raises
    ------
    LaunchError
        When this machine cannot listen there (not one of its addresses, port busy).
    """
    import torch.distributed as dist

    listener = listen_on(host, port)
    return dist.TCPStore(
        host,
        port,
        None,
        True,
        datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def connect_store(host: str, port: int, timeout: float = STORE_TIMEOUT_S) -> Any:
    """A client of the store at ``host:port``; retries connecting for up to ``timeout`` s."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))


def rendezvous_handler(
    store: Any,
    run_id: str,
    num_nodes: int,
    local_addr: str | None,
    join_timeout: float,
    secret: RunSecret,
    endpoint: str,
) -> Any:
    """torch's c10d rendezvous for exactly ``num_nodes`` nodes, on ``store``; torch unpickles
    its state, so its backend reads and writes it signed with the run's ``secret``."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    return DynamicRendezvousHandler.from_backend(
        run_id,
        store,
        C10dRendezvousBackend(SigningStore(store, secret, endpoint), run_id),
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        local_addr=local_addr,
        timeout=RendezvousTimeout(join=datetime.timedelta(seconds=join_timeout)),
    )


@contextlib.contextmanager
def unshared_rendezvous_store() -> Iterator[None]:
    """Keep the rendezvous from starting a second TCPStore server (on every interface).

    By default the node of rank 0 starts a store server for its workers; ours use the
    rendezvous store (see ``MultiNodePlan.rank_env``), so ask torch not to.
    """
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def node_rank_of(rdzv_rank: int, head_rdzv_rank: int) -> int:
    """The node rank of a node: its rendezvous rank, rotated so the notebook node is node 0.

    The rendezvous numbers nodes by their sorted addresses; rank 0 belongs on the notebook's node
    (it is where ``is_main_process()`` code saves files the notebook can read).
    """
    if rdzv_rank == head_rdzv_rank:
        return 0
    return rdzv_rank + 1 if rdzv_rank < head_rdzv_rank else rdzv_rank


def local_host_name(local_addr: str | None = None) -> str:
    """How a node is named in the notebook: its hostname (and address, when one was given)."""
    name = socket.gethostname()
    return f"{name} ({local_addr})" if local_addr and local_addr != name else name


@contextlib.contextmanager
def signal_handlers_kept(
    signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
) -> Iterator[None]:
    """Put back the handlers of ``signums`` as they were, whatever ran in between.

    torch.distributed.elastic installs its own SIGINT/SIGTERM handlers in places and does not
    restore them; the notebook's interrupt button must keep raising ``KeyboardInterrupt``.
    Signal handlers can only be set from the main thread; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


def rank_span(first: int, last: int) -> str:
    """``rank 3`` or ``ranks 2-5``."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


# --- the plan ------------------------------------------------------------------------------------


@dataclasses.dataclass
class MultiNodePlan(LaunchPlan):
    """A launch plan for one node of a multi-node run.

    ``world_size`` counts every rank of every node; this node runs global ranks
    ``node_rank * nproc_per_node`` to ``(node_rank + 1) * nproc_per_node - 1``.
    """

    num_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_run_id: str = "nblaunch"
    pool: bool = False  # ranks stay up between tasks, which come through the store

    @property
    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    @property
    def run_id(self) -> str:
        return self.rdzv_run_id

    @property
    def threads_per_rank(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.nproc_per_node)

    def rank_env(self, rank: int) -> dict[str, str]:
        """The torchrun contract for ``rank`` of a multi-node run, as ``torchrun`` sets it."""
        env = super().rank_env(rank)
        env.update(
            LOCAL_RANK=str(rank - self.node_rank * self.nproc_per_node),
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            NODE_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.num_nodes),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self.world_size),
            ROLE_NAME="default",
            TORCHELASTIC_RUN_ID=self.rdzv_run_id,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            # Every rank is a client of the store the notebook node hosts on MASTER_ADDR:PORT
            # (torch's env:// init honours this too, for code that sets up its own group).
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        return env

    def node_config(self) -> dict[str, Any]:
        """What a joining node needs from this plan to start its ranks (sent through the store)."""
        return {
            "version": CONFIG_VERSION,
            "num_nodes": self.num_nodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "device_type": self.device_type,
            "backend": self.backend,
            "debug": self.debug,
            "init_process_group": self.init_process_group,
            "hang_timeout": self.hang_timeout,
            "log_level": self.log_level,
            "master_port": self.master_port,
            "pool": self.pool,
        }


def plan_for_joined_node(
    config: dict[str, Any],
    *,
    node_rank: int,
    run_id: str,
    master_addr: str,
    start_method: str,
) -> MultiNodePlan:
    """The plan of a joined node, from the notebook's config and this node's own devices.

    Raises
    ------
    LaunchError
        When this node lacks the devices the run needs.
    """

    device_type, count, device_kind = detect_devices(config["device_type"])
    if device_type != "cpu" and config["nproc_per_node"] > count:
        raise LaunchError(
            f"the run needs {config['nproc_per_node']} {device_type.upper()} device(s) per node "
            f"but {socket.gethostname()} has {count}"
        )
    return MultiNodePlan(
        world_size=config["world_size"],
        device_type=device_type,
        backend=config["backend"],
        start_method=start_method,
        master_addr=master_addr,
        master_port=config["master_port"],
        debug=config["debug"],
        init_process_group=config["init_process_group"],
        timeout=None,
        hang_timeout=config["hang_timeout"],
        log_level=config["log_level"],
        run_dir=None,
        device_kind=device_kind,
        num_nodes=config["num_nodes"],
        nproc_per_node=config["nproc_per_node"],
        node_rank=node_rank,
        rdzv_run_id=run_id,
        pool=bool(config.get("pool")),
    )


# --- the notebook's side -------------------------------------------------------------------------


def launch_multinode(
    function: Any,
    args: tuple[Any, ...] | list[Any],
    num_processes: int | None,
    options: LaunchOptions,
    nodes: NodeOptions,
    *,
    kwargs: dict[str, Any] | None = None,
    display: str = "auto",
    view: EventSink | None = None,
) -> list[Any]:
    """Run ``function`` on ``num_processes`` ranks on each of ``nodes.num_nodes`` nodes.

    Called by :func:`~nblaunch.notebook.launcher.notebook_launcher` when ``num_nodes`` is given; see
    there for the options. This process is node 0 and holds ranks 0 to ``num_processes - 1``;
    the other nodes join with ``python -m nblaunch join`` (started by hand, or from here with
    ``nodes.start_nodes``: :mod:`nblaunch.cluster.node_start`).

    Parameters
    ----------
    num_processes
        Ranks *per node* (like torchrun's ``--nproc-per-node``); the run has
        ``num_processes * num_nodes`` ranks.
    options
        How the ranks start and are watched, as for one machine.
    nodes
        How many machines, where they meet (``rdzv_endpoint``: an address of this machine the
        other nodes can reach; one port serves the rendezvous, the process group's store and
        the event channel), how long to wait for them, the run id, and whether to start them.
    view
        Where events go, instead of the view ``display`` picks (for tests and other front ends).

    Returns
    -------
    list
        ``function``'s return value on each rank, indexed by global rank.

    Raises
    ------
    RendezvousTimeoutError
        Not every node joined within ``rdzv_timeout``: nothing ran.
    LaunchError
        Bad arguments, an address this machine cannot listen on, a node that cannot take part.
    Exception
        The failing rank's own exception, from whichever node it ran on.
    KeyboardInterrupt
        The launch was interrupted; every rank on every node has been stopped.
    """

    plan = plan_nodes(function, num_processes, options, nodes)
    payload = serialize_payload(function, args, kwargs)
    if view is None:
        from nblaunch.notebook.widgets import make_view

        view = make_view(display)
    with signal_handlers_kept():
        run: MultiNodeRun | None = None
        starter: NodeStarter | None = None
        try:
            head = Head(plan, view)
            try:
                if nodes.start_nodes is not None:
                    starter = head.start_joins(nodes.start_nodes, nodes.hostfile)
                head.rendezvous(payload, nodes.rdzv_timeout, starter)
                run = MultiNodeRun(plan, view, head)
                return run.execute(payload)
            finally:
                head.close()
                if starter is not None:
                    starter.close()
        finally:
            if run is None:  # the run closes the view; before it exists, close it here
                view.close()


def plan_nodes(
    function: Any,
    num_processes: int | None,
    options: LaunchOptions,
    nodes: NodeOptions,
    pool: bool = False,
) -> MultiNodePlan:
    """Plan node 0 (this one) of a run on ``nodes``.

    Raises
    ------
    LaunchError
        Bad arguments, or an address this machine cannot listen on.
    """
    assert nodes.rdzv_endpoint is not None  # NodeOptions checked it
    host, port = parse_endpoint(nodes.rdzv_endpoint)
    listen_on(host, port).close()  # say now, in its own words, when we cannot listen there
    base = plan_launch(function, num_processes, options.replace(master_addr=host, master_port=None))
    if base.device_type == "xla":
        raise LaunchError("multi-node runs support CUDA and CPU ranks, not XLA devices")
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values.update(world_size=base.world_size * nodes.num_nodes, master_port=port)
    return MultiNodePlan(
        **values,
        num_nodes=nodes.num_nodes,
        nproc_per_node=base.world_size,
        node_rank=0,
        rdzv_run_id=nodes.rdzv_id or base.run_id,
        pool=pool,
    )


class Head:
    """The notebook node's side: hosts the store and the rendezvous, talks to the other nodes."""

    def __init__(self, plan: MultiNodePlan, view: EventSink, secret: RunSecret | None = None):
        self.plan = plan
        self.host = host = plan.master_addr
        self.port = port = plan.master_port
        self.view = view
        self.keys = Keys(plan.run_id)
        self.server = host_store(host, port)
        self.store = connect_store(host, port)
        self.handler: Any = None
        self.hosts: dict[int, str] = {0: local_host_name()}  # node rank -> name
        self.arrived: list[dict[str, Any]] = []  # hello records of the other nodes
        self.last_seen: dict[int, float] = {}  # node rank -> monotonic time of its last batch
        self.done: set[int] = set()  # nodes that reported their ranks stopped
        self.errors: list[tuple[int, str]] = []  # (node, message) of nodes that broke down
        self._control: str | None = None
        # Only holders of the run's secret may write what this kernel reads
        # (nblaunch.cluster.trust).
        # A pool keeps its secret across restarts: the nodes' join commands stay valid.
        self.secret = secret or RunSecret.new()
        self.secret.write_file(plan.run_id)  # for nodes sharing this home directory
        self.received: dict[int, int] = {}  # node -> events received from it so far
        self.dropped = 0  # records that failed authentication
        self.tasks_published = 0  # a pool's tasks sent to the other nodes

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def join_command(self) -> str:
        # The secret goes in the environment, which other users cannot read (unlike arguments).
        return (
            f"{SECRET_ENV}={self.secret.text} python -m nblaunch join {self.endpoint} "
            f"--run-id {self.plan.run_id}"
        )

    # --- before the ranks start --------------------------------------------------------------

    def start_joins(self, start_nodes: str, hostfile: str | os.PathLike[str] | None) -> NodeStarter:
        """Start ``join`` on the other nodes from here (:mod:`nblaunch.cluster.node_start`)."""
        return start_joins(
            start_nodes,
            count=self.plan.num_nodes - 1,
            endpoint=self.endpoint,
            run_id=self.plan.run_id,
            secret=self.secret.text,
            log_dir=self.plan.run_dir,
            hostfile=hostfile,
        )

    def rendezvous(
        self, payload: bytes | None, timeout: float, starter: NodeStarter | None = None
    ) -> None:
        """Publish the run, wait for every node, and show each one as it arrives.

        ``payload`` is the one-shot run's task; a pool's tasks come later (:meth:`publish_task`).
        ``starter``: the join commands this notebook started, which fail the rendezvous at once
        when one ends badly.

        Raises
        ------
        RendezvousTimeoutError
            When not every node joined within ``timeout`` seconds.
        LaunchError
            When a node reported that it cannot take part, or the rendezvous broke down.
        """
        plan = self.plan
        keys = self.keys
        config = {**plan.node_config(), "rdzv_timeout": timeout}
        self.store.set(keys.config, self.secret.seal(config, keys.config))
        if payload is not None:
            self.store.set(keys.payload, self.secret.seal(payload, keys.payload))
        self._show(plan.run_info(time.time()))
        others = plan.num_nodes - 1
        if others:
            how = (
                starter.describe()
                if starter is not None
                else f"run this on each of the other {others} node(s) (by hand, ssh, or srun):\n"
                f"  {self.join_command()}"
            )
            self.info(
                f"waiting for {others} more node(s) at {self.endpoint}",
                f"{how}\n{plan.num_nodes} node(s) x {plan.nproc_per_node} rank(s) = "
                f"{plan.world_size} ranks; waiting up to {timeout:g} s",
            )
        warm_up(plan.start_method)
        # The rendezvous blocks; it runs on a thread (with its own connection to the store) so
        # that this thread can show the nodes arriving and take the notebook's interrupt.
        self.handler = rendezvous_handler(
            connect_store(self.host, self.port),
            plan.run_id,
            plan.num_nodes,
            self.host,
            timeout,
            self.secret,
            self.endpoint,
        )
        outcome: dict[str, Any] = {}

        def join() -> None:
            try:
                outcome["info"] = self.handler.next_rendezvous()
            except BaseException as exc:
                outcome["error"] = exc

        with unshared_rendezvous_store():
            thread = threading.Thread(target=join, name="nblaunch-rendezvous", daemon=True)
            thread.start()
            try:
                while thread.is_alive():
                    thread.join(0.1)
                    self._take_hellos()
                    self.view.flush()
                    problem = starter.problem(others) if starter is not None else None
                    if problem is not None:
                        raise LaunchError(f"{problem}. Nothing was started.")
            except BaseException:
                self._close_rendezvous()
                raise
        if "error" in outcome:
            self._close_rendezvous()
            self._raise_rendezvous_error(outcome["error"], timeout)
        info = outcome["info"]
        self.store.set(keys.head_rank, self.secret.sign(str(info.rank), keys.head_rank))
        self.store.set(keys.complete, self.secret.sign("1", keys.complete))
        self._take_hellos()
        if others:
            self.info(
                f"all {plan.num_nodes} nodes joined",
                f"starting {plan.nproc_per_node} rank(s) on each node",
            )
        now = time.monotonic()
        self.last_seen = {node: now for node in range(1, plan.num_nodes)}

    def _take_hellos(self) -> None:
        """Show the nodes that arrived; fail at once when one reported it cannot take part."""
        for record in self._pop_all(self.keys.hello):
            if not isinstance(record, dict) or "host" not in record:
                continue
            if record.get("error"):
                self._close_rendezvous()
                raise LaunchError(
                    f"node {record['host']} cannot join the run at {self.endpoint}: "
                    f"{record['error']}. Nothing was started."
                )
            self.arrived.append(record)
            missing = self.plan.num_nodes - 1 - len(self.arrived)
            self.info(
                f"node {record['host']} joined",
                f"{len(self.arrived) + 1} of {self.plan.num_nodes} nodes are here"
                + (f"; waiting for {missing} more" if missing > 0 else ""),
            )

    def _raise_rendezvous_error(self, error: BaseException, timeout: float) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError as Timeout

        joined = len(self.arrived) + 1
        if isinstance(error, Timeout):
            names = ", ".join([self.hosts[0], *(r["host"] for r in self.arrived)])
            raise RendezvousTimeoutError(
                f"only {joined} of {self.plan.num_nodes} nodes joined the rendezvous at "
                f"{self.endpoint} within rdzv_timeout={timeout:g} s (joined: {names}). Run "
                f"`{self.join_command()}` on each missing node, check that they can reach "
                f"{self.endpoint} (firewall, address), or pass num_nodes={joined}. "
                "Nothing was started.",
                endpoint=self.endpoint,
                joined=joined,
                expected=self.plan.num_nodes,
            ) from None
        if isinstance(error, AuthenticationError):  # torch's rendezvous state was tampered with
            raise error
        raise LaunchError(
            f"the rendezvous at {self.endpoint} failed: {type(error).__name__}: {error}"
        ) from error

    def _close_rendezvous(self) -> None:
        """Close the rendezvous, so nodes still waiting (or arriving late) give up at once."""
        with contextlib.suppress(Exception):
            self.store.set(self.keys.control, self.secret.sign(CONTROL_STOP, self.keys.control))
        with contextlib.suppress(Exception):
            closer = rendezvous_handler(
                connect_store(self.host, self.port, timeout=5.0),
                self.plan.run_id,
                self.plan.num_nodes,
                self.host,
                5.0,
                self.secret,
                self.endpoint,
            )
            closer.set_closed()

    # --- while the ranks run -----------------------------------------------------------------

    def pull(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The batches the other nodes pushed since the last call: ``(node, events)``."""
        batches = []
        now = time.monotonic()
        for record in self._pop_all(self.keys.up):
            node, first, events = record
            if node not in self.last_seen:
                continue  # not a node of this run
            self.last_seen[node] = now
            expected = self.received.get(node, 0)
            if first > expected:  # taken off the queue by someone else
                self.warn(
                    f"{first - expected} event(s) from node {self.hosts.get(node, node)} were "
                    "removed from the run's store by another client",
                    "Output lines or events of that node's ranks are missing from the view and "
                    f"the rank logs. Something else reads the store at {self.endpoint}.",
                )
            elif first < expected:
                continue  # a record seen before, pushed again
            self.received[node] = first + len(events)
            batches.append((node, events))
        return batches

    def publish_task(self, task_id: int, ranks: list[int], payload: bytes) -> None:
        """A pool's next task, for the other nodes to give to their ranks among ``ranks``.

        Tasks are numbered from 0 at each start of the pool (the nodes count the same way);
        the previous one has ended on every rank, so its keys go.
        """
        number = self.tasks_published
        if number:
            with contextlib.suppress(Exception):
                self.store.delete_key(self.keys.task(number - 1))
                self.store.delete_key(self.keys.interrupt(number - 1))
        key = self.keys.task(number)
        record = {"task_id": task_id, "ranks": ranks, "payload": payload}
        self.store.set(key, self.secret.seal(record, key))
        self.tasks_published += 1

    def interrupt(self, ranks: list[int]) -> None:
        """Interrupt ``ranks`` (a KeyboardInterrupt in the pool's current task) on their nodes."""
        key = self.keys.interrupt(self.tasks_published - 1)
        with contextlib.suppress(Exception):
            self.store.set(key, self.secret.seal(ranks, key))

    def control(self, value: str) -> None:
        """Tell every other node what to do with its ranks (``ok``, ``stop``, ``interrupt``)."""
        if value == self._control or self._control in (CONTROL_OK, CONTROL_STOP, CONTROL_REJOIN):
            return  # final; only an interrupt may be followed by another value
        self._control = value
        with contextlib.suppress(Exception):
            self.store.set(self.keys.control, self.secret.sign(value, self.keys.control))

    @property
    def control_sent(self) -> str | None:
        """The last control value sent to the other nodes (None while the run goes on)."""
        return self._control

    def silent_nodes(self) -> list[int]:
        now = time.monotonic()
        return sorted(
            node
            for node, seen in self.last_seen.items()
            if node not in self.done and now - seen > NODE_SILENCE_S
        )

    def _pop_all(self, key: str) -> list[Any]:
        from torch.distributed import QueueEmptyError

        records = []
        with contextlib.suppress(Exception):
            pending = self.store.queue_len(key)
            for _ in range(pending):
                try:
                    data = self.store.queue_pop(key, False)
                except QueueEmptyError:
                    break
                try:
                    records.append(self.secret.open(data, key))
                except AuthenticationError as exc:  # never unpickled: dropped and said
                    self.dropped += 1
                    self.warn(
                        f"a record on the run's store failed authentication and was dropped "
                        f"({self.dropped} so far)",
                        f"{exc}. Another client is writing to the store at {self.endpoint} "
                        "(the store does not tell who). Run on a private network, or check "
                        "who else reaches that port.",
                    )
        return records

    def info(self, title: str, body: str, severity: str = "info") -> None:
        """Show a line of news about the nodes (an ``info`` Diagnosis) at once.

        Whatever the display, it is also kept in the run directory's ``nodes.log`` (the secret
        left out), and with ``display="none"``, or when it is a warning, it goes to stderr: the
        join command must reach someone, and tampering is said even where no view is watched.
        """
        head = f"nblaunch: warning: {title}" if severity == "warning" else f"nblaunch: {title}"
        text = f"{head}\n" + "".join(f"  {line}\n" for line in body.splitlines())
        if self.plan.run_dir is not None:
            with (
                contextlib.suppress(OSError),
                open_private(self.plan.run_dir / NODES_LOG, "ab") as log,
            ):
                log.write(text.replace(self.secret.text, "<the run's secret>").encode())
        if isinstance(self.view, NullView) or severity == "warning":
            print(text, end="", file=sys.stderr, flush=True)
        self._show(diagnosis(title, body, severity, None))

    def warn(self, title: str, body: str) -> None:
        """Tampering seen: a warning in the view, and on stderr whatever the view."""
        self.info(title, body, severity="warning")

    def _show(self, event: Event) -> None:
        self.view.handle(event)
        self.view.flush()

    def close(self) -> None:
        """Close the rendezvous and stop listening; the port is free again afterwards."""
        if self._control is None:
            self.control(CONTROL_STOP)
        if self.handler is not None:
            with contextlib.suppress(Exception):
                self.handler.shutdown()
            self.handler = None
        self.store = None
        self.server = None  # the last reference: the server stops listening
        remove_secret_file(self.plan.run_id)


class RemoteNodes:
    """The other nodes' events, from the store, for the notebook's relay (an ``EventSource``).

    Remote events reach the view and the run like local ones, with ``host`` and ``node`` added;
    remote output is written to ``rank<N>.log`` here too, so every rank's log is in one place.
    """

    def __init__(self, head: Head, relay: Relay) -> None:
        self.head = head
        for rank in range(head.plan.world_size):  # remote in-order logs line up with local ones
            relay.in_order.add_rank(rank)

    def pull(self, relay: Relay) -> list[dict[str, Any]]:
        """Pass the other nodes' events on; return those the run acts on."""
        received: list[dict[str, Any]] = []
        for node, events in self.head.pull():
            host = self.head.hosts.get(node, f"node {node}")
            for event in events:
                if event["kind"] == "node":  # a node's own news: started, beat, done, broken
                    self._node_news(node, event)
                    continue
                event["host"] = host
                event["node"] = node
                # A death: the run makes it a failure and a state; the rest is shown and logged.
                if event["kind"] == "death" or relay.accept(event):
                    received.append(event)
        if received:
            relay.sink.flush()
        return received

    def _node_news(self, node: int, news: dict[str, Any]) -> None:
        head = self.head
        what = news["what"]
        if what == "started":
            head.hosts[node] = news["host"]
            span = rank_span(news["ranks"][0], news["ranks"][-1])
            head.info(f"node {node} started", f"{news['host']} runs {span}")
        elif what == "done":
            head.done.add(node)
            if head.control_sent is None:  # it stopped without being told to
                head.errors.append((node, f"stopped its ranks on its own: {news['outcome']}"))
        elif what == "error":
            head.errors.append((node, news["message"]))
        elif what == "forged_control":
            head.warn(
                f"node {head.hosts.get(node, node)} ignored a forged control value",
                f"Another client set the run's control key at {head.endpoint}; the node went on.",
            )

    def drain(self, relay: Relay) -> None:
        """Wait (bounded) for every other node to report its ranks stopped."""
        deadline = time.monotonic() + NODE_STOP_WAIT_S
        waiting = set(range(1, self.head.plan.num_nodes)) - self.head.done
        while waiting and time.monotonic() < deadline:
            self.pull(relay)
            waiting -= self.head.done
            waiting -= set(self.head.silent_nodes())
            if waiting:
                time.sleep(0.05)
        relay.sink.flush()


class _NodeMonitor:
    """Fails the run when another node breaks down or goes silent (its ranks then count as lost)."""

    def __init__(self, head: Head) -> None:
        self.head = head

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        pass

    def check(self, run: Run) -> RootCause | None:
        head = self.head
        problems = [(node, message) for node, message in head.errors]
        problems += [
            (node, f"sent nothing for {NODE_SILENCE_S:g} s (its machine or network may be down)")
            for node in head.silent_nodes()
        ]
        if not problems:
            return None
        node, message = problems[0]
        plan = head.plan
        first = node * plan.nproc_per_node
        host = head.hosts.get(node, f"node {node}")
        text = (
            f"node {node} ({host}), {rank_span(first, first + plan.nproc_per_node - 1)}, "
            f"{message}; "
            "the run was stopped on every node"
        )
        for rank in range(first, first + plan.nproc_per_node):
            run.set_state(rank, RunState.FAILED, message[:200])
        return RootCause(
            Cause.NODE,
            first,
            text,
            title=f"node {node} ({host}) failed",
            exception=RankFailedError(text, rank=first, world_size=plan.world_size),
        )


class MultiNodeRun(Run):
    """A :class:`~nblaunch.engine.run.Run` whose ranks live on several nodes.

    This node's ranks are supervised here as in a single-node run; the other nodes' events
    reach the same relay from the store (:class:`RemoteNodes`). The decisions (root cause, when
    to stop) are the ordinary run's; stopping also tells every other node, through the store,
    to stop its ranks.
    """

    restarts_ranks = False  # other nodes' ranks cannot be started again from here

    def __init__(self, plan: MultiNodePlan, view: EventSink, head: Head) -> None:
        super().__init__(plan, view)
        self.head = head
        self.announced = True  # the head showed the header before the rendezvous
        self.monitors.append(_NodeMonitor(head))

    def _start_processes(self) -> None:
        plan: MultiNodePlan = self.plan  # type: ignore[assignment]
        self.backend.start(plan.local_ranks, setup=plan.setup_message)

    def start(self) -> None:
        super().start()
        assert self.relay is not None
        self.relay.add_source(RemoteNodes(self.head, self.relay))

    def begin_task(self, view: EventSink, ranks: list[int], **options: Any) -> None:
        super().begin_task(view, ranks, **options)
        self.monitors.append(_NodeMonitor(self.head))

    def send_task(self, payload: bytes, task_id: int = 0, ranks: list[int] | None = None) -> None:
        """Send the task to this node's ranks among ``ranks``; a pool's other nodes read it
        from the store (a one-shot run's took theirs at the rendezvous)."""
        super().send_task(payload, task_id, ranks)
        if self.plan.pool:  # type: ignore[attr-defined]
            self.head.publish_task(task_id, self.task_ranks, payload)

    def interrupt(self, ranks: list[int]) -> None:
        """Interrupt ``ranks`` of the task: this node's by signal, the others' through the store."""
        local = {rank.rank for rank in self.backend.ranks}
        super().interrupt([r for r in ranks if r in local])
        remote = [r for r in ranks if r not in local]
        if remote:
            self.head.interrupt(remote)

    def release_nodes(self, rejoin: bool) -> None:
        """Tell the other nodes to stop their ranks, and either exit or join this pool's next
        start (``rejoin``); wait (bounded) for them to say so, then close the rendezvous."""
        self.head.control(CONTROL_REJOIN if rejoin else CONTROL_OK)
        if self.relay is not None:
            self.relay.drain_output(timeout=0.5)
        self.head.close()

    def on_event(self, event: dict[str, Any]) -> None:
        if event["kind"] == "death":
            self.on_death(event["rank"], event["exitcode"])
            self.outcome.failures[-1].message += f" (on node {event['node']}, {event['host']})"
            return
        super().on_event(event)

    def stop_on_interrupt(self) -> None:
        self.head.control(CONTROL_INTERRUPT)
        super().stop_on_interrupt()

    def finish(self) -> None:
        ok = len(self.outcome.results) == self.plan.world_size and self.outcome.root is None
        self.head.control(CONTROL_OK if ok else CONTROL_STOP)
        super().finish()
