"""A line's shape: what must match for lines of several ranks to fold into one.

A line is read as literal text and *slots*, the numbers that may differ between ranks that
print the same line:

- measurements: numbers with a decimal point or an exponent (``loss 0.41``, ``1e-05``);
- clock times with their fraction of a second: tqdm's ``00:07``, torch's
  ``18:18:04.929622867``, Python logging's ``18:18:04,929``;
- process and thread ids: the number after the time in a glog header (torch's
  ``W1204 18:18:04.934000 <pid> distributed.py:12]``), and a number after ``pid``, ``tid``,
  ``thread`` or ``thread id``;
- the printing rank's own number, only where the line names it as a rank or a device:
  ``rank 5``, ``[rank5]:``, ``local_rank=5``, ``cuda:5``, ``GPU 5``. The same number anywhere
  else (``error count 5``, ``on shard 5``) is a whole number.

Every other whole number is literal: it counts (steps, epochs, batches, errors), and ``step 20``
of some ranks is not ``step 40`` of others. A line's shape is its text with each slot replaced
by its kind. A tqdm bar's state is a shape of its own: every number and the bar's body are
slots.

:class:`ShapeCounter` numbers each line of a rank by how many lines alike but for their numbers
the rank printed before it, so that folding joins the k-th such line of each rank and nothing
else.
"""

from __future__ import annotations

import functools
import re

from nblaunch.notebook.views.ansi import plain

# What tqdm draws: "desc:  42%|████▏     | 42/100 [00:01<00:02, 30.12it/s]".
TQDM = re.compile(
    r"(?P<pct>\d+)%\|.*\|\s*(?P<n>\d+)/(?P<total>\d+)\s*"
    r"\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+)(?:,\s*(?P<rate>[^\]]*))?\]"
)
# A number as lines hold them, read whole: 40, -3, 0.41, 1e-05, 18:18:04.929622867, 2.13.0.
# Looking for digits first is fast; what kind of number it is comes from the number itself and
# the few characters before it.
NUMBER_TEXT = re.compile(r"-?\d+(?:[:.,]\d+)*(?:[eE][-+]?\d+)?")
CLOCK_TEXT = re.compile(r"-?\d+:\d\d(?::\d\d(?:[.,]\d+)?)?$")
MEASURE_TEXT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?$|-?\d+[eE][-+]?\d+$")
# glog's header after its time: "<pid> file.py:123]".
GLOG_PID = re.compile(r"\s+(\d+)(?=\s+\S+:\d+\])")
# Words before a number that make it an id, or the rank's own number (matched at the end of the
# few characters before the number).
ID_WORD = re.compile(r"(?i:\b(?:pid|tid|thread(?:[ _]?id)?|process[ _]?id))[\s=:#]*$")
RANK_WORD = re.compile(r"(?i:rank|cuda:|gpu|device)[\s=:#]*$")
# How far before a number those words are looked for.
WORD_SPAN = 16
# Every number of a bar's state, a clock time as one.
BAR_NUMBER = re.compile(r"\d+:\d\d(?::\d\d)?|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# A progress bar's body: "|████▏     |".
BAR = re.compile(r"\|[^|]*\|")
# What a bar's state's shape begins with.
BAR_SHAPE = "\1bar "
# Slot kinds, as they stand in a shape.
CLOCK, PID, ID, RANK, MEASURE, NUMBER = "\0c", "\0p", "\0i", "\0r", "\0m", "\0n"
# What ShapeCounter counts a line by: its text without its digits and signs.
NO_DIGITS = str.maketrans("", "", "0123456789+-")  # (and signs: "loss -1.0", "loss 0.5")
# Line kinds a ShapeCounter remembers per rank; the least recently printed is forgotten first.
SHAPES_PER_RANK = 4096


@functools.lru_cache(maxsize=8192)
def line_shape(text: str, rank: int) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``(shape, kinds, values)`` of a line ``rank`` printed: its text with each slot replaced
    by its kind, and the kinds and values of its slots, in order."""
    if "%|" in text and TQDM.search(plain(text)):
        values = tuple(BAR_NUMBER.findall(text))
        shape = BAR_SHAPE + BAR_NUMBER.sub("#", BAR.sub("|#|", text))
        return shape, (NUMBER,) * len(values), values
    pieces: list[str] = []
    kinds: list[str] = []
    values: list[str] = []
    at = 0
    pid_at = -1  # where glog's pid begins, once its time was read
    for match in NUMBER_TEXT.finditer(text):
        start, end = match.span()
        token = match[0]
        kind = _kind(text, start, token, rank, pid_at)
        if kind is None:
            continue
        if kind == CLOCK:
            glog = GLOG_PID.match(text, end)
            pid_at = glog.start(1) if glog else -1
        pieces += [text[at:start], kind]
        kinds.append(kind)
        values.append(token)
        at = end
    pieces.append(text[at:])
    return "".join(pieces), tuple(kinds), tuple(values)


def _kind(text: str, start: int, token: str, rank: int, pid_at: int) -> str | None:
    """The kind of the number ``token`` at ``start``; None for one that is literal (a whole
    number, a version, an address)."""
    if start == pid_at:
        return PID
    if ":" in token:
        return CLOCK if CLOCK_TEXT.match(token) else None
    if "." in token or "e" in token or "E" in token:
        return MEASURE if MEASURE_TEXT.match(token) else None
    if "," in token or token[0] == "-":
        return None
    before = max(0, start - WORD_SPAN)
    if ID_WORD.search(text, before, start):
        return ID
    if int(token) == rank and RANK_WORD.search(text, before, start):
        return RANK  # "rank 3" printed by rank 5 names another rank: literal
    return None


class ShapeCounter:
    """How many lines alike but for their numbers each rank printed: a line's ``k``, its place
    among them. Cheap (no regular expression: every line a rank prints is counted as it
    comes); lines of one shape are alike but for their numbers, so the k-th line of a shape
    is the k-th such line of each rank that printed the same lines.

    Memory is bounded: each rank remembers its ``SHAPES_PER_RANK`` most recently printed kinds
    of line.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], dict[str, int]] = {}  # (rank, fd) -> counts

    def count(self, rank: int, fd: int, text: str) -> int:
        """``k`` of this line: the number of lines alike but for their numbers, on the same
        stream, that the rank printed before it."""
        counts = self._counts.get((rank, fd))
        if counts is None:
            counts = self._counts[(rank, fd)] = {}
        key = text.translate(NO_DIGITS)
        k = counts.pop(key, -1) + 1  # popped and put back: the most recent last
        counts[key] = k
        if len(counts) > SHAPES_PER_RANK:
            del counts[next(iter(counts))]
        return k
