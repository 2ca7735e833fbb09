"""A live connection from the Jupyter server to a detached run's host (the runs panel's view of
a run while it goes): the host's history, then its events, folded into a :class:`RunSummary`."""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading

from nblaunch.engine.detached import registry as detached
from nblaunch.engine.detached import wire
from nblaunch.lab.summary import RunSummary


class RunWatch:
    """A live connection to a detached run's host, folding its events into a summary.

    The host gives a new client the run's history first, then its events; the watch ends when
    the host closes the connection (the run ended, or the host died).
    """

    def __init__(self, entry: detached.Entry) -> None:
        self.entry = entry
        self.summary = RunSummary()
        self.done = threading.Event()
        self.primed = threading.Event()  # the host's history came (or the connection ended)
        self._sock = wire.connect(entry.socket)
        wire.send(self._sock, wire.WATCH, None)  # a notebook, not the panel, takes the outcome
        thread = threading.Thread(target=self._read, name=f"nblaunch-lab-{entry.run_id}")
        thread.daemon = True
        thread.start()

    def _read(self) -> None:
        try:
            while (message := wire.receive(self._sock)) is not None:
                kind, body = message
                if kind == wire.EVENTS:
                    self.summary.handle_many(body)
                    self.primed.set()
                elif kind == wire.CLOSED:
                    break
                # wire.OUTCOME is a cloudpickle the server need not open: the registry's state
                # and the history say how the run ended.
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            pass  # the host went away
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()
            self.primed.set()
            self.done.set()

    def stop(self) -> None:
        """Ask the host to stop the run, as the view's Stop button does."""
        with contextlib.suppress(OSError):
            wire.send(self._sock, wire.STOP, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
