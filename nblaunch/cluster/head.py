"""The notebook node's side of a multi-node run: it hosts the store and talks to the other nodes.

:class:`Head` holds the store server and the run's secret for the whole run: it reads the other
nodes' records (their ranks' events, their own news), keeps what is known of each node, shows
news about them, and sends them a pool's tasks, interrupts and the control value.
:class:`Rendezvous` is its part before the ranks start: it publishes the run, waits for every
node in torch's c10d rendezvous, and shows each one as it arrives.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

from nblaunch.cluster.channel import (
    CONTROL_OK,
    CONTROL_REJOIN,
    CONTROL_STOP,
    GATHER_POLL_S,
    Keys,
    local_host_name,
)
from nblaunch.cluster.node_start import JoinStarter, start_joins
from nblaunch.cluster.plan import MultiNodePlan
from nblaunch.cluster.store import (
    connect_store,
    host_store,
    rendezvous_handler,
    unshared_rendezvous_store,
)
from nblaunch.cluster.trust import SECRET_ENV, RunSecret, remove_secret_file
from nblaunch.engine.output.log_files import open_private
from nblaunch.engine.processes.supervisor import warm_up
from nblaunch.errors import AuthenticationError, LaunchError, RendezvousTimeoutError
from nblaunch.events import Event, EventSink, NullView, diagnosis
from nblaunch.options import NodeOptions

# Where the notebook node's news about the other nodes is kept, in the run directory.
NODES_LOG = "nodes.log"
# A node that sent nothing (not even its once-a-second beat) for this long is taken as lost;
# it takes the notebook as lost after NOTEBOOK_SILENCE_S of its own, and stops its ranks.
NODE_SILENCE_S = 8.0
# Once a rank lost a connection (a peer's failure, not yet explained), a node silent for this
# long (beats are 1 s apart) is the one that went: its join was killed, or its link is down.
PEER_SILENCE_S = 2.5


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
        self.handler: Any = None  # torch's rendezvous handler (set by Rendezvous), left at close
        here = plan.route.address if plan.route else None
        self.hosts: dict[int, str] = {0: local_host_name(here)}  # node rank -> name
        self.join_pids: dict[int, int] = {}  # node rank -> its join's pid (on its machine)
        self.last_seen: dict[int, float] = {}  # node rank -> monotonic time of its last batch
        self.silence_s = NODE_SILENCE_S  # read here, so that a test can shorten it
        self.peer_silence_s = PEER_SILENCE_S
        self.done: set[int] = set()  # nodes that reported their ranks stopped
        self.unreachable: set[int] = set()  # nodes taken as lost: none waits for them
        self.errors: list[tuple[int, str]] = []  # (node, message) of nodes that broke down
        self._control: str | None = None
        # Only holders of the run's secret may write what this kernel reads (cluster.trust).
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

    def start_joins(self, nodes: NodeOptions) -> JoinStarter:
        """Start ``join`` on the other nodes from here: over ssh or srun
        (:mod:`nblaunch.cluster.node_start`), placed by Ray (:mod:`nblaunch.cluster.ray_nodes`),
        or as a Slurm job (:mod:`nblaunch.cluster.slurm_nodes`).
        """
        assert nodes.start_nodes is not None
        if nodes.start_nodes == "slurm":
            from nblaunch.cluster import slurm_nodes  # not at import: rarely used

            job = nodes.cluster if isinstance(nodes.cluster, slurm_nodes.SlurmCluster) else None
            return slurm_nodes.start_slurm_job(
                job or slurm_nodes.SlurmCluster(),
                count=self.plan.num_nodes - 1,
                endpoint=self.endpoint,
                run_id=self.plan.run_id,
                secret=self.secret.text,
                log_dir=self.plan.run_dir,
                device_type=self.plan.device_type,
                nproc_per_node=self.plan.nproc_per_node,
                news=self.info,
            )
        if nodes.start_nodes == "ray":
            from nblaunch.cluster import ray_nodes  # not at import: Ray only when asked for

            cluster = ray_nodes.as_ray_cluster(nodes.cluster or "ray")
            bundle = ray_nodes.bundle_for(
                self.plan.device_type, self.plan.nproc_per_node, cluster.resources_per_node
            )
            # Never a silent wait: the placement is shown while Ray works on it.
            self.info(
                f"asking Ray to place {self.plan.num_nodes} nodes",
                f"{', '.join(f'{v:g} {k}' for k, v in bundle.items())} on each, one node "
                f"apiece (STRICT_SPREAD); up to {cluster.placement_timeout:g} s",
            )
            return ray_nodes.start_ray_joins(
                cluster,
                count=self.plan.num_nodes - 1,
                endpoint=self.endpoint,
                run_id=self.plan.run_id,
                secret=self.secret.text,
                bundle=bundle,
            )
        return start_joins(
            nodes.start_nodes,
            count=self.plan.num_nodes - 1,
            endpoint=self.endpoint,
            run_id=self.plan.run_id,
            secret=self.secret.text,
            log_dir=self.plan.run_dir,
            hostfile=nodes.hostfile,
        )

    def rendezvous(
        self,
        payload: bytes | None,
        timeout: float,
        starter: JoinStarter | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Publish the run, wait for every node, and show each one as it arrives.

        See :meth:`Rendezvous.run` for the parameters.

        Raises
        ------
        RendezvousTimeoutError
            When not every node joined within ``timeout`` seconds.
        LaunchError
            When a node reported that it cannot take part, or the rendezvous broke down.
        """
        Rendezvous(self).run(payload, timeout, starter, stop)

    # --- while the ranks run -----------------------------------------------------------------

    def pull(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The batches the other nodes pushed since the last call: ``(node, events)``."""
        batches = []
        now = time.monotonic()
        for record in self.pop_all(self.keys.up):
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
        # A node none of whose ranks a task had may not have read it before its key went (a
        # pull from rank 0 ends in milliseconds): it goes on from here.
        newest = self.keys.newest_task
        self.store.set(newest, self.secret.sign(str(number), newest))
        self.tasks_published += 1

    def interrupt(self, ranks: list[int]) -> None:
        """Interrupt ``ranks`` (a KeyboardInterrupt in the pool's current task) on their nodes."""
        key = self.keys.interrupt(self.tasks_published - 1)
        with contextlib.suppress(Exception):
            self.store.set(key, self.secret.seal(ranks, key))

    def control(self, value: str, reason: str = "") -> None:
        """Tell every other node what to do with its ranks (``ok``, ``stop``, ``interrupt``);
        ``reason``: why the run stops, for the nodes to say."""
        if value == self._control or self._control in (CONTROL_OK, CONTROL_STOP, CONTROL_REJOIN):
            return  # final; only an interrupt may be followed by another value
        self._control = value
        if reason:  # before the control value: a node reads it when it sees "stop"
            reason = reason.replace(self.secret.text, "<the run's secret>")  # for their logs
            with contextlib.suppress(Exception):
                self.store.set(self.keys.reason, self.secret.sign(reason, self.keys.reason))
        with contextlib.suppress(Exception):
            self.store.set(self.keys.control, self.secret.sign(value, self.keys.control))

    @property
    def control_sent(self) -> str | None:
        """The last control value sent to the other nodes (None while the run goes on)."""
        return self._control

    def silent_nodes(self, silence_s: float | None = None) -> list[int]:
        """The nodes not heard from for ``silence_s`` (default: ``self.silence_s``)."""
        now = time.monotonic()
        silence_s = self.silence_s if silence_s is None else silence_s
        return sorted(
            node
            for node, seen in self.last_seen.items()
            if node not in self.done and now - seen > silence_s
        )

    def pop_all(self, key: str) -> list[Any]:
        """Every record on the queue ``key``, opened; one that fails authentication is said."""
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
        self.show(diagnosis(title, body, severity, None))

    def warn(self, title: str, body: str) -> None:
        """Tampering seen: a warning in the view, and on stderr whatever the view."""
        self.info(title, body, severity="warning")

    def show(self, event: Event) -> None:
        """Show ``event`` in the view at once."""
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


class Rendezvous:
    """The head before the ranks start: publishes the run and gathers every node."""

    def __init__(self, head: Head) -> None:
        self.head = head
        self.arrived: list[dict[str, Any]] = []  # hello records of the other nodes

    def run(
        self,
        payload: bytes | None,
        timeout: float,
        starter: JoinStarter | None,
        stop: threading.Event | None = None,
    ) -> None:
        """Publish the run, wait for every node, and show each one as it arrives.

        ``payload`` is the one-shot run's task; a pool's tasks come later
        (:meth:`Head.publish_task`). ``starter``: the join commands this notebook started, which
        fail the rendezvous at once when one ends badly. ``stop``: set from another thread to
        stop waiting, as the interrupt button does (a run that does not hold its cell).

        Raises
        ------
        RendezvousTimeoutError
            When not every node joined within ``timeout`` seconds.
        LaunchError
            When a node reported that it cannot take part, or the rendezvous broke down.
        """
        head = self.head
        plan = head.plan
        keys = head.keys
        config = {**plan.node_config(), "rdzv_timeout": timeout}
        head.store.set(keys.config, head.secret.seal(config, keys.config))
        if payload is not None:
            head.store.set(keys.payload, head.secret.seal(payload, keys.payload))
        head.show(plan.run_info(time.time()))
        others = plan.num_nodes - 1
        if others:
            how = (
                starter.describe()
                if starter is not None
                else f"run this on each of the other {others} node(s) (by hand, ssh, or srun):\n"
                f"  {head.join_command()}"
            )
            head.info(
                f"waiting for {others} more node(s) at {head.endpoint}",
                f"{how}\n{plan.num_nodes} node(s) x {plan.nproc_per_node} rank(s) = "
                f"{plan.world_size} ranks; waiting up to {timeout:g} s",
            )
        warm_up(plan.start_method)
        # The rendezvous blocks; it runs on a thread (with its own connection to the store) so
        # that this thread can show the nodes arriving and take the notebook's interrupt.
        handler = head.handler = rendezvous_handler(
            connect_store(head.host, head.port),
            plan.run_id,
            plan.num_nodes,
            head.host,
            timeout,
            head.secret,
            head.endpoint,
        )
        outcome: dict[str, Any] = {}

        def join() -> None:
            try:
                outcome["info"] = handler.next_rendezvous()
            except BaseException as exc:
                outcome["error"] = exc

        with unshared_rendezvous_store():
            thread = threading.Thread(target=join, name="nblaunch-rendezvous", daemon=True)
            thread.start()
            try:
                while thread.is_alive():
                    thread.join(0.1)
                    self._take_hellos()
                    head.view.flush()
                    if stop is not None and stop.is_set():
                        raise KeyboardInterrupt
                    problem = starter.problem(others) if starter is not None else None
                    if problem is not None:
                        raise LaunchError(f"{problem}. Nothing was started.")
            except BaseException as exc:
                self.close(_reason(exc))
                raise
        if "error" in outcome:
            try:
                self._raise_error(outcome["error"], timeout)
            except BaseException as exc:
                self.close(_reason(exc))
                raise
        info = outcome["info"]
        head.store.set(keys.head_rank, head.secret.sign(str(info.rank), keys.head_rank))
        head.store.set(keys.complete, head.secret.sign("1", keys.complete))
        self._take_hellos()
        if others:
            head.info(
                f"all {plan.num_nodes} nodes joined",
                f"starting {plan.nproc_per_node} rank(s) on each node",
            )
        now = time.monotonic()
        head.last_seen = {node: now for node in range(1, plan.num_nodes)}

    def _take_hellos(self) -> None:
        """Show the nodes that arrived; fail at once when one reported it cannot take part."""
        head = self.head
        for record in head.pop_all(head.keys.hello):
            if not isinstance(record, dict) or "host" not in record:
                continue
            if record.get("error"):
                raise LaunchError(
                    f"node {record['host']} cannot join the run at {head.endpoint}: "
                    f"{record['error']}. Nothing was started."
                )
            self.arrived.append(record)
            missing = head.plan.num_nodes - 1 - len(self.arrived)
            head.info(
                f"node {record['host']} joined",
                f"{len(self.arrived) + 1} of {head.plan.num_nodes} nodes are here"
                + (f"; waiting for {missing} more" if missing > 0 else ""),
            )

    def _raise_error(self, error: BaseException, timeout: float) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError as Timeout

        head = self.head
        joined = len(self.arrived) + 1
        if isinstance(error, Timeout):
            names = ", ".join([head.hosts[0], *(r["host"] for r in self.arrived)])
            raise RendezvousTimeoutError(
                f"only {joined} of {head.plan.num_nodes} nodes joined the rendezvous at "
                f"{head.endpoint} within rdzv_timeout={timeout:g} s (joined: {names}). Run "
                f"`{head.join_command()}` on each missing node, check that they can reach "
                f"{head.endpoint} (firewall, address), or pass num_nodes={joined}. "
                "Nothing was started.",
                endpoint=head.endpoint,
                joined=joined,
                expected=head.plan.num_nodes,
            ) from None
        if isinstance(error, AuthenticationError):  # torch's rendezvous state was tampered with
            raise error
        raise LaunchError(
            f"the rendezvous at {head.endpoint} failed: {type(error).__name__}: {error}"
        ) from error

    def close(self, reason: str) -> None:
        """Close the rendezvous, so nodes still waiting (or arriving late) give up at once and
        say ``reason``."""
        head = self.head
        head.control(CONTROL_STOP, reason)
        if self.arrived:  # nodes wait in the rendezvous: let them read why before it closes
            time.sleep(2 * GATHER_POLL_S)
        with contextlib.suppress(Exception):
            closer = rendezvous_handler(
                connect_store(head.host, head.port, timeout=5.0),
                head.plan.run_id,
                head.plan.num_nodes,
                head.host,
                5.0,
                head.secret,
                head.endpoint,
            )
            closer.set_closed()


def _reason(exc: BaseException) -> str:
    """Why the notebook stopped the run, as the other nodes say it."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted in the notebook"
    return f"{type(exc).__name__}: {exc}"[:500]
