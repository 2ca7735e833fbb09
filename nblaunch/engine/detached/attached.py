"""A detached run seen from a notebook: the client of its run host (:mod:`nblaunch.host`).

The registry and the host's start are :mod:`nblaunch.engine.detached.registry`; this is what a
kernel holds once it has an entry: the run's outcome, a way to stop it, and a connection per view.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import time
import types
from pathlib import Path
from typing import Any

from nblaunch import tracebacks
from nblaunch.engine.background.background_run import state_of
from nblaunch.engine.background.event_hub import EventHub
from nblaunch.engine.detached import wire
from nblaunch.engine.detached.host_files import HISTORY_FILE, RESULT_FILE
from nblaunch.engine.detached.lost_runs import lost_run_events, lost_why
from nblaunch.engine.detached.registry import Entry, host_alive, stop_host
from nblaunch.errors import RankFailedError
from nblaunch.events import Event, EventSink, Lifecycle

# How long attaching to an ended run whose host holds its outcome waits for it.
HELD_OUTCOME_WAIT_S = 10.0
# How long a handle's end waits for the views it started to show the run's end (their own
# connections get it from the host right after the outcome).
VIEWS_END_LIMIT_S = 5.0


class AttachedRun:
    r"""A detached run seen from a notebook: its outcome, a way to stop it, and its views.

    Connects to the host's socket when the run is going; a run that ended is read from its
    directory (history and outcome). Offers
    :class:`~nblaunch.engine.background.background_run.RunControl`. The connection asks for the
    outcome only ("quiet"): each view :meth:`watch`\ es the run through a connection of its own,
    given the host's history first, so a handle that shows nothing costs the notebook nothing per
    line.

    Parameters
    ----------
    entry
        The run's registry entry.
    view
        Watch the run with this view (a view's own connection); None: the control connection.
    header_shown
        The view showed the run's header already (the launch cell's view, at once): the host's
        is not shown again.
    """

    def __init__(
        self, entry: Entry, view: EventSink | None = None, header_shown: bool = False
    ) -> None:
        self.entry = entry
        self.run_id = entry.run_id
        self.run_dir: Path | None = entry.run_dir
        self.hub = EventHub(keep=False)  # each view watches from the connection's start
        self.header: Event | None = None  # shown at once by the launch cell's view
        self._done = threading.Event()
        self._outcome: dict[str, Any] | None = None
        self._error_tb: types.TracebackType | None = None  # the ranks' frames, for each raise
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._skip_header = header_shown
        self._links: dict[int, AttachedRun] = {}  # each watching view's own connection
        if view is not None:
            self.hub.watch(view)
        ended = entry.state != Lifecycle.RUNNING
        on_disk = ended and (entry.run_dir / RESULT_FILE).exists()
        if host_alive(entry.pid) and not on_disk:  # going, or ended and its host holds the outcome
            try:
                self._sock = wire.connect(entry.socket)
            except OSError:
                self._sock = None  # it ended a moment ago: read what it left
            if self._sock is not None and view is None:
                # A host that holds an ended run's outcome may have sent it all and shut its
                # side already: what it sent is still there to read.
                with contextlib.suppress(OSError):
                    wire.send(self._sock, wire.QUIET, None)
        if self._sock is None:
            self._read_ended()
            return
        thread = threading.Thread(target=self._read, name=f"nblaunch-attach-{self.run_id}")
        thread.daemon = True
        thread.start()
        if ended:  # the host sends a held outcome at once: the state is known from the start
            self._done.wait(HELD_OUTCOME_WAIT_S)

    def watch(self, view: EventSink) -> None:
        """Show the run in ``view``: what the host kept, then live (a connection of its own)."""
        shown = self.header is not None and not self._done.is_set()
        if shown:
            view.handle(self.header)  # now, in the caller's cell, before the host's events
        self._links = {k: link for k, link in self._links.items() if not link._done.is_set()}
        self._links[id(view)] = AttachedRun(self.entry, view, header_shown=shown)

    def unwatch(self, view: EventSink) -> None:
        """Give ``view`` no more events and hang up its connection (the host forgets it)."""
        link = self._links.pop(id(view), None)
        if link is not None:
            link.hub.unwatch(view)
            if link._sock is not None:
                with contextlib.suppress(OSError):
                    link._sock.shutdown(socket.SHUT_RDWR)  # its reading thread ends

    def _read(self) -> None:
        assert self._sock is not None
        served = False  # the host sent this connection something
        try:
            while (message := wire.receive(self._sock)) is not None:
                served = True
                kind, body = message
                if kind == wire.EVENTS:
                    self.hub.handle_many(self._unseen(body))
                    self.hub.flush()
                elif kind == wire.OUTCOME:
                    try:
                        self._outcome = self._readable(pickle.loads(body))
                    except Exception as exc:  # e.g. an exception class this process lacks
                        self._outcome = self._unreadable(exc)
                elif kind == wire.CLOSED:
                    break
        except (OSError, pickle.UnpicklingError, EOFError):
            pass  # the host went away: what it left on disk says how the run ended
        finally:
            try:
                self._sock.close()
                if not served:  # it ended as this connected: the view is what it left, as after
                    self.hub.handle_many(self._unseen(self._history_on_disk()))
                if self._outcome is None:
                    self._outcome = self._outcome_on_disk()
                    if self._outcome.get("lost"):  # what the view showed live, then why
                        self.hub.handle_many(lost_run_events(self.entry, with_logs=False))
                self.hub.close()
                self._views_ended()
            finally:
                self._done.set()  # result() never waits for a reader that failed

    def _read_ended(self) -> None:
        events = self._history_on_disk()
        self.hub.handle_many(self._unseen(events))
        self._outcome = self._outcome_on_disk()
        if self._outcome.get("lost"):
            self.hub.handle_many(lost_run_events(self.entry, with_logs=not events))
        self.hub.close()
        self._done.set()

    def _history_on_disk(self) -> list[Event]:
        """The view's events the host left in the run directory (none where it left none)."""
        try:
            return pickle.loads((self.entry.run_dir / HISTORY_FILE).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            return []

    def _unseen(self, events: list[Event]) -> list[Event]:
        """``events`` without the host's header when the view showed it already (once)."""
        if not self._skip_header:
            return events
        for index, event in enumerate(events):
            if event["kind"] == "run_info":
                self._skip_header = False
                return events[:index] + events[index + 1 :]
        return events

    def _views_ended(self) -> None:
        """Wait (a while) for the views this handle started to show the run's end: a script's
        ``result()`` returns after its view printed the summary, not before."""
        deadline = time.monotonic() + VIEWS_END_LIMIT_S
        for view in list(self._links.values()):
            view._done.wait(max(0.0, deadline - time.monotonic()))

    def _readable(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """The outcome with its error's traceback rebuilt as a blocking launch's (the host
        sends the rank's frames and the rank's traceback text)."""
        error = outcome.get("error")
        if isinstance(error, BaseException):
            tracebacks.make_readable(error, outcome.get("traceback", ""))
            self._error_tb = error.__traceback__
        return outcome

    def _outcome_on_disk(self) -> dict[str, Any]:
        try:
            return self._readable(pickle.loads((self.entry.run_dir / RESULT_FILE).read_bytes()))
        except (OSError, pickle.UnpicklingError, EOFError):
            error = RankFailedError(lost_why(self.entry), rank=0, world_size=self.entry.world_size)
            return {"error": error, "lost": True}
        except Exception as exc:
            return self._unreadable(exc)

    def _unreadable(self, exc: Exception) -> dict[str, Any]:
        """An outcome this process cannot unpickle, said in words (``result()`` raises it)."""
        message = (
            f"the run ended, but its outcome cannot be read in this process "
            f"({type(exc).__name__}: {exc}): import what the ranks' values or exception need, "
            f"then attach again; the rank logs are in {self.entry.run_dir}"
        )
        return {"error": RankFailedError(message, rank=0, world_size=self.entry.world_size)}

    @property
    def state(self) -> Lifecycle:
        if not self._done.is_set():
            return Lifecycle.RUNNING
        assert self._outcome is not None
        return Lifecycle.LOST if self._outcome.get("lost") else state_of(self._outcome.get("error"))

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Ask the host to stop the run (SIGTERM to it when the socket is gone)."""
        if self._done.is_set():
            return
        try:
            with self._send_lock:
                assert self._sock is not None
                wire.send(self._sock, wire.STOP, None)
        except (OSError, AssertionError):
            stop_host(self.entry)

    def values(self) -> list[Any]:
        __tracebackhide__ = True
        if not self._done.is_set():
            raise RuntimeError("the run has not ended: wait() first")
        assert self._outcome is not None
        if "error" in self._outcome:
            # Raising adds the caller's frames to the traceback: start from the ranks' again.
            raise self._outcome["error"].with_traceback(self._error_tb)
        return self._outcome["values"]
