"""A rank's output as lines: split per rank and per stream, progress bars kept whole.

Lines are split per rank and per descriptor, so two ranks' output is never glued together or cut
in the middle; a line ended by ``\\r`` (a progress bar redrawing) is marked as such.

A progress line is the text after a rank's last ``\\r``. It is shown as soon as it arrives (a
``carriage`` event: a state to be redrawn), and it ends, keeping its last state as a finished
line, where the rank's next output begins: the ``\\n`` that tqdm writes when it closes, output on
the rank's other stream, a log record, or, on the same stream, text that arrives
``PROGRESS_END_S`` or more after the bar was drawn (Transformers' logger writes to stderr, like
tqdm), or at once after a whole tqdm state (``WHOLE_BAR``). Without that, a bar's last state
and the next line would be glued together, as they are in a terminal.

Every byte goes on to the rank's log file too (:class:`nblaunch.engine.output.log_files.RunFiles`),
with a line break where a progress line ends as above.
"""

from __future__ import annotations

import collections
import re
import time

from nblaunch.engine.output.log_files import RunFiles
from nblaunch.events import EventSink, Stream

# A line longer than this is passed on in pieces rather than held in memory until its end.
MAX_LINE_BYTES = 1 << 16
TAIL_LINES = 20
# Text on a progress bar's stream that comes this long after the bar was drawn starts a new
# line. Sooner, it is taken as the rest of the bar's own write: ``print("\\rstep", i)`` reaches
# the pipe in two writes microseconds apart, tqdm's redraws come at least 0.1 s apart.
PROGRESS_END_S = 0.02
# A tqdm bar's whole state, "  3%|▎         | 1/30 [00:01<00:29,  1.00it/s]": tqdm writes it in one
# write, so text that follows it on its stream, however soon, is not the rest of it (torch's
# C++ warnings write to the same stderr as the bar).
WHOLE_BAR = re.compile(rb"\d+%\|[^|]*\|.*\]\s*$")
# The same, with text glued after it (both came in one read): the bar's state, then the text.
BAR_THEN_TEXT = re.compile(r"^([^\n]*?\d+%\|[^|]*\|[^\]]*\])(\S.*)$")


class LineSplitter:
    """Splits each rank's stdout and stderr into ``Stream`` lines; owns their unfinished ends.

    Parameters
    ----------
    sink
        Where the lines go (a view); the relay sets :attr:`sink` again when its own changes.
    files
        The run's files: every byte goes to the rank's log file as it arrives.
    """

    def __init__(self, sink: EventSink, files: RunFiles) -> None:
        self.sink = sink
        self.files = files
        self.tails: dict[int, collections.deque[str]] = {}  # rank -> its last finished lines
        self._partial: dict[tuple[int, int], bytes] = {}
        # (rank, fd) whose partial is a progress line (text after a "\\r"): when it arrived
        self._progress: dict[tuple[int, int], float] = {}
        self._shown: set[tuple[int, int]] = set()  # progress lines already sent as they are
        self._after_carriage: set[tuple[int, int]] = set()  # ended on a "\\r": next text is a bar
        self._drawing: set[tuple[int, int]] = set()  # (rank, fd) whose last line sent was a state
        self._ended_early: set[tuple[int, int]] = set()  # bars ended by other output (see there)

    def add_rank(self, rank: int) -> None:
        """Keep a tail for ``rank`` (called for every remote line: makes nothing otherwise)."""
        if rank not in self.tails:
            self.tails[rank] = collections.deque(maxlen=TAIL_LINES)

    def forget(self, rank: int) -> None:
        """Drop the unfinished lines of ``rank``'s process: a restarted one replaces it."""
        for fd in (1, 2):
            self._partial.pop((rank, fd), None)
            self._progress.pop((rank, fd), None)
            self._shown.discard((rank, fd))
            self._after_carriage.discard((rank, fd))
            self._drawing.discard((rank, fd))

    def stands_cleared(self, rank: int, fd: int) -> bool:
        """Whether the progress line of ``(rank, fd)`` stands blank (tqdm cleared the bar)."""
        return (rank, fd) in self._progress and not self._partial.get((rank, fd), b"?").strip()

    def take(self, rank: int, fd: int, data: bytes) -> None:
        """Log a piece of a rank's output and pass its lines on."""
        key = (rank, fd)
        now = time.monotonic()
        self.end_progress(rank, but=fd)  # output on the other stream ends its progress line
        if key in self._ended_early:
            self._ended_early.discard(key)
            if data[:1] == b"\n":
                self.files.log_bytes(rank, fd, data[:1])
                data = data[1:]
                if not data:
                    return
        drawn = self._progress.pop(key, None)
        if key in self._after_carriage:  # what comes next continues after a "\r"
            self._after_carriage.discard(key)
            drawn = now
        elif (
            drawn is not None
            and (now - drawn >= PROGRESS_END_S or WHOLE_BAR.search(self._partial.get(key, b"")))
            and data[:1] not in (b"\r", b"\n")
            and not self._partial.get(key, b"").endswith(b"\r")
        ):
            self.end_line(rank, fd)  # new text after a finished bar: a line of its own
            self.files.log_break(rank)
            drawn = None
        self.files.log_bytes(rank, fd, data)
        partial = self._partial.pop(key, b"")
        # The progress line on screen is the partial: don't send it again when a "\r" ends it.
        shown = partial.removesuffix(b"\r") if key in self._shown else None
        skip = shown is not None and data[:1] == b"\r" and data[1:2] != b"\n"
        self._shown.discard(key)
        self._split_lines(rank, fd, partial + data, drawn is not None, skip, shown)

    def end_line(self, rank: int, fd: int) -> None:
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

    def end_all(self) -> None:
        """Pass on every unfinished line as finished: the task or run is over."""
        for rank, fd in list(self._partial):
            self.end_line(rank, fd)
        self._after_carriage.clear()

    def end_progress(self, rank: int, but: int | None = None) -> None:
        """End the rank's progress lines: it wrote something else (``but``: on that fd)."""
        for fd in (1, 2):
            if fd != but and ((rank, fd) in self._progress or (rank, fd) in self._drawing):
                self.end_line(rank, fd)
                # The bar's own "\n" may still be on its way (pipes and the event channel are
                # read in no set order): it ends the line shown already, not a blank one.
                self._ended_early.add((rank, fd))

    # --- internals -------------------------------------------------------------------------------

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

    def _emit_lines(self, rank: int, fd: int, texts: list[str], *, carriage: bool) -> None:
        if carriage:
            self._drawing.add((rank, fd))
        else:
            self._drawing.discard((rank, fd))
            if any("%|" in text for text in texts):
                texts = _unglue_bars(texts)
            self.tails[rank].extend(texts[-TAIL_LINES:])
        events: list[Stream] = [
            {"kind": "stream", "rank": rank, "fd": fd, "text": text, "carriage": carriage}
            for text in texts
        ]
        many = getattr(self.sink, "handle_many", None)  # a hub takes a read's lines at once
        if many is not None:
            many(events)
            return
        handle = self.sink.handle
        for event in events:
            handle(event)


def _unglue_bars(texts: list[str]) -> list[str]:
    """A tqdm state with text glued after it is two lines (see ``WHOLE_BAR``)."""
    out = []
    for text in texts:
        glued = BAR_THEN_TEXT.match(text) if "%|" in text else None
        out += glued.groups() if glued else [text]
    return out


def _decode(raw: bytes) -> str:
    """Text of a rank's bytes; invalid UTF-8 becomes U+FFFD instead of breaking the view."""
    return raw.decode("utf-8", errors="replace")
