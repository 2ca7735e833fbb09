"""``TextView``: a run as ``[rank N]``-prefixed text, for terminals, scripts and logs.

It keeps no run model: every event becomes text at once, and the end of the run prints the
outcome the ``run_ended`` event carries.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import TextIO

from nblaunch.events import Event, RunState, after_restarts, checking_mode
from nblaunch.notebook.views.fold import fold_lines, rank_ranges
from nblaunch.notebook.views.model import Line
from nblaunch.options import DEFAULT_LINE_PREFIX, format_line_prefix

# Past this many ranks, the end of the run groups ranks by outcome.
SUMMARY_BY_RANK = 8


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
        # In arrival order: a rank's line ([rank, fd, text], folded with alike ones at flush)
        # or text of nblaunch's own (to stderr?, text).
        self._pending: list[Line | tuple[bool, str]] = []
        self._interval = 1.0 / max_rate
        self._last_flush = 0.0
        self._last_carriage: dict[int, float] = {}
        self._bars: set[tuple[int, int]] = set()  # (rank, fd) whose last line was a "\\r" one
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
            elif key in self._bars:
                self._bars.discard(key)
                if not event["text"].strip():
                    return  # the bar was cleared (tqdm's leave=False): nothing to keep
            self._pending.append([rank, event["fd"], event["text"]])
        elif kind == "log":
            self._pending.append([event["rank"], 2, f"{event['level']} {event['message']}"])
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
        pending = self._texts(self._pending)
        self._pending = []
        for to_stderr, texts in itertools.groupby(pending, key=lambda item: item[0]):
            stream = self.stderr if to_stderr else self.stdout
            stream.write("".join(text for _, text in texts))
            stream.flush()

    def close(self) -> None:
        self.flush(force=True)

    def _texts(self, pending: list[Line | tuple[bool, str]]) -> list[tuple[bool, str]]:
        """What to write, in order: ranks' lines prefixed, alike lines of several ranks folded
        into one (``[rank 0-7] epoch 0 step 40``; see ``fold.fold_lines``)."""
        out: list[tuple[bool, str]] = []
        lines: list[Line] = []  # ranks' lines since the last text of nblaunch's own
        for item in [*pending, (False, "")]:
            if isinstance(item, list):
                lines.append(item)
                continue
            out += [
                (fold.fd == 2, f"{self._prefix_of(fold.ranks)}{fold.text()}\n")
                for fold in fold_lines(lines, self.world_size)
            ]
            lines = []
            if item[1]:
                out.append(item)
        return out

    def _prefix_of(self, ranks: list[int]) -> str:
        """The prefix of a line that ``ranks`` printed alike: their ranges as ``${rank}``."""
        if len(ranks) == 1:
            return self.prefix(ranks[0])
        per_node = self._ranks_per_node
        local = rank_ranges(sorted({r % per_node for r in ranks})) if per_node else None
        return format_line_prefix(self._line_prefix, rank_ranges(ranks), local)


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
