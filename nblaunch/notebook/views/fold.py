"""Alike lines of many ranks, folded into one: what "All ranks" shows.

Eight ranks running the same loop print every line eight times. A line that several ranks
print alike, within a short window of each other, is shown once with the ranks that printed
it: ``[0-7] epoch 0 step 40 lr 0.05``. Lines that differ only in their measurements (numbers
with a decimal point or an exponent, clock times) fold too, each one that differs shown as its
range: ``[0-7] loss 0.41 … 0.44``. Whole numbers must match: they count (steps, epochs,
batches), and ``step 20`` of some ranks is not ``step 40`` of others; but the printing rank's
own number may differ (``[0-63] hello from rank 0 … 63``), and so may every number of a tqdm
bar's state, left in the log where a print interrupted the bar (``[0-63] 30% … 33%|...``).
Pure functions of the kept lines: the exact lines stay one hover (the folded line's title) or
one rank away, and the rank logs on disk keep every byte.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from nblaunch.notebook.views.ansi import plain
from nblaunch.notebook.views.model import FD, RANK, TEXT, TQDM, Line

# A number as ranks print them: 40, -3, 0.4121, 1e-05.
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# A measurement, which may differ between lines that fold: 0.41, 1e-05, 00:07 (tqdm's clock).
MEASUREMENT = re.compile(r"\d+:\d\d(?::\d\d)?|-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")
# The numbers of a line, a clock time as one.
TOKEN = re.compile(f"{MEASUREMENT.pattern}|{NUMBER.pattern}")
# A progress bar's body: "|████▏     |".
BAR = re.compile(r"\|[^|]*\|")
# Runs of fewer ranks fold nothing: two or three ranks' lines read well apart, every number
# exact.
FOLD_FROM_RANKS = 4
# How far apart (in lines of "All ranks", per rank of the run) the copies of a line may come.
WINDOW_PER_RANK = 4


@dataclass
class Fold:
    """One line as "All ranks" shows it: the alike lines of one or more ranks."""

    first: int  # where its first line came, among the lines folded
    lines: list[Line] = field(default_factory=list)  # one per rank, in arrival order
    rank_set: set[int] = field(default_factory=set)

    @property
    def ranks(self) -> list[int]:
        return sorted(line[RANK] for line in self.lines)

    @property
    def fd(self) -> int:
        return self.lines[0][FD]

    def text(self) -> str:
        """The line, each measurement that differs between ranks shown as ``low … high``."""
        texts = [line[TEXT] for line in self.lines]
        if len(set(texts)) == 1:
            return texts[0]
        numbers = [TOKEN.findall(text) for text in texts]
        if len({len(found) for found in numbers}) > 1:  # a bar before and after its rate shows
            return texts[0]
        pieces = TOKEN.split(texts[0])
        out = [pieces[0]]
        for slot, piece in enumerate(pieces[1:]):
            values = [found[slot] for found in numbers]
            if len(set(values)) == 1:
                out.append(values[0])
            else:
                ordered = sorted(values, key=_value)
                out.append(f"{ordered[0]} … {ordered[-1]}")
            out.append(piece)
        return "".join(out)

    def exact(self) -> str:
        """The folded lines as the ranks printed them, ``[rank] text`` each."""
        return "\n".join(f"[{line[RANK]}] {line[TEXT]}" for line in self.lines)


def fold_lines(lines: Sequence[Line], world_size: int) -> list[Fold]:
    """``lines`` (in arrival order) folded: each line joins the latest fold of lines alike
    (the same stream, the same text but for its measurements) that its rank is not in yet, if
    that fold began at most ``WINDOW_PER_RANK * world_size`` lines before; otherwise it begins
    one. A run of fewer than ``FOLD_FROM_RANKS`` ranks folds nothing: a fold per line.
    """
    if world_size < FOLD_FROM_RANKS:
        return [Fold(index, [line], {line[RANK]}) for index, line in enumerate(lines)]
    window = WINDOW_PER_RANK * max(1, world_size)
    folds: list[Fold] = []
    latest: dict[tuple[int, str], Fold] = {}  # by each of its first line's keys
    for index, line in enumerate(lines):
        keys = fold_keys(line, index)
        for key in keys:
            fold = latest.get(key)
            if (
                fold is not None
                and line[RANK] not in fold.rank_set
                and index - fold.first <= window
            ):
                fold.lines.append(line)
                fold.rank_set.add(line[RANK])
                break
        else:
            fold = Fold(index, [line], {line[RANK]})
            folds.append(fold)
            latest.update(dict.fromkeys(keys, fold))
    return folds


def fold_keys(line: Line, index: int) -> tuple[tuple[int, str], ...]:
    """The keys under which a line folds with others, the closest first: its stream and its
    text but for its measurements, then the same with the printing rank's own number taken
    out too ("hello from rank 5"); a tqdm bar's state, but for every number and the bar. A
    blank line (``index``: where it came) folds with nothing."""
    text, fd = line[TEXT], line[FD]
    if not text.strip():
        return ((fd, f"\0{index}"),)
    if TQDM.search(plain(text)):
        return ((fd, NUMBER.sub("#", BAR.sub("|#|", text))),)
    measured = MEASUREMENT.sub("#", text)
    return (fd, measured), (fd, _own_number(line[RANK]).sub("#rank", measured, count=1))


@functools.lru_cache(maxsize=1024)
def _own_number(rank: int) -> re.Pattern[str]:
    """The rank's number standing alone in a line ("rank 5", not 15, 50 or 0.5)."""
    return re.compile(rf"(?<![\d.]){rank}(?![\d.])")


def _value(token: str) -> float:
    """A number's value; a clock time's in seconds."""
    if ":" in token:
        seconds = 0.0
        for part in token.split(":"):
            seconds = seconds * 60 + int(part)
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
