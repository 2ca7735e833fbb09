"""What a monitor is, and what it sees of a run: a leaf module, so no import circle forms here.

A monitor watches a run from the notebook's side (the hang watchdog, batch-size restarts,
debugger prompts; the list is :data:`nblaunch.engine.monitors.registry.MONITORS`). It sees every
event a rank sends and may end the run with a root cause. It sees the run through
:class:`RunContext` only, and reads time from the run's clock (``run.now()``), so its decisions can
be played back with a scripted clock.
"""

from __future__ import annotations

from typing import Any, Protocol

from nblaunch.engine.verdict import Outcome, RootCause
from nblaunch.events import Event, RunState


class RunContext(Protocol):
    """What a monitor may see of the run and do to it (:class:`nblaunch.engine.run.run.Run` is
    one)."""

    outcome: Outcome  # results, failures and finished ranks of the task so far
    task_ranks: list[int]  # the ranks running the task
    states: dict[int, RunState]  # each rank's badge

    def now(self) -> float:
        """The run's monotonic clock, in seconds."""
        ...

    def seconds_since_output(self, rank: int) -> float | None:
        """How long ago ``rank`` last wrote anything (C-level output too); None if never."""
        ...

    def set_state(self, rank: int, state: RunState, detail: str = "") -> None: ...

    def publish(self, event: Event) -> None:
        """Show an event (a diagnosis, a state) in the view."""

    def pause(self, key: object) -> None:
        """Stop the clocks (monitors, ``timeout=``) while ``key`` waits for the person."""

    def resume(self, key: object) -> None: ...

    def runs_here(self, rank: int) -> bool:
        """Whether ``rank`` is a process of this machine."""
        ...

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

    def ranks_ended(self) -> None:
        """This machine's ranks were stopped: let go of what served them (called again when
        the run closes, so it must be safe to call twice)."""
