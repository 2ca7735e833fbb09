"""``TextView``: a run as ``[rank N]``-prefixed text, for terminals, scripts and logs.

It keeps no run model: every event becomes text at once, and the end of the run prints the
outcome the ``run_ended`` event carries.
"""

from __future__ import annotations

import collections
import itertools
import re
import sys
import time
from typing import TextIO

from nblaunch.events import Event, RunState, after_restarts, checking_mode
from nblaunch.notebook.views.fold import Fold, in_order, rank_ranges
from nblaunch.notebook.views.model import FOLD_FROM_RANKS, Line
from nblaunch.notebook.views.shapes import SHAPES_PER_RANK, ShapeCounter, line_shape
from nblaunch.options import DEFAULT_LINE_PREFIX, format_line_prefix

# Past this many ranks, the end of the run groups ranks by outcome.
SUMMARY_BY_RANK = 8
# How long a line waits for the other ranks' copies of it before it is written (with the ranks
# that printed it so far): HOLD_S after the latest copy came, MAX_HOLD_S in all (ranks that
# share a few cores start seconds apart). What comes after it waits too, so that order is kept.
HOLD_S = 1.0
MAX_HOLD_S = 5.0
# A shape's whole numbers, taken out: "step 5 loss #" and "step 6 loss #" are printed by the
# same ranks.
_WHOLE = re.compile(r"\d+")


class TextView:
    """Prints every event as ``[rank N]``-prefixed text; for terminals, scripts and logs.

    Output is batched and written at most ``max_rate`` times a second, so fast ranks cost few
    writes; a ``\\r`` progress line is printed at most once a second per rank, and its last state
    once, when the line ends (a bar that was cleared leaves nothing). Ranks' stderr,
    logs and nblaunch's notes go to stderr, the rest to stdout, in the order they happened.

    ``line_prefix`` is a template (Accelerate's and torchrun's ``log_line_prefix_template``:
    ``${rank}``, ``${local_rank}``, ``${role_name}``); ``ranks_per_node`` makes local ranks of a
    multi-node run's global ones.

    Raises
    ------
    LaunchError
        A ``line_prefix`` that cannot be filled in.
    """

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        *,
        max_rate: float = 20.0,
        line_prefix: str = DEFAULT_LINE_PREFIX,
        ranks_per_node: int | None = None,
    ) -> None:
        format_line_prefix(line_prefix, 0)  # a bad template is named before the run starts
        self._line_prefix = line_prefix
        self._ranks_per_node = ranks_per_node
        self._prefixes: dict[int, str] = {}
        self._stdout = stdout
        self._stderr = stderr
        # In arrival order: the folds of ranks' lines ([rank, fd, text], alike ones of several
        # ranks joined while they wait) and text of nblaunch's own (to stderr?, text).
        self._pending: collections.deque[_Held | tuple[bool, str]] = collections.deque()
        self._open: dict[tuple[int, str, int], _Held] = {}  # folds that still wait, by key
        self._shapes = ShapeCounter()
        self._last_fold: dict[int, Fold] = {}  # rank -> the fold of its latest line
        self._folds_made = 0
        # Which ranks print lines of a shape (whole numbers out), where not all of them do.
        self._printers: dict[tuple[int, str], frozenset[int]] = {}
        self._interval = 1.0 / max_rate
        self._last_flush = 0.0
        self._last_carriage: dict[int, float] = {}
        self._bars: set[tuple[int, int]] = set()  # (rank, fd) whose last line was a "\\r" one
        self._bar_shown: dict[tuple[int, int], str] = {}  # the bar's state printed last
        self.world_size = 0

    @property
    def stdout(self) -> TextIO:
        return self._stdout or sys.stdout

    @property
    def stderr(self) -> TextIO:
        return self._stderr or sys.stderr

    def handle(self, event: Event) -> None:
        kind = event["kind"]
        if kind == "stream":
            rank = event["rank"]
            key = (rank, event["fd"])
            if event["carriage"]:
                self._bars.add(key)
                now = time.monotonic()
                if not event["text"].strip() or now - self._last_carriage.get(rank, 0.0) < 1.0:
                    return
                self._last_carriage[rank] = now
                self._bar_shown[key] = event["text"]
            elif key in self._bars:
                self._bars.discard(key)
                if not event["text"].strip():
                    return  # the bar was cleared (tqdm's leave=False): nothing to keep
                if self._bar_shown.pop(key, None) == event["text"]:
                    return  # its last state is the one printed last: once is enough
            self._add([rank, event["fd"], event["text"]], event["carriage"])
        elif kind == "log":
            self._add([event["rank"], 2, f"{event['level']} {event['message']}"], False)
        elif kind == "progress":
            self._pending.append((False, f"{self.prefix(event['rank'])}{event['text']}\n"))
        elif kind == "run_info":
            self.world_size = event["world_size"]
            line = (
                f"nblaunch: {event['world_size']} rank(s) on {event['device_kind']} "
                f"({event['start_method']}, {checking_mode(event)})"
            )
            if event["run_dir"]:
                line += f", logs in {event['run_dir']}"
            self._pending.append((False, line + "\n"))
            self._pending.extend((False, f"nblaunch: {note}\n") for note in event.get("notes", ()))
            self._pending.extend((False, f"nblaunch: warning: {w}\n") for w in event["warnings"])
        elif kind == "state":
            if event["state"] in (RunState.STALLED, RunState.RETRYING) and event["detail"]:
                line = f"{self.prefix(event['rank'])}{event['state'].value}: {event['detail']}\n"
                self._pending.append((True, line))
        elif kind == "diagnosis":
            if event["severity"] != "error":  # errors are raised; the traceback shows them
                self._pending.append((True, f"nblaunch: {event['title']}\n{event['body']}\n"))
        elif kind == "run_ended":
            summary = _summary_text(
                event["ok"], event["elapsed_s"], event["ranks"], after_restarts(event)
            )
            self._pending.append((False, summary))

    def prefix(self, rank: int) -> str:
        """What ``rank``'s lines start with."""
        text = self._prefixes.get(rank)
        if text is None:
            local = rank % self._ranks_per_node if self._ranks_per_node else rank
            text = self._prefixes[rank] = format_line_prefix(self._line_prefix, rank, local)
        return text

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < self._interval:
            return
        self._last_flush = now
        pending = self._ready(now, force)
        for to_stderr, texts in itertools.groupby(pending, key=lambda item: item[0]):
            stream = self.stderr if to_stderr else self.stdout
            stream.write("".join(text for _, text in texts))
            stream.flush()

    def close(self) -> None:
        self.flush(force=True)

    def _add(self, line: Line, carriage: bool) -> None:
        """A rank's line joins the fold of the same line of other ranks that still waits (see
        ``fold``'s rule), or begins one. A bar's state (``carriage``) joins any waiting state
        of the same bar that its rank is not in."""
        rank, fd, text = line
        if self.world_size < FOLD_FROM_RANKS or not text.strip():
            self._pending.append((fd == 2, f"{self.prefix(rank)}{text}\n"))
            return
        shape = line_shape(text, rank)[0]
        key = (fd, shape, -1 if carriage else self._shapes.count(rank, fd, text))
        held = self._open.get(key)
        if (
            held is None
            or rank in held.rank_set
            or not in_order(self._pending, held, self._last_fold.get(rank))
        ):
            self._folds_made += 1
            held = self._open[key] = _Held(
                key, (fd, _WHOLE.sub("#", shape)), float(self._folds_made), time.monotonic()
            )
            self._pending.append(held)
        held.lines.append(line)
        held.rank_set.add(rank)
        held.latest = time.monotonic()
        self._last_fold[rank] = held

    def _ready(self, now: float, force: bool) -> list[tuple[bool, str]]:
        """What to write now, in order: the waiting texts up to the first fold that still
        waits for ranks it expects (``HOLD_S`` after its latest copy, ``MAX_HOLD_S`` in all)."""
        out: list[tuple[bool, str]] = []
        everyone = frozenset(range(self.world_size))
        while self._pending:
            item = self._pending[0]
            if isinstance(item, tuple):
                out.append(self._pending.popleft())
                continue
            ranks = frozenset(item.rank_set)
            expected = self._printers.get(item.printers, everyone)
            waited = now - item.latest >= HOLD_S or now - item.born >= MAX_HOLD_S
            if not (force or expected <= ranks or waited):
                break
            self._pending.popleft()
            if self._open.get(item.key) is item:
                del self._open[item.key]
            self._learn(item.printers, ranks, everyone)
            out.append((item.fd == 2, f"{self._prefix_of(item.ranks)}{item.text()}\n"))
        return out

    def _learn(self, printers: tuple[int, str], ranks: frozenset[int], everyone: frozenset[int]):
        """Which ranks print lines like this one: the next such line waits for those only (a
        line only rank 0 prints is not held back each time)."""
        self._printers.pop(printers, None)
        if ranks != everyone:
            self._printers[printers] = ranks
            if len(self._printers) > SHAPES_PER_RANK:
                del self._printers[next(iter(self._printers))]

    def _prefix_of(self, ranks: list[int]) -> str:
        """The prefix of a line that ``ranks`` printed alike: their ranges as ``${rank}``."""
        if len(ranks) == 1:
            return self.prefix(ranks[0])
        per_node = self._ranks_per_node
        local = rank_ranges(sorted({r % per_node for r in ranks})) if per_node else None
        return format_line_prefix(self._line_prefix, rank_ranges(ranks), local)


