"""Parent side of the ranks' output and events: read, split into lines, log, feed the view.

The relay runs on the thread that launched the run (the notebook's main thread), polling every
rank's stdout, stderr and event pipe with one selector. Doing it there, rather than on a
background thread, keeps widget updates in the cell that launched the run, lets the notebook's
interrupt land where the launcher can act on it, and leaves no thread behind.

Lines are split per rank and per descriptor, so two ranks' output is never glued together or cut
in the middle; a line ended by ``\\r`` (a progress bar redrawing) is marked as such.

A progress line is the text after a rank's last ``\\r``. It is shown as soon as it arrives (a
``carriage`` event: a state to be redrawn), and it ends, keeping its last state as a finished
line, where the rank's next output begins: the ``\\n`` that tqdm writes when it closes, output on
the rank's other stream, a log record, or, on the same stream, text that arrives
``PROGRESS_END_S`` or more after the bar was drawn (Transformers' logger writes to stderr, like
tqdm). Without that, a bar's last state and the next line would be glued together, as they
are in a terminal.

Every byte a rank writes also goes to ``<run dir>/rank<N>.log``; a line break is added where a
rank's output switches between stdout, stderr and log records in the middle of a line, or
where a progress line ends as above, so that two lines never run together there either.
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
from nblaunch.engine.in_order import InOrderLog
from nblaunch.engine.metrics_files import METRICS_FILE, metric_lines, write_tensorboard_files
from nblaunch.engine.supervisor import RankProcess
from nblaunch.events import Event, EventSink, Log, Stream

# A line longer than this is passed on in pieces rather than held in memory until its end.
MAX_LINE_BYTES = 1 << 16
READ_SIZE = 1 << 20
TAIL_LINES = 20
LOG_FLUSH_S = 0.5
# Text on a progress bar's stream that comes this long after the bar was drawn starts a new
# line. Sooner, it is taken as the rest of the bar's own write: ``print("\\rstep", i)`` reaches
# the pipe in two writes microseconds apart, tqdm's redraws come at least 0.1 s apart.
PROGRESS_END_S = 0.02
# A bar drawn blank: tqdm clearing it (before tqdm.write, or on close with leave=False).
_CLEARED = re.compile(rb"\r[ \t]*\r")
# The "stream" a rank's log records are written as in its log file (1 and 2 are its fds).
_LOG_SOURCE = 0


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
        self.sink = sink
        self.clock = clock
        self.run_dir = run_dir
        self._selector = selectors.DefaultSelector()
        self._partial: dict[tuple[int, int], bytes] = {}
        # (rank, fd) whose partial is a progress line (text after a "\\r"): when it arrived
        self._progress: dict[tuple[int, int], float] = {}
        self._shown: set[tuple[int, int]] = set()  # progress lines already sent as they are
        self._after_carriage: set[tuple[int, int]] = set()  # ended on a "\\r": next text is a bar
        self._drawing: set[tuple[int, int]] = set()  # (rank, fd) whose last line sent was a state
        self._ended_early: set[tuple[int, int]] = set()  # bars ended by other output (see there)
        self._log_midline: dict[int, int] = {}  # rank -> source whose last log write ended mid-line
        self._logs: dict[int, Any] = {}
        self._metrics_file: Any = None  # <run dir>/metrics.jsonl, opened at the first metric
        self._conns: dict[int, RankProcess] = {}
        self.tails: dict[int, collections.deque[str]] = {}
        self.last_output: dict[int, float] = {}  # rank -> clock.now() of its last output
        self._logs_flushed = 0.0
        # in_order log records are lined up by (seq, rank) before the view sees them
        self.in_order = InOrderLog()
        # Where else events come from (another node's ranks, through the rendezvous store).
        self.sources: list[EventSource] = []
        if run_dir is not None:
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for rank in ranks:
            self.add(rank)

    def add(self, rank: RankProcess) -> None:
        """Start reading a (new) rank process's pipes."""
        self._selector.register(rank.stdout_r.fileno(), selectors.EVENT_READ, (rank.rank, 1))
        self._selector.register(rank.stderr_r.fileno(), selectors.EVENT_READ, (rank.rank, 2))
        self._selector.register(rank.conn.fileno(), selectors.EVENT_READ, (rank.rank, 0))
        self._conns[rank.rank] = rank
        self.in_order.add_rank(rank.rank)
        self._open_rank(rank.rank)

    def _open_rank(self, rank: int) -> None:
        if rank not in self.tails:  # called for every remote line: make nothing otherwise
            self.tails[rank] = collections.deque(maxlen=TAIL_LINES)
        if self.run_dir is not None and rank not in self._logs:
            self._logs[rank] = open_private(self.run_dir / f"rank{rank}.log", "ab")

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
            self._log_text(rank, event["text"] + "\n")
            self.sink.handle(event)
            return False
        self._take_event(rank, event)
        return True

    def remove(self, rank: RankProcess) -> None:
        """Stop reading a rank process's pipes (it was replaced by a restarted one)."""
        for end in (rank.stdout_r, rank.stderr_r, rank.conn):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(end.fileno())
        for fd in (1, 2):
            self._partial.pop((rank.rank, fd), None)
            self._progress.pop((rank.rank, fd), None)
            self._shown.discard((rank.rank, fd))
            self._after_carriage.discard((rank.rank, fd))
            self._drawing.discard((rank.rank, fd))

    def publish(self, event: Event) -> None:
        """Give an event made by the parent (state, diagnosis, ...) to the view."""
        if event["kind"] == "log":
            self._end_progress(event["rank"])
            self._log_text(event["rank"], log_line(event))
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
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
            # Written once the run is over: protobuf per value would slow the relay tenfold.
            assert self.run_dir is not None
            write_tensorboard_files(self.run_dir)

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
            partial = self._partial.get((rank, fd), b"?")
            standing = (rank, fd) in self._progress and not partial.strip()
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
        for rank, fd in list(self._partial):
            self._end_line(rank, fd)
        self._after_carriage.clear()
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
            if self._metrics_file is not None:
                self._metrics_file.flush()

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
            self._end_progress(rank)  # a record is the rank's next output
            self._log_text(rank, log_line(event))
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
            self._end_line(rank, fd)
        return data

    def _take_output(self, rank: int, fd: int, data: bytes) -> None:
        """Log a piece of a rank's output and pass its lines on."""
        key = (rank, fd)
        now = time.monotonic()
        self.last_output[rank] = self.clock.now()
        self._end_progress(rank, but=fd)  # output on the other stream ends its progress line
        if key in self._ended_early:
            self._ended_early.discard(key)
            if data[:1] == b"\n":
                self._log_bytes(rank, fd, data[:1])
                data = data[1:]
                if not data:
                    return
        drawn = self._progress.pop(key, None)
        if key in self._after_carriage:  # what comes next continues after a "\r"
            self._after_carriage.discard(key)
            drawn = now
        elif (
            drawn is not None
            and now - drawn >= PROGRESS_END_S
            and data[:1] not in (b"\r", b"\n")
            and not self._partial.get(key, b"").endswith(b"\r")
        ):
            self._end_line(rank, fd)  # new text after a finished bar: a line of its own
            self._log_break(rank)
            drawn = None
        self._log_bytes(rank, fd, data)
        partial = self._partial.pop(key, b"")
        # The progress line on screen is the partial: don't send it again when a "\r" ends it.
        shown = partial.removesuffix(b"\r") if key in self._shown else None
        skip = shown is not None and data[:1] == b"\r" and data[1:2] != b"\n"
        self._shown.discard(key)
        self._split_lines(rank, fd, partial + data, drawn is not None, skip, shown)

    def _split_lines(
        self,
        rank: int,
        fd: int,
        buffer: bytes,
        in_progress: bool,
        skip_first: bool,
        shown: bytes | None,
    ) -> None:
        """Pass on the finished lines of ``buffer``; keep the rest, show it if it is a bar."""
        if b"\r" not in buffer:  # the common case, kept fast: whole lines in one go
            end = buffer.rfind(b"\n") + 1
            if end:
                self._emit_lines(rank, fd, _decode(buffer[: end - 1]).split("\n"), carriage=False)
                in_progress = False
            rest = buffer[end:]
        else:
            rest, after_carriage = self._split_carriage(rank, fd, buffer, skip_first)
            in_progress = after_carriage if after_carriage is not None else in_progress
        while len(rest) > MAX_LINE_BYTES:
            self._emit_lines(rank, fd, [_decode(rest[:MAX_LINE_BYTES])], carriage=False)
            rest = rest[MAX_LINE_BYTES:]
            in_progress = False
        if rest:
            self._partial[(rank, fd)] = rest
        if rest and (in_progress or rest.endswith(b"\r")):
            self._progress[(rank, fd)] = time.monotonic()
            state = rest.removesuffix(b"\r")
            if state:  # the bar as it stands now, redrawn when the rank draws it again
                self._shown.add((rank, fd))
                if state != shown:
                    self._emit_lines(rank, fd, [_decode(state)], carriage=True)

    def _split_carriage(
        self, rank: int, fd: int, buffer: bytes, skip_first: bool
    ) -> tuple[bytes, bool | None]:
        """Split on ``\\n``, ``\\r\\n`` and lone ``\\r``; return the unfinished rest.

        Also returns whether the rest follows a ``\\r`` (None: no line ended in ``buffer``).
        """
        start = 0
        size = len(buffer)
        after_carriage: bool | None = None
        while start < size:
            newline = buffer.find(b"\n", start)
            carriage = buffer.find(b"\r", start)
            if newline < 0 and carriage < 0:
                break
            if carriage < 0 or (0 <= newline < carriage):
                self._emit_lines(rank, fd, [_decode(buffer[start:newline])], carriage=False)
                start = newline + 1
                after_carriage = False
            elif carriage == size - 1:
                break  # a "\r" at the end may be the first half of "\r\n": wait for more
            elif buffer[carriage + 1 : carriage + 2] == b"\n":
                self._emit_lines(rank, fd, [_decode(buffer[start:carriage])], carriage=False)
                start = carriage + 2
                after_carriage = False
            else:
                if not (skip_first and start == 0):
                    self._emit_lines(rank, fd, [_decode(buffer[start:carriage])], carriage=True)
                start = carriage + 1
                after_carriage = True
        return buffer[start:], after_carriage

    def _end_line(self, rank: int, fd: int) -> None:
        """Pass on the unfinished line of ``(rank, fd)`` as finished: its last state stays."""
        key = (rank, fd)
        rest = self._partial.pop(key, b"")
        self._progress.pop(key, None)
        self._shown.discard(key)
        if rest.endswith(b"\r"):
            rest = rest[:-1]
            self._after_carriage.add(key)  # the rank's next text there redraws from the start
        if rest or key in self._drawing:  # a blank last state (a cleared bar) ends it too
            self._emit_lines(rank, fd, [_decode(rest)], carriage=False)

    def _end_progress(self, rank: int, but: int | None = None) -> None:
        """End the rank's progress lines: it wrote something else (``but``: on that fd)."""
        for fd in (1, 2):
            if fd != but and ((rank, fd) in self._progress or (rank, fd) in self._drawing):
                self._end_line(rank, fd)
                # The bar's own "\n" may still be on its way (pipes and the event channel are
                # read in no set order): it ends the line shown already, not a blank one.
                self._ended_early.add((rank, fd))

    def _emit_lines(self, rank: int, fd: int, texts: list[str], *, carriage: bool) -> None:
        if carriage:
            self._drawing.add((rank, fd))
        else:
            self._drawing.discard((rank, fd))
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

    def write_metrics(self, event: dict[str, Any]) -> None:
        """Append a ``metrics`` event to ``<run dir>/metrics.jsonl`` (nblaunch.ranks.metrics)."""
        if self.run_dir is None:
            return
        if self._metrics_file is None:
            self._metrics_file = open_private(self.run_dir / METRICS_FILE, "a")
        self._metrics_file.write(metric_lines(event))

    def _log_text(self, rank: int, text: str) -> None:
        self._log_bytes(rank, _LOG_SOURCE, text.encode("utf-8", errors="replace"))

    def _log_break(self, rank: int) -> None:
        """End the line the rank's log file is in the middle of."""
        log = self._logs.get(rank)
        if log is not None and self._log_midline.pop(rank, None) is not None:
            log.write(b"\n")

    def _log_bytes(self, rank: int, source: int, data: bytes) -> None:
        """Write to the rank's log file, breaking the line where another source left off."""
        log = self._logs.get(rank)
        if log is None or not data:
            return
        midline = self._log_midline.pop(rank, None)
        if midline is not None and midline != source and data[:1] != b"\n":
            log.write(b"\n")
        log.write(data)
        if not data.endswith(b"\n"):
            self._log_midline[rank] = source


def _decode(raw: bytes) -> str:
    """Text of a rank's bytes; invalid UTF-8 becomes U+FFFD instead of breaking the view."""
    return raw.decode("utf-8", errors="replace")


def open_private(path: Path, mode: str) -> Any:
    """A run file (``rank<N>.log``, ``metrics.jsonl``) opened for appending in ``mode``,
    readable by this user only: ranks print tokens too."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), mode)


def log_line(event: Log) -> str:
    """How a rank's ``Log`` record reads in its ``rank<N>.log`` file."""
    return f"{event['level']}:{event['name']}: {event['message']}\n"
