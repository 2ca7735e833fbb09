"""The rendezvous store: one port for the rendezvous, the process group and the node channel.

The notebook node hosts a ``TCPStore`` on the address of ``rdzv_endpoint`` only
(:func:`host_store`); the other nodes and every rank connect to it as clients
(:func:`connect_store`). torch's c10d rendezvous runs on it (:func:`rendezvous_handler`), with
two guards around torch's habits: no second store server (:func:`unshared_rendezvous_store`)
and the notebook's signal handlers put back (:func:`signal_handlers_kept`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from nblaunch.cluster.trust import RunSecret, SigningStore
from nblaunch.errors import LaunchError
from nblaunch.options import DEFAULT_RDZV_PORT
from nblaunch.ranks.default_group import listen_fd_options

# Timeout of single store operations (a get, a push); generous, the network may be slow.
STORE_TIMEOUT_S = 60.0


def require_store_queues() -> None:
    """Refuse a multi-node run on a torch whose store has no queues (torch < 2.8).

    The nodes' channel and the head's hellos are ``Store.queue_push``/``queue_pop``, which
    torch 2.8 added (with ``torch.distributed.QueueEmptyError``); pyproject.toml asks for 2.8,
    and this says so to whoever forced an older torch in.

    Raises
    ------
    LaunchError
        Naming this torch and the upgrade.
    """
    import torch

    if torch.torch_version.TorchVersion(torch.__version__) < (2, 8):
        raise LaunchError(
            f"multi-node runs need torch 2.8 or newer (its store's queues carry the nodes' "
            f"events); this is torch {torch.__version__}. Upgrade torch on every node: "
            "pip install 'torch>=2.8'"
        )


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
        **listen_fd_options(),
    )


def connect_store(host: str, port: int, timeout: float = STORE_TIMEOUT_S) -> Any:
    """A client of the store at ``host:port``; retries connecting for up to ``timeout`` s."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))


class BoundedStore:
    """A store client whose every call gives up after ``timeout`` s with a ``TimeoutError``.

    A TCPStore client waits for an answer as long as TCP keeps the connection, which for a
    link that went down is many minutes. Each call runs on this client's own (daemon) thread
    while the caller waits at most ``timeout``; after one call went unanswered every later call
    fails at once, and the stuck one is left on its thread.
    """

    # Some call of some client went unanswered: its thread is stuck in torch's client, whose
    # destruction at interpreter exit would wait for it (``join`` then exits with os._exit).
    any_stuck = False

    def __init__(self, store: Any, timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        self.stuck: str | None = None
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="nblaunch-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            method, args, answer, done = self._calls.get()
            try:
                answer.append((True, method(*args)))
            except BaseException as exc:
                answer.append((False, exc))
            done.set()

    def call(self, name: str, *args: Any) -> Any:
        """``store.<name>(*args)``, within ``timeout``.

        Raises
        ------
        TimeoutError
            When the store did not answer in time (this call, or an earlier one).
        """
        if self.stuck is not None:
            raise TimeoutError(self.stuck)
        answer: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._calls.put((getattr(self.store, name), args, answer, done))
        if not done.wait(self.timeout):
            self.stuck = f"no answer for {self.timeout:g} s"
            BoundedStore.any_stuck = True
            raise TimeoutError(self.stuck)
        ok, value = answer[0]
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        return functools.partial(self.call, name)


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


def node_rank_of(rdzv_rank: int, head_rdzv_rank: int) -> int:
    """The node rank of a node: its rendezvous rank, rotated so the notebook node is node 0.

    The rendezvous numbers nodes by their sorted addresses; rank 0 belongs on the notebook's node
    (it is where ``is_main_process()`` code saves files the notebook can read).
    """
    if rdzv_rank == head_rdzv_rank:
        return 0
    return rdzv_rank + 1 if rdzv_rank < head_rdzv_rank else rdzv_rank
