"""The features that watch a run from the notebook's side, registered in one place.

A feature may have two sides, each in its own package:

- in the ranks (:mod:`nblaunch.ranks`), task hooks it registers with
  :func:`nblaunch.ranks.this_rank.add_task_hook` when it is imported (the modules in
  ``nblaunch.ranks.worker.RANK_FEATURES``, imported at set-up and preloaded in the forkserver);
- in the notebook (:mod:`nblaunch.engine`), a *monitor*
  (:class:`~nblaunch.engine.monitors.protocol.Monitor`): it sees every event a rank sends and
  may end the run with a root cause; it sees the run through
  :class:`~nblaunch.engine.monitors.protocol.RunContext` only.

The engine (:mod:`nblaunch.engine.run.run`) makes the monitors listed here and names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nblaunch.engine.monitors.batch_size import BatchSizeMonitor
from nblaunch.engine.monitors.collective_checks import CollectiveChecks
from nblaunch.engine.monitors.debug_prompts import DebugPrompts
from nblaunch.engine.monitors.hang import HangMonitor
from nblaunch.engine.monitors.protocol import Monitor

if TYPE_CHECKING:
    from nblaunch.engine.plan.launch_plan import LaunchPlan


# Each makes the monitor for one run from its plan.
MONITORS: tuple[Callable[[LaunchPlan], Monitor], ...] = (
    HangMonitor,
    CollectiveChecks,
    BatchSizeMonitor,
    DebugPrompts,
)


def parent_monitors(plan: LaunchPlan) -> list[Monitor]:
    """Fresh monitors for a run (or for a restart: fresh processes, fresh observations)."""
    return [make(plan) for make in MONITORS]
