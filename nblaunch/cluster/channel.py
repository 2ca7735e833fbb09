"""The node channel: what the notebook and the joined nodes say to each other through the store.

Every record is sealed or signed with the run's secret (:mod:`nblaunch.cluster.trust`) under
a key of :class:`Keys`. The notebook writes the run's settings, its payload, a pool's tasks and
interrupts, and the control value (``ok``, ``stop``, ``interrupt``, ``rejoin``); each joined
node pushes one ``hello`` when it arrives, then batches of its ranks' events and its own news
onto the ``up`` queue (:class:`Uplink`), which the notebook's :class:`~nblaunch.cluster.head.Head`
pops.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from nblaunch.cluster.store import BoundedStore
from nblaunch.cluster.trust import RunSecret

# The format of the settings a joining node reads; a node refuses a run of another format.
CONFIG_VERSION = 1
# Control values the notebook sets for the other nodes, in the order they may follow each other.
CONTROL_INTERRUPT = "interrupt"
CONTROL_OK = "ok"
CONTROL_STOP = "stop"
# A pool's nodes: stop the ranks and join the pool's next start (a restart, a broken pool).
CONTROL_REJOIN = "rejoin"
# How often a joined node pushes the events it collected, and its liveness beat.
PUSH_INTERVAL_S = 0.05
BEAT_INTERVAL_S = 1.0
# A batch holds at most this many events, so one push stays small.
MAX_BATCH = 2000
# How often a node waiting for the others looks whether the notebook stopped the run; the
# notebook keeps the store up twice as long after saying so.
GATHER_POLL_S = 0.25
# A joined node's calls to the store while its ranks run give up after this long (BoundedStore):
# a node cut off from the notebook takes it as lost then, stops its ranks and exits. A blip of
# a few seconds (TCP retransmits once the link is back) is not a loss.
NOTEBOOK_SILENCE_S = 8.0


class Terminated(KeyboardInterrupt):
    """A join was sent SIGTERM (``kill``, Slurm, or its Ray agent's end): it stops its ranks as
    on Ctrl-C, and the notebook is told who may have sent it (``node_run.sigterm_senders``)."""


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
        self.reason = base + "reason"  # why the notebook stopped the run, set before "stop"
        self.newest_task = base + "newest_task"  # the newest task's number (signed)
        self._base = base

    def task(self, number: int) -> str:
        """A pool's ``number``-th task since it started: its ranks and payload (sealed)."""
        return f"{self._base}task/{number}"

    def interrupt(self, number: int) -> str:
        """The ranks of a pool's ``number``-th task that the notebook interrupts (sealed)."""
        return f"{self._base}interrupt/{number}"


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
                self.lost = first_line(exc)
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
            self.lost = first_line(exc)

    def _record(self, batch: list[dict[str, Any]]) -> bytes:
        return self.secret.seal((self.node, self.pushed, batch), self.key)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None and self.lost is None:  # a lost one may hang until its timeout
            self._beat.join(5.0)
        self.push()


def read_reason(store: Any, keys: Keys, secret: RunSecret) -> str:
    """Why the notebook stopped the run, as it said under ``keys.reason`` ("" when it did not).

    Raises
    ------
    AuthenticationError
        When the value was not written with the run's secret.
    """
    if not store.check([keys.reason]):
        return ""
    return secret.verify(store.get(keys.reason), keys.reason).decode(errors="replace")


def beat_store(store: Any) -> Any:
    """A second connection to the store, for the beat thread (a client is not shared); its
    calls are bounded in time as ``store``'s are."""
    try:
        if isinstance(store, BoundedStore):
            return BoundedStore(store.clone(), store.timeout)
        return store.clone()
    except Exception:
        return None


def local_host_name(local_addr: str | None = None) -> str:
    """How a node is named in the notebook: its hostname and its address (``vm at 10.0.0.2``;
    hostnames alone may be the same on every node)."""
    name = socket.gethostname()
    return f"{name} at {local_addr}" if local_addr and local_addr != name else name


def rank_span(first: int, last: int) -> str:
    """``rank 3`` or ``ranks 2-5``."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for a node's one-line reports."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