class _Held(Fold):
    """A fold of the text view that waits for the other ranks' copies of its line."""

    def __init__(
        self, key: tuple[int, str, int], printers: tuple[int, str], pos: float, born: float
    ) -> None:
        super().__init__(0, [], set(), pos)
        self.key = key
        self.printers = printers
        self.born = born
        self.latest = born  # when its latest copy came


def _summary_text(ok: bool, elapsed_s: float, ranks: dict[int, str], restarts: str = "") -> str:
    """The run's end: each rank's outcome; past ``SUMMARY_BY_RANK`` ranks, ranks that ended
    alike share a line (``ranks 0-16,18-63: returned``). ``restarts``: " after 1 restart"."""
    lines = [f"nblaunch: {'finished' if ok else 'failed'} in {elapsed_s:.2f} s{restarts}"]
    if len(ranks) <= SUMMARY_BY_RANK:
        lines += [f"  rank {rank}: {outcome}" for rank, outcome in sorted(ranks.items())]
    else:
        alike: dict[str, list[int]] = {}
        for rank, outcome in sorted(ranks.items()):
            alike.setdefault(outcome, []).append(rank)
        for outcome, members in sorted(alike.items(), key=lambda item: len(item[1])):
            many = len(members) > 1
            lines.append(f"  rank{'s' if many else ''} {rank_ranges(members)}: {outcome}")
    return "\n".join(lines) + "\n"
