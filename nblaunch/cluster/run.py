"""Runs across several machines: the notebook node hosts, the other nodes join.

A multi-node run is the single-node run of :mod:`nblaunch.engine.run.run` on every node, tied
together by PyTorch's own elastic rendezvous (``torch.distributed.elastic``'s c10d rendezvous)::

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
- **Decisions** are taken in one place, the notebook's :class:`~nblaunch.engine.run.run.Run`: the
first
  primary failure on any node is the root cause; the notebook then sets the control key and
  every node stops its ranks. (An elastic agent per node would hide a remote failure from the
  notebook node behind its exit barrier; here no node decides on its own.)

We use the elastic *rendezvous* but not the elastic *agent*: the agent's worker management would
replace the supervisor that captures output, finds the root cause and restores the notebook's
signal handlers.

Where each part lives: :mod:`~nblaunch.cluster.store` (the store and torch's rendezvous on it),
:mod:`~nblaunch.cluster.channel` (the records the nodes exchange through it),
:mod:`~nblaunch.cluster.plan` (each node's ranks), :mod:`~nblaunch.cluster.head` (the notebook
node's side), this module (the run itself), :mod:`~nblaunch.cluster.join` and
:mod:`~nblaunch.cluster.node_run` (a joined node's side).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nblaunch.cluster.channel import (
    CONTROL_INTERRUPT,
    CONTROL_OK,
    CONTROL_REJOIN,
    CONTROL_STOP,
    NOTEBOOK_SILENCE_S,
    rank_span,
)
from nblaunch.cluster.head import Head
from nblaunch.cluster.node_start import JoinStarter
from nblaunch.cluster.plan import MultiNodePlan, plan_nodes
from nblaunch.cluster.store import require_store_queues, signal_handlers_kept
from nblaunch.engine.background.background_run import BackgroundTask
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.monitors.protocol import Monitor
from nblaunch.engine.output.relay import EventSource, Relay
from nblaunch.engine.plan.launch_plan import serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.engine.verdict import Cause, Outcome, RootCause
from nblaunch.errors import RankFailedError, add_note
from nblaunch.events import EventSink, RunState
from nblaunch.options import LaunchOptions, NodeOptions

# How long the notebook waits for the other nodes to report their ranks stopped.
NODE_STOP_WAIT_S = 8.0


def launch_multinode(
    function: Any,
    args: tuple[Any, ...] | list[Any],
    num_processes: int | None,
    options: LaunchOptions,
    nodes: NodeOptions,
    *,
    view_factory: Callable[[], EventSink],
    kwargs: dict[str, Any] | None = None,
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
    view_factory
        Makes the view events go to; the caller's front end picks it (a widget, text, nothing),
        so this package needs no notebook. Called once the arguments are checked: a launch
        refused for bad arguments shows no view.

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

    plan, payload = plan_multinode(function, args, num_processes, options, nodes, kwargs)
    return MultiNodeLaunch(plan, view_factory(), nodes).execute(payload)


def plan_multinode(
    function: Any,
    args: tuple[Any, ...] | list[Any],
    num_processes: int | None,
    options: LaunchOptions,
    nodes: NodeOptions,
    kwargs: dict[str, Any] | None = None,
) -> tuple[MultiNodePlan, bytes]:
    """This node's plan and what every rank runs, the arguments checked (nothing started)."""
    require_store_queues()
    plan = plan_nodes(function, num_processes, options, nodes)
    return plan, serialize_payload(function, args, kwargs)


def in_background(plan: MultiNodePlan, payload: bytes, nodes: NodeOptions) -> BackgroundTask:
    """A multi-node run on a thread of this process (``block=False``), not started yet: the
    nodes gather there too, so the cell is free at once."""
    hub = EventHub()
    launch = MultiNodeLaunch(plan, hub, nodes)
    return BackgroundTask(
        hub, plan.run_id, plan.run_dir, lambda: launch.execute(payload), launch.request_stop
    )


