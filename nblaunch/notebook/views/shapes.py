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

:class:`ShapeCounter` numbers each line of a rank by how many lines of its shape the rank printed
before it, so that folding joins the k-th such line of each rank and nothing else.
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
# The slots of a line, and the whole numbers between them, left to right.
SLOT = re.compile(
    r"(?P<clock>(?<![\d:])\d+:\d\d(?::\d\d(?:[.,]\d+)?)?(?![\d:]))"
    r"(?:(?P<gap>\s+)(?P<glog>\d+)(?=\s+\S+:\d+\]))?"
    r"|(?P<idword>(?i:\b(?:pid|tid|thread(?:[ _]?id)?|process[ _]?id))[\s=:#]*)(?P<id>\d+)(?![\d.])"
    r"|(?P<rankword>(?i:rank|cuda:|gpu|device)[\s=:#]*)(?P<rank>\d+)(?![\d.])"
    r"|(?P<dotted>\d+(?:\.\d+){2,})"  # 2.13.0, 127.0.0.1: literal, like whole numbers
    r"|(?P<measure>-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+)"
    r"|(?P<whole>-?\d+)"
)
# Every number of a bar's state, a clock time as one.
BAR_NUMBER = re.compile(r"\d+:\d\d(?::\d\d)?|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# A progress bar's body: "|████▏     |".
BAR = re.compile(r"\|[^|]*\|")
# What a bar's state's shape begins with.
BAR_SHAPE = "\1bar "
# Slot kinds, as they stand in a shape.
CLOCK, PID, ID, RANK, MEASURE, NUMBER = "\0c", "\0p", "\0i", "\0r", "\0m", "\0n"
# Shapes a ShapeCounter remembers per rank; the least recently printed is forgotten first.
SHAPES_PER_RANK = 4096


_GROUPS = ((CLOCK, "clock"), (PID, "glog"), (ID, "id"), (RANK, "rank"), (MEASURE, "measure"))


@functools.lru_cache(maxsize=8192)
def line_shape(text: str, rank: int) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``(shape, kinds, values)`` of a line ``rank`` printed: its text with each slot replaced
    by its kind, and the kinds and values of its slots, in order."""
    if TQDM.search(plain(text)):
        values = tuple(BAR_NUMBER.findall(text))
        shape = BAR_SHAPE + BAR_NUMBER.sub("#", BAR.sub("|#|", text))
        return shape, (NUMBER,) * len(values), values
    pieces: list[str] = []
    kinds: list[str] = []
    values: list[str] = []
    at = 0
    own = str(rank)
    for match in SLOT.finditer(text):
        if match["whole"] is not None or match["dotted"] is not None:
            continue
        if match["rank"] is not None and match["rank"].lstrip("0") != own.lstrip("0"):
            continue  # "rank 3" printed by rank 5 names another rank: literal
        for kind, group in _GROUPS:
            if match[group] is not None:
                start, end = match.span(group)
                pieces += [text[at:start], kind]
                kinds.append(kind)
                values.append(match[group])
                at = end
    pieces.append(text[at:])
    return "".join(pieces), tuple(kinds), tuple(values)


class ShapeCounter:
    """How many lines of each shape each rank printed: a line's ``k``, its place among them.

    Memory is bounded: each rank remembers its ``SHAPES_PER_RANK`` most recently printed shapes
    (a line with a step number in it is a shape of its own, printed once).
    """

    def __init__(self) -> None:
        self._counts: dict[int, dict[tuple[int, str], int]] = {}

    def count(self, rank: int, fd: int, text: str) -> int:
        """``k`` of this line: the number of lines of its shape and stream the rank printed
        before it."""
        counts = self._counts.get(rank)
        if counts is None:
            counts = self._counts[rank] = {}
        key = (fd, line_shape(text, rank)[0])
        k = counts.pop(key, -1) + 1  # popped and put back: the most recent last
        counts[key] = k
        if len(counts) > SHAPES_PER_RANK:
            del counts[next(iter(counts))]
        return k
