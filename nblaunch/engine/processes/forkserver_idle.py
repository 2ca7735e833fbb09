"""What the forkserver imports while no launch waits on it: what ranks would import each time.

A rank's first optimizer imports ``torch._dynamo`` (torch.optim's constructor does): 1 s of CPU
in each rank of every training launch, unless the forkserver the rank is forked from has it.
Importing it before serving (a preload) made every first launch in a script wait 1 s longer,
and a launch soon after ``import nblaunch`` in a notebook too. So the forkserver imports it
piece by piece once it has been idle for :data:`QUIET_S`: a fork request waits at most for the
piece being imported (~0.3 s, and only if it comes in the middle of one), and ranks forked once
the pieces are in have them.

The forkserver is multiprocessing's (``multiprocessing.forkserver.main``): it imports its
preload modules, then waits for fork requests in ``selectors.DefaultSelector().select()``, with
one thread. Importing this module in its preload swaps that selector class for one that imports
the next piece when a wait of :data:`QUIET_S` ended with no request. Forks happen only between
``select()`` calls, so a rank is never forked during an import (which would leave the import's
locks held in the rank). Imported anywhere else, this module does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import sys
from typing import Any

# Each piece ≤ ~0.3 s to import (python -X importtime, torch 2.13, 2-core machine), in the order
# torch._dynamo imports them; FSDP and DTensor are what FSDP users' ranks import anyway.
IDLE_IMPORTS = (
    "mpmath",
    "sympy",
    "torch.fx.experimental.symbolic_shapes",
    "torch._inductor",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",
)
# No fork request for this long: the launch's ranks have all been forked (they are asked for
# one after another, a few ms apart).
QUIET_S = 0.3


def install(modules: tuple[str, ...] = IDLE_IMPORTS, quiet_s: float = QUIET_S) -> None:
    """Make this process's next ``selectors.DefaultSelector`` import ``modules``, one per quiet
    ``quiet_s`` of a ``select()`` without a timeout, in this process only (not in its forks)."""
    server = os.getpid()
    pending = list(modules)
    original = selectors.DefaultSelector

    class IdleImportingSelector(original):  # type: ignore[misc, valid-type]
        def select(self, timeout: float | None = None) -> list[Any]:
            while pending and timeout is None and os.getpid() == server:
                ready = super().select(quiet_s)
                if ready:
                    return ready
                # A piece that fails is left to whoever needs it.
                with contextlib.suppress(Exception):
                    importlib.import_module(pending.pop(0))
            if selectors.DefaultSelector is IdleImportingSelector:
                selectors.DefaultSelector = original  # ranks forked from now on see torch's own
            return super().select(timeout)

    selectors.DefaultSelector = IdleImportingSelector


def _imported_by_forkserver() -> bool:
    """Whether this import comes from ``multiprocessing.forkserver.main``'s preload."""
    from multiprocessing import forkserver

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _imported_by_forkserver():
    install()
