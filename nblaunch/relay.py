"""Parent side of the ranks' output and events: read, split into lines, log, feed the view.

The relay runs on the thread that launched the run (the notebook's main thread), polling every
rank's stdout, stderr and event pipe with one selector. Doing it there, rather than on a
background thread, keeps widget updates in the cell that launched the run, lets the notebook's
interrupt land where the launcher can act on it, and leaves no thread behind.

Lines are split per rank and per descriptor, so two ranks' output is never glued together or cut
in the middle; a line ended by ``\\r`` (a progress bar redrawing) is marked as such. Every byte a
rank writes also goes, unchanged, to ``<run dir>/rank<N>.log``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import time
from pathlib import Path
from typing import Any

from nblaunch.events import Event, EventSink, Log, Stream
from nblaunch.logging import InOrderLog
from nblaunch.supervisor import RankProcess

# A line longer than this is passed on in pieces rather than held in memory until its end.
MAX_LINE_BYTES = 1 << 16
READ_SIZE = 1 << 20
TAIL_LINES = 20
LOG_FLUSH_S = 0.5


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
    """

    def __init__(self, ranks: list[RankProcess], sink: EventSink, run_dir: Path | None) -> None:
        self.sink = sink
        self.run_dir = run_dir
        self._selector = selectors.DefaultSelector()
        self._partial: dict[tuple[int, int], bytes] = {}
        self._logs: dict[int, Any] = {}
        self._conns: dict[int, RankProcess] = {}
        self.tails: dict[int, collections.deque[str]] = {}
        self.last_output: dict[int, float] = {}
        self._logs_flushed = 0.0
        # in_order log records are lined up by (seq, rank) before the view sees them
        self.in_order = InOrderLog()
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            self.add(rank)

    def add(self, rank: RankProcess) -> None:
        """Start reading a (new) rank process's pipes."""
        self._selector.register(rank.stdout_r.fileno(), selectors.EVENT_READ, (rank.rank, 1))
        self._selector.register(rank.stderr_r.fileno(), selectors.EVENT_READ, (rank.rank, 2))
        self._selector.register(rank.conn.fileno(), selectors.EVENT_READ, (rank.rank, 0))
        self._conns[rank.rank] = rank
        self.in_order.add_rank(rank.rank)
        self.tails.setdefault(rank.rank, collections.deque(maxlen=TAIL_LINES))
        if self.run_dir is not None and rank.rank not in self._logs:
            self._logs[rank.rank] = open(self.run_dir / f"rank{rank.rank}.log", "ab")  # noqa: SIM115

    def remove(self, rank: RankProcess) -> None:
        """Stop reading a rank process's pipes (it was replaced by a restarted one)."""
        for end in (rank.stdout_r, rank.stderr_r, rank.conn):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(end.fileno())
        self._partial.pop((rank.rank, 1), None)
        self._partial.pop((rank.rank, 2), None)

    def publish(self, event: Event) -> None:
        """Give an event made by the parent (state, diagnosis, ...) to the view."""
        self.sink.handle(event)
        if event["kind"] == "log":
            self._log_text(event["rank"], log_line(event))

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` seconds for output or events; return the events from ranks.

        Output becomes ``Stream`` events for the view; events from ranks go to the view and are
        returned, so the launcher can act on results and failures.
        """
        received: list[dict[str, Any]] = []
        for key, _ in self._selector.select(timeout):
            received.extend(self._dispatch(key))
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

    def drain_output(self, timeout: float = 2.0) -> None:
        """Read output until every pipe closes or ``timeout`` passes; then end partial lines."""
        deadline = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < deadline:
            for key, _ in self._selector.select(max(0.0, deadline - time.monotonic())):
                self._dispatch(key)
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
            for key, _ in ready:
                received.extend(self._dispatch(key))
        self._end_partial_lines()
        return received

    def close(self) -> None:
        """Stop reading; close log files (the pipes belong to the supervisor)."""
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(key.fd)
        self._selector.close()
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    # --- internals -------------------------------------------------------------------------------

    def _dispatch(self, key: selectors.SelectorKey) -> list[dict[str, Any]]:
        """Read one ready pipe: an event pipe returns its events, an output pipe its lines."""
        rank, fd = key.data
        if fd == 0:
            return self._read_events(rank, key.fd)
        self._read_output(rank, fd, key.fd)
        return []

    def _end_partial_lines(self) -> None:
        """Pass on unfinished lines and held in-order records: the task or run is over."""
        for (rank, fd), rest in list(self._partial.items()):
            if rest:
                self._emit_lines(rank, fd, [_decode(rest)], carriage=False)
        self._partial.clear()
        for ready in self.in_order.flush():
            self.sink.handle(ready)
        self._flush(force=True)

    def _flush(self, force: bool = False) -> None:
        """Let the view render; write log files out about twice a second (or when forced)."""
        self.sink.flush()
        now = time.monotonic()
        if force or now - self._logs_flushed > LOG_FLUSH_S:
            self._logs_flushed = now
            for log in self._logs.values():
                log.flush()

    def _read_events(self, rank: int, fileno: int) -> list[dict[str, Any]]:
        process = self._conns[rank]
        received = []
        try:
            while process.conn.poll():
                event = process.conn.recv()
                received.append(event)
                for ready in self.in_order.feed(event):
                    self.sink.handle(ready)
                if event["kind"] == "log":
                    self._log_text(rank, log_line(event))
        except (EOFError, OSError):
            process.events_open = False
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fileno)
        return received

    def _read_output(self, rank: int, fd: int, fileno: int) -> None:
        try:
            data = os.read(fileno, READ_SIZE)
        except OSError:
            data = b""
        if not data:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fileno)
            rest = self._partial.pop((rank, fd), b"")
            if rest:
                self._emit_lines(rank, fd, [_decode(rest)], carriage=False)
            return
        self.last_output[rank] = time.time()
        log = self._logs.get(rank)
        if log is not None:
            log.write(data)
        self._split_lines(rank, fd, self._partial.pop((rank, fd), b"") + data)

    def _split_lines(self, rank: int, fd: int, buffer: bytes) -> None:
        if b"\r" not in buffer:  # the common case, kept fast: whole lines in one go
            end = buffer.rfind(b"\n") + 1
            if end:
                self._emit_lines(rank, fd, _decode(buffer[: end - 1]).split("\n"), carriage=False)
            rest = buffer[end:]
        else:
            rest = self._split_carriage(rank, fd, buffer)
        while len(rest) > MAX_LINE_BYTES:
            self._emit_lines(rank, fd, [_decode(rest[:MAX_LINE_BYTES])], carriage=False)
            rest = rest[MAX_LINE_BYTES:]
        if rest:
            self._partial[(rank, fd)] = rest

    def _split_carriage(self, rank: int, fd: int, buffer: bytes) -> bytes:
        """Split on ``\\n``, ``\\r\\n`` and lone ``\\r``; return the unfinished rest."""
        start = 0
        size = len(buffer)
        while start < size:
            newline = buffer.find(b"\n", start)
            carriage = buffer.find(b"\r", start)
            if newline < 0 and carriage < 0:
                break
            if carriage < 0 or (0 <= newline < carriage):
                self._emit_lines(rank, fd, [_decode(buffer[start:newline])], carriage=False)
                start = newline + 1
            elif carriage == size - 1:
                break  # a "\r" at the end may be the first half of "\r\n": wait for more
            elif buffer[carriage + 1 : carriage + 2] == b"\n":
                self._emit_lines(rank, fd, [_decode(buffer[start:carriage])], carriage=False)
                start = carriage + 2
            else:
                self._emit_lines(rank, fd, [_decode(buffer[start:carriage])], carriage=True)
                start = carriage + 1
        return buffer[start:]

    def _emit_lines(self, rank: int, fd: int, texts: list[str], *, carriage: bool) -> None:
        if not carriage:
            self.tails[rank].extend(texts[-TAIL_LINES:])
        handle = self.sink.handle
        for text in texts:
            event: Stream = {
                "kind": "stream",
                "rank": rank,
                "fd": fd,
                "text": text,
                "carriage": carriage,
            }
            handle(event)

    def _log_text(self, rank: int, text: str) -> None:
        log = self._logs.get(rank)
        if log is not None:
            log.write(text.encode("utf-8", errors="replace"))


def _decode(raw: bytes) -> str:
    """Text of a rank's bytes; invalid UTF-8 becomes U+FFFD instead of breaking the view."""
    return raw.decode("utf-8", errors="replace")


def log_line(event: Log) -> str:
    """How a rank's ``Log`` record reads in its ``rank<N>.log`` file."""
    return f"{event['level']}:{event['name']}: {event['message']}\n"
