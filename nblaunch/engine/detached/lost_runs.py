"""What the view of a lost run shows: its host ended without leaving the outcome.

The rank logs on disk still hold what the ranks printed; this builds the events a view draws
from them (the header, each rank's last lines, why the run is lost, its end).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from nblaunch.engine.detached.host_files import HOST_LOG, LAUNCH_FILE, RESULT_FILE
from nblaunch.events import Event, diagnosis
from nblaunch.options import view_lines_from_env

if TYPE_CHECKING:
    from nblaunch.engine.detached.registry import Entry


def lost_why(entry: Entry) -> str:
    """Why a run is lost, in words: its host ended without leaving the outcome."""
    return (
        f"the run host (pid {entry.pid}) ended without saying how the run ended: it was killed "
        f"(or crashed, or could not write {RESULT_FILE} and no notebook attached while it kept "
        f"the outcome); the ranks' values are gone. What they printed is in the rank logs in "
        f"{entry.run_dir}; the host's own log is {entry.run_dir / HOST_LOG}"
    )


def lost_run_events(entry: Entry, with_logs: bool) -> list[Event]:
    """What a view of a lost run shows: (``with_logs``: its header and the last lines of each
    rank log, when nothing else was kept), why it is lost, and its end."""
    events: list[Event] = []
    if with_logs:
        try:
            plan = pickle.loads((entry.run_dir / LAUNCH_FILE).read_bytes())["plan"]
            events.append(plan.run_info(entry.started_at))
        except Exception:  # the launch file is gone or unreadable: the header is not needed
            pass
        keep = view_lines_from_env()
        for rank in range(entry.world_size):
            for line in _tail(entry.run_dir / f"rank{rank}.log", keep):
                events.append(
                    {"kind": "stream", "rank": rank, "fd": 1, "text": line, "carriage": False}
                )
    host_log = _tail(entry.run_dir / HOST_LOG, 8)
    body = lost_why(entry) + "."
    if host_log:
        body += "\nThe end of host.log:\n" + "\n".join(host_log)
    title = "the run is lost: its host ended without an outcome"
    events.append(diagnosis(title, body, "warning", None))
    ranks = dict.fromkeys(range(entry.world_size), "lost with its host")
    last_write = entry.started_at  # the run lasted at least until its logs were last written
    for rank in range(entry.world_size):
        with contextlib.suppress(OSError):
            last_write = max(last_write, (entry.run_dir / f"rank{rank}.log").stat().st_mtime)
    elapsed = last_write - entry.started_at
    events.append({"kind": "run_ended", "ok": False, "elapsed_s": elapsed, "ranks": ranks})
    return events


def _tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of a file (its last 256 KiB at most); none when unreadable."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - (256 << 10)))
            text = file.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