class MultiNodeLaunch:
    """One multi-node run from its start to its end: the other nodes started (when asked),
    their rendezvous, then the run; in the cell, on a thread (``block=False``) or in a run host
    (``detach=True``).

    Parameters
    ----------
    plan
        This node's plan (:func:`~nblaunch.cluster.plan.plan_nodes`).
    view
        Where the events go; closed at the end.
    nodes
        How many machines, where they meet, and who starts their joins.
    """

    def __init__(self, plan: MultiNodePlan, view: EventSink, nodes: NodeOptions) -> None:
        self.plan = plan
        self.view = view
        self.nodes = nodes
        self.run: MultiNodeRun | None = None  # once every node joined
        self._stop = threading.Event()

    def execute(self, payload: bytes) -> list[Any]:
        """Run ``payload`` on every rank of every node; see :func:`launch_multinode`."""
        with signal_handlers_kept():
            starter: JoinStarter | None = None
            try:
                head = Head(self.plan, self.view)
                try:
                    if self.nodes.start_nodes is not None:
                        starter = head.start_joins(self.nodes)
                    head.rendezvous(payload, self.nodes.rdzv_timeout, starter, self._stop)
                    self.run = MultiNodeRun(self.plan, self.view, head, starter)
                    if self._stop.is_set():  # asked while the nodes gathered
                        self.run.request_stop()
                    return self.run.execute(payload)
                except Exception as exc:
                    _note_placement(exc, starter)
                    raise
                finally:
                    head.close()
                    if starter is not None:
                        starter.close()
            finally:
                if self.run is None:  # the run closes the view; before it exists, close it here
                    self.view.close()

    def request_stop(self) -> None:
        """Stop as the interrupt button would, from any thread: while the nodes gather, or
        once the ranks run (every node's)."""
        self._stop.set()
        if self.run is not None:
            self.run.request_stop()

    @property
    def outcome(self) -> Outcome:
        """The run's verdict so far (empty before the ranks started)."""
        return self.run.outcome if self.run is not None else Outcome()


def _note_placement(exc: BaseException, starter: JoinStarter | None) -> None:
    """A failed run says what its starter knows of how the joins ended: a Slurm job that no
    longer runs (preempted, cancelled, out of time, a node failed), with Slurm's reason and the
    job's log; srun's step that ended badly."""
    text = starter.note() if starter is not None else None
    if text:
        add_note(exc, text)


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
            head.join_pids[node] = news.get("pid", 0)
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
            waiting -= self.head.done | self.head.unreachable
            waiting -= set(self.head.silent_nodes())
            if waiting:
                time.sleep(0.05)
        relay.sink.flush()


class _NodeMonitor:
    """Fails the run when another node breaks down, goes silent, or its starter knows it lost
    (its ranks then count as lost)."""

    def __init__(self, head: Head, starter: JoinStarter | None) -> None:
        self.head = head
        self.starter = starter

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        pass

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: Run) -> RootCause | None:
        head = self.head
        stopped = "the run was stopped on every node"
        # It cannot be told: it stops its ranks when it has not reached the notebook for
        # NOTEBOOK_SILENCE_S (or they ended with its join).
        untold = (
            "the run was stopped on the other nodes; that node cannot be told and stops its "
            f"own ranks by itself once it has not reached this notebook for "
            f"{NOTEBOOK_SILENCE_S:g} s"
        )
        problems = [(node, message, stopped) for node, message in head.errors]
        # Its join is gone, and its ranks with it (they watch their launcher): nothing to tell.
        gone = "the run was stopped on the other nodes; that node's ranks ended with its join"
        problems += [(node, message, gone) for node, message in self._lost()]
        problems += [
            (
                node,
                f"sent nothing for {head.silence_s:g} s (its machine, or the network to it, "
                "may be down)",
                untold,
            )
            for node in head.silent_nodes()
        ]
        peer = run.outcome.failures[0] if run.outcome.failures else None
        if peer is not None and peer.secondary and not run.outcome.primaries():
            problems += [
                (
                    node,
                    f"went silent ({head.peer_silence_s:g} s) when rank {peer.rank} lost its "
                    "connection to it: its join was stopped or killed, or its machine or "
                    "network went down",
                    untold,
                )
                for node in head.silent_nodes(head.peer_silence_s)
            ]
        if not problems:
            return None
        node, message, after = problems[0]
        if after != stopped:  # nobody waits for it to report its ranks stopped
            head.unreachable.add(node)
        plan = head.plan
        first = node * plan.nproc_per_node
        name = run.node_named(node)
        text = f"{name}, {rank_span(first, first + plan.nproc_per_node - 1)}, {message}; {after}"
        for rank in range(first, first + plan.nproc_per_node):
            run.set_state(rank, RunState.FAILED, message[:200])
        return RootCause(
            Cause.NODE,
            first,
            text,
            title=f"{name} failed",
            exception=RankFailedError(text, rank=first, world_size=plan.world_size),
        )

    def _lost(self) -> list[tuple[int, str]]:
        """The nodes whose join its starter knows lost (a Ray agent reported dead; over ssh, srun
        or a Slurm job a lost node is known by its silence)."""
        head = self.head
        if self.starter is None or head.control_sent is not None:
            return []
        lost = []
        for pid, message in self.starter.lost().items():
            node = next((n for n, p in head.join_pids.items() if p == pid), None)
            if node is not None and node not in head.done:
                lost.append((node, message))
        return lost


