"""``TextView``: a run as ``[rank N]``-prefixed text, for terminals, scripts and logs.

It keeps no run model: every event becomes text at once, and the end of the run prints the
outcome the ``run_ended`` event carries.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import TextIO

from nblaunch.events import Event, RunState, checking_mode


class TextView:
    """Prints every event as ``[rank N]``-prefixed text; for terminals, scripts and logs.

    Output is batched and written at most ``max_rate`` times a second, so fast ranks cost few
    writes; a ``\\r`` progress line is printed at most once a second per rank, and its last state
    once, when the line ends (a bar that was cleared leaves nothing). Ranks' stderr,
    logs and nblaunch's notes go to stderr, the rest to stdout, in the order they happened.
    """

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        *,
        max_rate: float = 20.0,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._pending: list[tuple[bool, str]] = []  # (to stderr?, text), in arrival order
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
            self._pending.append((event["fd"] == 2, f"[rank {rank}] {event['text']}\n"))
        elif kind == "log":
            self._pending.append(
                (True, f"[rank {event['rank']}] {event['level']} {event['message']}\n")
            )
        elif kind == "progress":
            self._pending.append((False, f"[rank {event['rank']}] {event['text']}\n"))
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
                self._pending.append(
                    (True, f"[rank {event['rank']}] {event['state'].value}: {event['detail']}\n")
                )
        elif kind == "diagnosis":
            if event["severity"] != "error":  # errors are raised; the traceback shows them
                self._pending.append((True, f"nblaunch: {event['title']}\n{event['body']}\n"))
        elif kind == "run_ended":
            summary = _summary_text(event["ok"], event["elapsed_s"], event["ranks"])
            self._pending.append((False, summary))

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < self._interval:
            return
        self._last_flush = now
        pending, self._pending = self._pending, []
        for to_stderr, texts in itertools.groupby(pending, key=lambda item: item[0]):
            stream = self.stderr if to_stderr else self.stdout
            stream.write("".join(text for _, text in texts))
            stream.flush()

    def close(self) -> None:
        self.flush(force=True)


def _summary_text(ok: bool, elapsed_s: float, ranks: dict[int, str]) -> str:
    lines = [f"nblaunch: {'finished' if ok else 'failed'} in {elapsed_s:.2f} s"]
    lines += [f"  rank {rank}: {outcome}" for rank, outcome in sorted(ranks.items())]
    return "\n".join(lines) + "\n"
