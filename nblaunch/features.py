"""The features that watch a run from the notebook's side, registered in one place.

A feature lives in a module of its own and may have two sides:

- in the ranks, task hooks it registers with :func:`nblaunch.worker.add_task_hook` when it is
  imported (the modules in ``worker.RANK_FEATURES``, imported at set-up and preloaded in the
  forkserver);
- in the notebook, a *monitor*: it sees every event a rank sends and may end the run with a
  root cause (:class:`Monitor`).

The engine (:mod:`nblaunch.run`) makes the monitors listed here and names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from nblaunch.memory import BatchSizeMonitor
from nblaunch.verdict import RootCause
from nblaunch.watchdog import HangMonitor

if TYPE_CHECKING:
    from nblaunch.plan import LaunchPlan


class Monitor(Protocol):
    """Watches a run from the parent (hang detection, out-of-memory restarts)."""

    def on_event(self, run: Any, event: dict[str, Any]) -> None:
        """See every event a rank sends (heartbeats, failures, ...)."""

    def check(self, run: Any) -> RootCause | None:
        """Called about 20 times a second; return a root cause to stop the run, else None.

        A monitor's root cause carries the exception the caller gets (``exception``).
        """


# Each makes the monitor for one run from its plan.
MONITORS: tuple[Callable[[LaunchPlan], Monitor], ...] = (HangMonitor, BatchSizeMonitor)


def parent_monitors(plan: LaunchPlan) -> list[Monitor]:
    """Fresh monitors for a run (or for a restart: fresh processes, fresh observations)."""
    return [make(plan) for make in MONITORS]
