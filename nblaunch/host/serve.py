"""The run host's socket: every notebook that attaches gets the run's history, then its events.

Each client is a view of the run's :class:`~nblaunch.engine.background.event_hub.EventHub` that
queues what it is given; a thread of its own sends the queue in batches, so a slow or vanished
notebook never holds up the engine. A client that falls :data:`MAX_QUEUED` events behind is dropped
(its notebook attaches again and gets the history).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from typing import Any

from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.detached import wire
from nblaunch.events import Event

MAX_QUEUED = 200_000
# Events sent in one message at most (a batch is one pickle and one system call).
MAX_BATCH = 5_000
# A notebook that takes nothing for this long is given up when the run ends (its kernel is
# stuck or stopped); one that keeps reading is waited for, however long its history.
STALL_S = 30.0
_END = object()  # after it the client's thread sends the outcome and stops


class ClientFeed:
    """One attached notebook: an event sink whose events a thread sends down its socket.

    ``handle`` only appends; each ``flush`` (the relay's, once per turn) queues what came since
    as one batch, so the sending thread wakes once a turn, not once a line.
    """

    def __init__(self, sock: socket.socket, on_stop: Any, on_gone: Any = None) -> None:
        self.sock = sock
        self.on_stop = on_stop
        self.on_gone = on_gone  # called with the feed once its notebook hung up and it closed
        self.gone = False
        self.quiet = False  # the notebook wants the outcome only
        self._pending: list[Event] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queued = 0  # events queued and not yet sent (roughly: two threads count it)
        self.outcome: bytes | None = None
        self.delivered = False  # the outcome reached the notebook's socket
        self.watch_only = False  # the runs panel: what it takes counts for no notebook
        self.sender = threading.Thread(target=self._send, name="nblaunch-feed", daemon=True)
        self.reader = threading.Thread(target=self._read, name="nblaunch-commands", daemon=True)

    def start(self) -> None:
        self.sender.start()
        self.reader.start()

    # --- EventSink ------------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        self._pending.append(event)

    def handle_many(self, events: list[Event]) -> None:
        self._pending.extend(events)

    def flush(self, force: bool = False) -> None:
        if not self._pending or self.gone or self.quiet:
            self._pending.clear()
            return
        if self._queued > MAX_QUEUED:
            self.gone = True  # too far behind: it attaches again and gets the history
            self._pending.clear()
            self._queue.put(_END)
            return
        batch, self._pending = self._pending, []
        self._queued += len(batch)
        self._queue.put(batch)

    def close(self) -> None:
        self.flush()  # the run's last events; the outcome follows with end()

    def end(self, outcome: bytes) -> None:
        """Send the outcome after what is queued, then close."""
        self.flush()
        self.outcome = outcome
        self._queue.put(_END)

    # --- threads ---------------------------------------------------------------------------------

    def _send(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    if self.outcome is not None:
                        wire.send(self.sock, wire.OUTCOME, self.outcome)
                        self.delivered = not self.watch_only
                        wire.send(self.sock, wire.CLOSED, None)
                    return
                for start in range(0, len(item), MAX_BATCH):
                    chunk = item[start : start + MAX_BATCH]
                    wire.send(self.sock, wire.EVENTS, chunk)
                    self._queued -= len(chunk)  # progress, for drain()
        except OSError:
            pass  # the notebook went away; the run goes on
        finally:
            self.gone = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def drain(self, stall_s: float = STALL_S) -> None:
        """Wait until the notebook took everything queued and the outcome, or took nothing for
        ``stall_s`` seconds."""
        last, since = self._queued, time.monotonic()
        while self.sender.is_alive():
            self.sender.join(0.2)
            if self._queued != last:
                last, since = self._queued, time.monotonic()
            elif time.monotonic() - since > stall_s:
                return

    def _read(self) -> None:
        try:
            while (message := wire.receive(self.sock)) is not None:
                if message[0] == wire.STOP:
                    self.on_stop()
                elif message[0] == wire.QUIET:
                    self.quiet = True
                elif message[0] == wire.WATCH:
                    self.watch_only = True
        except (OSError, ValueError, EOFError):
            pass
        finally:
            self._hung_up()

    def _hung_up(self) -> None:
        """The notebook hung up (or the sender ended the feed): end the sender, which waits on
        its queue forever for a quiet client, close the socket and let the server forget it."""
        self.gone = True
        self._queue.put(_END)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # a send to a notebook that reads no more ends
        self.sender.join()
        self.sock.close()
        if self.on_gone is not None:
            self.on_gone(self)


class StreamServer:
    """Listens on ``path`` (0600) and feeds every client from ``hub``.

    Parameters
    ----------
    path
        The socket's path.
    hub
        The run's events and history.
    on_stop
        Called when a client asks for the run to stop.
    """

    def __init__(self, path: str, hub: EventHub, on_stop: Any) -> None:
        self.path = path
        self.hub = hub
        self.on_stop = on_stop
        self.clients: list[ClientFeed] = []
        self._lock = threading.Lock()
        self._outcome: bytes | None = None
        self._delivered = False  # a notebook took the outcome, and may have hung up since
        self._drained: list[ClientFeed] = []  # the clients finish() waited for
        self.sock = wire.listen(path, 16)
        self._accepting = threading.Thread(target=self._accept, name="nblaunch-accept", daemon=True)

    def start(self) -> None:
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return  # closed: the run ended
            feed = ClientFeed(sock, self.on_stop, self._forget)
            with self._lock:
                self.clients.append(feed)
                self.hub.watch(feed)  # the history first, then every new event
                if self._outcome is not None:
                    feed.end(self._outcome)
            feed.start()

    def _forget(self, feed: ClientFeed) -> None:
        """A client hung up: no more events for it (each attach would leave a feed behind)."""
        with self._lock:
            self._delivered = self._delivered or feed.delivered
            if feed in self.clients:
                self.clients.remove(feed)
        self.hub.unwatch(feed)

    def finish(self, outcome: bytes, stall_s: float = STALL_S) -> None:
        """Send every client the outcome after its last events, and wait until each took them
        (or took nothing for ``stall_s``). Clients that attach later get it too, until
        :meth:`close`."""
        with self._lock:
            self._outcome = outcome
            feeds = self._drained = list(self.clients)
            for feed in feeds:
                feed.end(outcome)
        for feed in feeds:
            feed.drain(stall_s)

    @property
    def delivered(self) -> bool:
        """Whether a notebook has been handed the outcome (also one that has hung up since)."""
        with self._lock:
            return self._delivered or any(feed.delivered for feed in self.clients)

    def close(self, stall_s: float = STALL_S) -> None:
        """Stop listening (the run's host is about to end), once the clients that attached
        after :meth:`finish` took the outcome too (as there; the host's exit would cut them off)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: no client after
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._accepting.join(1.0)
        with self._lock:
            late = [feed for feed in self.clients if feed not in self._drained]
        for feed in late:
            feed.drain(stall_s)
