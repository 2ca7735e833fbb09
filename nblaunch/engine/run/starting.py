"""What a run's view says while its ranks' processes start, drawn while they do.

The first launch of a kernel right after ``%load_ext nblaunch`` waits seconds for the ranks'
process server (the forkserver) to import torch: the cell shows the run and what it waits for
at once instead of staying blank.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable

from nblaunch.events import EventSink

# Whether this process started ranks already: the first start waits for the ranks' process
# server (the forkserver) to import torch, which it began when nblaunch was imported.
_started_before = False
# How often the view is drawn while the ranks start (the engine's loop does not run yet).
STARTING_RENDER_S = 0.25


def starting_words(start_method: str) -> str:
    """What a rank's badge says while its process starts."""
    if start_method == "forkserver" and not _started_before:
        return "starting: the first launch waits for the ranks' process server to import torch"
    return "starting its process"


def shown_while(view: EventSink, start: Callable[[], None]) -> None:
    """Call ``start`` (the ranks' processes) while another thread draws ``view`` every
    ``STARTING_RENDER_S``: the cell shows the run and what it waits for at once, not a blank
    cell for the seconds the first launch of a kernel waits for torch to be imported.

    The thread runs in a copy of the caller's context, as a background run's does (ipykernel
    routes its output by a context variable to the cell that launched).
    """
    global _started_before
    done = threading.Event()
    context = contextvars.copy_context()

    def draw() -> None:
        while not done.wait(STARTING_RENDER_S):
            with contextlib.suppress(Exception):
                context.run(view.flush, True)

    thread = threading.Thread(target=draw, name="nblaunch-starting", daemon=True)
    thread.start()
    try:
        start()
        _started_before = True
    finally:
        done.set()
        thread.join()
