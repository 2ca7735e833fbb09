"""Views of a run: ``TextView`` for terminals and scripts (``LaunchView`` for notebooks).

A view is an :class:`~nblaunch.events.EventSink`: the relay hands it every event, it keeps what it
needs and renders in ``flush`` (called many times a second) and ``close``. Views never infer the
state of a rank; they show the ``StateChange`` and ``Diagnosis`` events the launcher sends.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from nblaunch.events import Event, RunState

DISPLAY_MODES = ("auto", "widget", "text", "none")


class TextView:
    """Prints every event as ``[rank N]``-prefixed text; for terminals, scripts and logs.

    Output is batched and written at most ``max_rate`` times a second, so fast ranks cost few
    writes; a ``\\r`` progress line is printed at most once a second per rank.
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
        self._out: list[str] = []
        self._err: list[str] = []
        self._interval = 1.0 / max_rate
        self._last_flush = 0.0
        self._last_carriage: dict[int, float] = {}
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
            if event["carriage"]:
                now = time.monotonic()
                if now - self._last_carriage.get(rank, 0.0) < 1.0:
                    return
                self._last_carriage[rank] = now
            target = self._err if event["fd"] == 2 else self._out
            target.append(f"[rank {rank}] {event['text']}\n")
        elif kind == "log":
            self._err.append(f"[rank {event['rank']}] {event['level']} {event['message']}\n")
        elif kind == "progress":
            self._out.append(f"[rank {event['rank']}] {event['text']}\n")
        elif kind == "run_info":
            self.world_size = event["world_size"]
            line = (
                f"nblaunch: {event['world_size']} rank(s) on {event['device_kind']} "
                f"({event['start_method']}{', debug' if event['debug'] else ''})"
            )
            if event["run_dir"]:
                line += f", logs in {event['run_dir']}"
            self._out.append(line + "\n")
            self._out.extend(f"nblaunch: warning: {w}\n" for w in event["warnings"])
        elif kind == "state":
            if event["state"] in (RunState.STALLED, RunState.RETRYING) and event["detail"]:
                self._err.append(
                    f"[rank {event['rank']}] {event['state'].value}: {event['detail']}\n"
                )
        elif kind == "diagnosis":
            if event["severity"] != "error":  # errors are raised; the traceback shows them
                self._err.append(f"nblaunch: {event['title']}\n{event['body']}\n")
        elif kind == "run_ended":
            self._out.append(_summary_text(event["ok"], event["elapsed_s"], event["ranks"]))

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < self._interval:
            return
        self._last_flush = now
        if self._out:
            self.stdout.write("".join(self._out))
            self._out.clear()
            self.stdout.flush()
        if self._err:
            self.stderr.write("".join(self._err))
            self._err.clear()
            self.stderr.flush()

    def close(self) -> None:
        self.flush(force=True)


class NullView:
    """Shows nothing (``display="none"``); the per-rank log files are still written."""

    def handle(self, event: Event) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _summary_text(ok: bool, elapsed_s: float, ranks: dict[int, str]) -> str:
    lines = [f"nblaunch: {'finished' if ok else 'failed'} in {elapsed_s:.2f} s"]
    lines += [f"  rank {rank}: {outcome}" for rank, outcome in sorted(ranks.items())]
    return "\n".join(lines) + "\n"


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render), False in terminals and scripts."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def make_view(display: str):
    """The view for ``display``: "auto", "widget", "text" or "none"."""
    if display not in DISPLAY_MODES:
        from nblaunch.errors import LaunchError

        raise LaunchError(f"display={display!r} is not one of {', '.join(DISPLAY_MODES)}")
    if display == "none":
        return NullView()
    if display == "text" or (display == "auto" and not in_notebook_kernel()):
        return TextView()
    return TextView()  # LaunchView arrives with the live-view issue
