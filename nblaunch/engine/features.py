"""The features that watch a run from the notebook's side, registered in one place.

A feature lives in a module of its own and may have two sides:

- in the ranks, task hooks it registers with :func:`nblaunch.rank.worker.add_task_hook` when it is
  imported (the modules in ``worker.RANK_FEATURES``, imported at set-up and preloaded in the
  forkserver);
- in the notebook, a *monitor*: it sees every event a rank sends and may end the run with a
  root cause (:class:`Monitor`); it sees the run through :class:`RunContext` only.

The engine (:mod:`nblaunch.engine.run`) makes the monitors listed here and names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from nblaunch.engine.batch_size import BatchSizeMonitor
from nblaunch.engine.debug_prompts import DebugPrompts
from nblaunch.engine.hang import HangMonitor
from nblaunch.engine.verdict import Outcome, RootCause
from nblaunch.events import Event, RunState

if TYPE_CHECKING:
    from nblaunch.engine.plan import LaunchPlan


class RunContext(Protocol):
    """What a monitor may see of the run and do to it (:class:`nblaunch.engine.run.Run` is one)."""

    outcome: Outcome  # results, failures and finished ranks of the task so far
    task_ranks: list[int]  # the ranks running the task
    states: dict[int, RunState]  # each rank's badge

    def set_state(self, rank: int, state: RunState, detail: str = "") -> None: ...

    def publish(self, event: Event) -> None:
        """Show an event (a diagnosis, a state) in the view."""

    def pause(self, key: object) -> None:
        """Stop the clocks (monitors, ``timeout=``) while ``key`` waits for the person."""

    def resume(self, key: object) -> None: ...

    def runs_here(self, rank: int) -> bool:
        """Whether ``rank`` is a process of this machine."""

    def send_to_rank(self, rank: int, message: dict[str, Any]) -> bool: ...

    def show_now(self) -> None:
        """Render the view at once."""


class Monitor(Protocol):
    """Watches a run from the parent (hang detection, out-of-memory restarts, debugger prompts)."""

    def on_event(self, run: RunContext, event: dict[str, Any]) -> None:
        """See every event a rank sends (heartbeats, failures, ...), before the engine acts."""

    def check(self, run: RunContext) -> RootCause | None:
        """Called about 20 times a second; return a root cause to stop the run, else None.

        A monitor's root cause carries the exception the caller gets (``exception``).
        """


# Each makes the monitor for one run from its plan.
MONITORS: tuple[Callable[[LaunchPlan], Monitor], ...] = (
    HangMonitor,
    BatchSizeMonitor,
    DebugPrompts,
)


def parent_monitors(plan: LaunchPlan) -> list[Monitor]:
    """Fresh monitors for a run (or for a restart: fresh processes, fresh observations)."""
    return [make(plan) for make in MONITORS]
