"""Parent side of the ranks' output and events: read, split into lines, log, feed the view.

The relay runs on the thread that launched the run (the notebook's main thread), polling every
rank's stdout, stderr and event pipe with one selector. Doing it there, rather than on a
background thread, keeps widget updates in the cell that launched the run, lets the notebook's
interrupt land where the launcher can act on it, and leaves no thread behind.

What arrives is passed on by concern: output to :class:`~nblaunch.engine.output.lines.LineSplitter`,
which makes it lines (progress bars kept whole), and every byte and record to the rank's log
file through :class:`~nblaunch.engine.output.log_files.RunFiles`; events to the view and to the run.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import selectors
import time
from pathlib import Path
from typing import Any, Protocol

from nblaunch.engine.clock import REAL_CLOCK, Clock
from nblaunch.engine.output.in_order import InOrderLog
from nblaunch.engine.output.lines import LineSplitter
from nblaunch.engine.output.log_files import RunFiles, log_line
from nblaunch.engine.processes.supervisor import RankProcess
from nblaunch.events import Event, EventSink, diagnosis

READ_SIZE = 1 << 20
LOG_FLUSH_S = 0.5
# A bar drawn blank: tqdm clearing it (before tqdm.write, or on close with leave=False).
_CLEARED = re.compile(rb"\r[ \t]*\r")


class EventSource(Protocol):
    """Events from elsewhere than this machine's pipes, e.g. another node's ranks
    (:class:`nblaunch.cluster.run.RemoteNodes`)."""

    def pull(self, relay: Relay) -> list[dict[str, Any]]:
        """Hand what arrived to ``relay.accept``; return the records the run must act on."""
        ...

    def drain(self, relay: Relay) -> None:
        """The run is ending: wait (bounded) for what is still on its way."""
        ...


class Relay:
    """Reads every rank's pipes and passes what arrives on as events.

    Parameters
    ----------
    ranks
        The rank processes whose pipes to read.
    sink
        Where events go (a view).
    run_dir
        Directory for ``rank<N>.log`` files; ``None`` writes no files.
    clock
        The run's clock: when each rank last wrote (``last_output``), and how long a poll waits.
    """

    def __init__(
        self,
        ranks: list[RankProcess],
        sink: EventSink,
        run_dir: Path | None,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        self.clock = clock
        self.run_dir = run_dir
        self.files = RunFiles(run_dir, self._disk_trouble)
        self.lines = LineSplitter(sink, self.files)
        self._sink = sink
        self._selector = selectors.DefaultSelector()
        self._conns: dict[int, RankProcess] = {}
        # rank -> its last finished lines (the lines' own: they add to it as they end)
        self.tails: dict[int, collections.deque[str]] = self.lines.tails
        self.last_output: dict[int, float] = {}  # rank -> clock.now() of its last output
        self._logs_flushed = 0.0
        # in_order log records are lined up by (seq, rank) before the view sees them
        self.in_order = InOrderLog()
        # Where else events come from (another node's ranks, through the rendezvous store).
        self.sources: list[EventSource] = []
        for rank in ranks:
            self.add(rank)

    @property
    def sink(self) -> EventSink:
        """Where events and lines go (a view); may be swapped (a pool's next task)."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink) -> None:
        self._sink = sink
        self.lines.sink = sink

    def add(self, rank: RankProcess) -> None:
        """Start reading a (new) rank process's pipes."""
        self._selector.register(rank.stdout_r.fileno(), selectors.EVENT_READ, (rank.rank, 1))
        self._selector.register(rank.stderr_r.fileno(), selectors.EVENT_READ, (rank.rank, 2))
        self._selector.register(rank.conn.fileno(), selectors.EVENT_READ, (rank.rank, 0))
        self._conns[rank.rank] = rank
        self.in_order.add_rank(rank.rank)
        self._open_rank(rank.rank)

    def _open_rank(self, rank: int) -> None:
        self.lines.add_rank(rank)
        self.files.open_rank(rank)

    def add_source(self, source: EventSource) -> None:
        """Also pass on what ``source`` brings (see :class:`EventSource`) at every poll."""
        self.sources.append(source)

    def accept(self, event: dict[str, Any]) -> bool:
        """Take a record that came another way than this machine's pipes (another node's rank):
        log it and show it as if read here. True when the run must act on it (not a line)."""
        rank = event.get("rank")
        if rank is None:  # not about one rank
            self.sink.handle(event)
            return True
        self._open_rank(rank)
        if event["kind"] == "stream":
            self.last_output[rank] = self.clock.now()
            if not event["carriage"]:
                self.tails[rank].append(event["text"])
            self.files.log_text(rank, event["text"] + "\n")
            self.sink.handle(event)
            return False
        self._take_event(rank, event)
        return True

    def remove(self, rank: RankProcess) -> None:
        """Stop reading a rank process's pipes (it was replaced by a restarted one)."""
        for end in (rank.stdout_r, rank.stderr_r, rank.conn):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(end.fileno())
        self.lines.forget(rank.rank)

    def publish(self, event: Event) -> None:
        """Give an event made by the parent (state, diagnosis, ...) to the view."""
        if event["kind"] == "log":
            self.lines.end_progress(event["rank"])
            self.files.log_text(event["rank"], log_line(event))
        self.sink.handle(event)

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` seconds for output or events; return the events from ranks.

        Output becomes ``Stream`` events for the view; events from ranks go to the view and are
        returned, so the launcher can act on results and failures.
        """
        received = self._dispatch(self._selector.select(self.clock.wait_s(timeout)))
        for source in self.sources:
            received.extend(source.pull(self))
        for ready in self.in_order.poll():
            self.sink.handle(ready)
        self._flush()
        return received

    def drain_events(self, rank: int) -> list[dict[str, Any]]:
        """Read whatever a rank's event pipe still holds (used when its process has exited)."""
        process = self._conns.get(rank)
        if process is None or not process.events_open:
            return []
        return self._read_events(rank, process.conn.fileno())

    def hung_up(self, rank: int) -> bool:
        """True once every pipe from the rank's process has reached its end."""
        process = self._conns[rank]
        open_fds = self._selector.get_map()
        return all(
            end.fileno() not in open_fds
            for end in (process.stdout_r, process.stderr_r, process.conn)
        )

    def drain_output(self, timeout: float = 2.0) -> None:
        """Read output until every pipe closes or ``timeout`` passes; then end partial lines."""
        deadline = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < deadline:
            self._dispatch(self._selector.select(max(0.0, deadline - time.monotonic())))
        for source in self.sources:
            source.drain(self)
        self._end_partial_lines()

    def drain_ready(self, limit_s: float = 0.5) -> list[dict[str, Any]]:
        """Read what the pipes hold right now, without waiting for more; end partial lines.

        A persistent pool calls this when a task ends, so everything the task wrote shows
        under its own cell; ``limit_s`` bounds it when a rank keeps printing from a thread.
        Returns the events from ranks.
        """
        received: list[dict[str, Any]] = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            ready = self._selector.select(0)
            if not ready:
                break
            received.extend(self._dispatch(ready))
        self._end_partial_lines()
        return received

    def close(self) -> None:
        """Stop reading; close log files (the pipes belong to the supervisor)."""
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(key.fd)
        self._selector.close()
        self.files.close()

    def _disk_trouble(self, what: str, path: Path, exc: OSError) -> None:
        """A run file could not be written: said once, in the view; the run goes on."""
        self.sink.handle(
            diagnosis(
                f"the run's {what} are no longer written: {exc.strerror or exc} ({path})",
                f"Writing {path} failed with {type(exc).__name__}: {exc}. The ranks keep "
                f"training and the view keeps showing them; only the {what} on disk stop here. "
                "Free the disk (or pass run_dir= another directory) for the next run.",
                "warning",
                None,
            )
        )

    def write_metrics(self, event: dict[str, Any]) -> None:
        """Append a ``metrics`` event to ``<run dir>/metrics.jsonl`` (nblaunch.ranks.metrics)."""
        self.files.write_metrics(event)

    # --- internals -------------------------------------------------------------------------------

    def _dispatch(self, ready: list[tuple[selectors.SelectorKey, int]]) -> list[dict[str, Any]]:
        """Read every ready pipe; return the events from ranks, pass output on as lines.

        Output from two pipes that were ready together has lost its order between them. It is
        put back in the order that keeps progress bars whole: a bar being cleared comes first
        (``tqdm.write`` clears the bar, prints, then draws the bar again), then finished lines,
        then what followed such a clear, then the unfinished rest: each bar's newest state.
        """
        received: list[dict[str, Any]] = []
        pieces: list[tuple[int, int, int, bytes]] = []
        together = sum(1 for key, _ in ready if key.data[1]) > 1
        for key, _ in ready:
            rank, fd = key.data
            if fd == 0:
                received.extend(self._read_events(rank, key.fd))
                continue
            if not together:  # one pipe: its order is the order it was written in
                data = self._read_pipe(rank, fd, key.fd)
                if data:
                    self._take_output(rank, fd, data)
                continue
            # a bar that stands cleared since the last read: what follows it is the refresh
            standing = self.lines.stands_cleared(rank, fd)
            data = self._read_pipe(rank, fd, key.fd)
            after_clear = 2 if standing else 1
            cleared = _CLEARED.search(data) if b"\r" in data else None
            if cleared:
                pieces.append((0, rank, fd, data[: cleared.end()]))
                data = data[cleared.end() :]
                after_clear = 2
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            if cut:
                pieces.append((after_clear, rank, fd, data[:cut]))
            if cut < len(data):
                pieces.append((3, rank, fd, data[cut:]))
        for _, rank, fd, data in sorted(pieces, key=lambda piece: piece[0]):
            self._take_output(rank, fd, data)
        return received

    def _end_partial_lines(self) -> None:
        """Pass on unfinished lines and held in-order records: the task or run is over."""
        self.lines.end_all()
        for ready in self.in_order.flush():
            self.sink.handle(ready)
        self._flush(force=True)

    def _flush(self, force: bool = False) -> None:
        """Let the view render; write log files out about twice a second (or when forced)."""
        self.sink.flush()
        now = time.monotonic()
        if force or now - self._logs_flushed > LOG_FLUSH_S:
            self._logs_flushed = now
            self.files.flush()

    def _read_events(self, rank: int, fileno: int) -> list[dict[str, Any]]:
        process = self._conns[rank]
        received = []
        try:
            while process.conn.poll():
                event = process.conn.recv()
                received.append(event)
                self._take_event(rank, event)
        except (EOFError, OSError):
            process.events_open = False
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fileno)
        return received

    def _take_event(self, rank: int, event: dict[str, Any]) -> None:
        """Log a rank's record, and pass it on (in-order records once their turn comes)."""
        if event["kind"] == "log":
            self.lines.end_progress(rank)  # a record is the rank's next output
            self.files.log_text(rank, log_line(event))
        elif event["kind"] == "metrics":
            self.write_metrics(event)
        for ready in self.in_order.feed(event):
            self.sink.handle(ready)

    def _read_pipe(self, rank: int, fd: int, fileno: int) -> bytes:
        """What one output pipe holds (b"" at its end, which ends its unfinished line)."""
        try:
            data = os.read(fileno, READ_SIZE)
        except OSError:
            data = b""
        if not data:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fileno)
            self.lines.end_line(rank, fd)
        return data

    def _take_output(self, rank: int, fd: int, data: bytes) -> None:
        """Note when the rank last wrote; log its output and pass its lines on."""
        self.last_output[rank] = self.clock.now()
        self.lines.take(rank, fd, data)