class MultiNodeRun(Run):
    """A :class:`~nblaunch.engine.run.run.Run` whose ranks live on several nodes.

    This node's ranks are supervised here as in a single-node run; the other nodes' events
    reach the same relay from the store (:class:`RemoteNodes`). The decisions (root cause, when
    to stop) are the ordinary run's; stopping also tells every other node, through the store,
    to stop its ranks.
    """

    restarts_ranks = False  # other nodes' ranks cannot be started again from here

    def __init__(
        self,
        plan: MultiNodePlan,
        view: EventSink,
        head: Head,
        starter: JoinStarter | None = None,
    ) -> None:
        self.head = head  # before the run's own set-up, which asks for its monitors
        self.starter = starter  # what started the other nodes' joins, if this notebook did
        super().__init__(plan, view)
        self.announced = True  # the head showed the header before the rendezvous

    # --- the hooks of a Run ---------------------------------------------------------------------

    def start_processes(self) -> None:
        plan: MultiNodePlan = self.plan  # type: ignore[assignment]
        self.backend.start(plan.local_ranks, setup=plan.setup_message)

    def more_monitors(self) -> list[Monitor]:
        return [_NodeMonitor(self.head, self.starter)]

    def event_sources(self, relay: Relay) -> list[EventSource]:
        return [RemoteNodes(self.head, relay)]

    def task_sent(self, task_id: int, payload: bytes) -> None:
        """A pool's other nodes read the task from the store (a one-shot run's took theirs at
        the rendezvous)."""
        if self.plan.pool:  # type: ignore[attr-defined]
            self.head.publish_task(task_id, self.task_ranks, payload)

    def interrupt_elsewhere(self, ranks: list[int]) -> None:
        self.head.interrupt(ranks)

    def stopping(self, ok: bool | None) -> None:
        if ok is None:
            self.head.control(CONTROL_INTERRUPT)
        else:
            reason = "" if ok else _reason(self.outcome.root)
            self.head.control(CONTROL_OK if ok else CONTROL_STOP, reason)

    def host_of(self, node: int) -> str:
        return self.head.hosts.get(node, "?")

    def release_nodes(self, rejoin: bool) -> None:
        """Tell the other nodes to stop their ranks, and either exit or join this pool's next
        start (``rejoin``); wait (bounded) for them to say so, then close the rendezvous."""
        self.head.control(CONTROL_REJOIN if rejoin else CONTROL_OK)
        if self.relay is not None:
            self.relay.drain_output(timeout=0.5)
        self.head.close()


def _reason(root: RootCause | None) -> str:
    """Why the run stopped, in a line, for the other nodes to say."""
    if root is None:
        return "interrupted in the notebook"
    text = (root.message.strip().splitlines() or [""])[0][:500]
    if root.cause is Cause.FAILURE:
        return f"rank {root.rank} raised {root.exc_type.rsplit('.', 1)[-1]}: {text}"
    return text
