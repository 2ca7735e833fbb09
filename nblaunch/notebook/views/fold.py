"""Alike lines of many ranks, folded into one: what "All ranks" and the text view show.

Eight ranks running the same loop print every line eight times. A line that several ranks
print alike is shown once with the ranks that printed it: ``[0-7] epoch 0 step 40 lr 0.05``.
The rule, so that folding never shows a line no rank printed:

- Lines fold only if they have the same *shape* (:mod:`~nblaunch.notebook.views.shapes`): the
  same text but for measurements (``loss 0.41``), clock times (``00:07``, torch's and
  logging's timestamps), process and thread ids, and the printing rank's own number where the
  line names it as a rank (``rank 5``, ``cuda:5``). Whole numbers must match: ``error count
  5`` printed by rank 5 does not fold with ``error count 3`` printed by rank 3.
- A fold only joins the same line of each rank's output: the k-th line alike but for its
  numbers that each rank printed (on the same stream). Rank 2's second ``loss`` line never
  joins rank 4's first.
- Each slot that differs is shown as its range, ``low … high`` (a process or thread id as
  ``<pid>`` or ``<id>``); a tqdm bar's state may differ in every number.

Pure functions of the kept lines: the exact lines stay one hover (the folded line's title) or
one rank away, and the rank logs on disk keep every byte.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from nblaunch.notebook.views.model import FD, FOLD_FROM_RANKS, RANK, TEXT, Line
from nblaunch.notebook.views.shapes import BAR_NUMBER, BAR_SHAPE, ID, NO_DIGITS, PID, line_shape

# How far apart (in lines of "All ranks", per rank of the run) the copies of a line may come:
# a copy that comes later is shown where it comes, not far up among lines already read.
WINDOW_PER_RANK = 16
# Where a kept line holds its k (see shapes.ShapeCounter), when the view counted it.
K = 3
# How an id that differs between ranks is shown.
ID_SHOWN = {PID: "<pid>", ID: "<id>"}


@dataclass(eq=False)  # folds are told apart by identity: two may hold alike lines
class Fold:
    """One line as "All ranks" shows it: the alike lines of one or more ranks."""

    first: int  # where its first line came, among the lines folded
    lines: list[Line] = field(default_factory=list)  # one per rank, in arrival order
    rank_set: set[int] = field(default_factory=set)
    pos: float = -1.0  # its place among the folds (see move_after); -1: its first line's

    @property
    def ranks(self) -> list[int]:
        return sorted(line[RANK] for line in self.lines)

    @property
    def fd(self) -> int:
        return self.lines[0][FD]

    def text(self) -> str:
        """The line, each slot that differs between ranks shown as ``low … high`` (an id as
        ``<pid>`` or ``<id>``)."""
        texts = [line[TEXT] for line in self.lines]
        if len(set(texts)) == 1:
            return texts[0]
        shapes = [line_shape(line[TEXT], line[RANK]) for line in self.lines]
        kinds = shapes[0][1]
        if any(shape[1] != kinds for shape in shapes):  # a bar before and after its rate shows
            return texts[0]
        if shapes[0][0].startswith(BAR_SHAPE):
            between = BAR_NUMBER.split(texts[0])
        else:
            first, *rest = shapes[0][0].split("\0")
            between = [first, *(piece[1:] for piece in rest)]  # each slot's kind taken off
        out = [between[0]]
        for slot, kind in enumerate(kinds):
            values = [shape[2][slot] for shape in shapes]
            if len(set(values)) == 1:
                out.append(values[0])
            elif kind in ID_SHOWN:
                out.append(ID_SHOWN[kind])
            else:
                ordered = sorted(values, key=_value)
                out.append(f"{ordered[0]} … {ordered[-1]}")
            out.append(between[slot + 1])
        return "".join(out)

    def exact(self) -> str:
        """The folded lines as the ranks printed them, ``[rank] text`` each."""
        return "\n".join(f"[{line[RANK]}] {line[TEXT]}" for line in self.lines)


def fold_lines(lines: Sequence[Line], world_size: int) -> list[Fold]:
    """``lines`` (in arrival order) folded: each line joins the fold of the same line of the
    other ranks (same stream, same shape, same k: see the module's rule) if that fold began at
    most ``WINDOW_PER_RANK * world_size`` lines before, and if the rank's lines stay in their
    order (see :func:`in_order`); otherwise it begins one. A line's k is
    its ``K``-th item when the view counted it as it came (every line the rank printed, kept or
    not), else it is counted among ``lines``. A run of fewer than ``FOLD_FROM_RANKS`` ranks
    folds nothing: a fold per line.
    """
    if world_size < FOLD_FROM_RANKS:
        return [Fold(index, [line], {line[RANK]}) for index, line in enumerate(lines)]
    window = WINDOW_PER_RANK * max(1, world_size)
    folds: list[Fold] = []
    latest: dict[tuple[int, str, int], Fold] = {}
    counts: dict[tuple[int, int, str], int] = {}  # for lines that carry no k
    last: dict[int, Fold] = {}  # rank -> the fold of its latest line
    for index, line in enumerate(lines):
        rank = line[RANK]
        key = fold_key(line, index, counts)
        fold = latest.get(key)
        if (
            fold is not None
            and rank not in fold.rank_set
            and index - fold.first <= window
            and in_order(folds, fold, last.get(rank))
        ):
            fold.lines.append(line)
            fold.rank_set.add(rank)
        else:
            fold = latest[key] = Fold(index, [line], {rank}, float(index))
            folds.append(fold)
        last[rank] = fold
    return folds


def in_order(items: MutableSequence[Any], fold: Fold, last: Fold | None) -> bool:
    """Whether a rank whose latest line is in ``last`` may join ``fold`` with its lines kept in
    their order: ``fold`` comes after ``last``, or can be moved to just after it, with the
    folds between them that must stay after it (they share a rank with it, or with one of
    those), which this does. It cannot when one of the folds to move holds a line of the
    joining rank, or ``last`` a line of their ranks. ``items``: the folds (and other things)
    in the order they are shown, each fold's ``pos`` growing along it."""
    if last is None or fold.pos > last.pos:
        return True
    start = items.index(fold)
    end = items.index(last, start)
    moving = [fold]
    ranks = set(fold.rank_set)
    for item in itertools.islice(items, start + 1, end):
        if isinstance(item, Fold) and item.rank_set & ranks:
            moving.append(item)
            ranks |= item.rank_set
    if ranks & last.rank_set:  # (the joining rank is in last)
        return False
    for item in moving:
        items.remove(item)
    at = items.index(last, start - 1 if start else 0) + 1
    after = next(
        (item.pos for item in itertools.islice(items, at, None) if isinstance(item, Fold)),
        last.pos + 1,
    )
    step = (after - last.pos) / (len(moving) + 1)
    for offset, item in enumerate(moving, 1):
        items.insert(at + offset - 1, item)
        item.pos = last.pos + step * offset
    return True


def fold_key(
    line: Line, index: int, counts: dict[tuple[int, int, str], int]
) -> tuple[int, str, int]:
    """The key under which a line folds with others: its stream, its shape and its k (counted
    in ``counts`` when the line carries none). A blank line (``index``: where it came) folds
    with nothing."""
    rank, fd, text = line[RANK], line[FD], line[TEXT]
    if not text.strip():
        return (fd, f"\0{index}", 0)
    shape = line_shape(text, rank)[0]
    if len(line) > K:
        return (fd, shape, line[K])
    count_key = (rank, fd, text.translate(NO_DIGITS))  # as ShapeCounter counts
    k = counts[count_key] = counts.get(count_key, -1) + 1
    return (fd, shape, k)


def _value(token: str) -> float:
    """A number's value; a clock time's in seconds (``18:18:04,929`` is logging's)."""
    if ":" in token:
        seconds = 0.0
        for part in token.split(":"):
            seconds = seconds * 60 + float(part.replace(",", "."))
        return seconds
    return float(token)


def rank_ranges(ranks: Sequence[int]) -> str:
    """Sorted ranks as runs: ``[0, 1, 2, 3, 5, 7]`` is ``"0-3,5,7"``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
