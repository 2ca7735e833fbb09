"""``RecordingView``: a view that keeps every event, for tests and code that inspects a run."""

from __future__ import annotations

from nblaunch.events import Event


class RecordingView:
    """Keeps every event it is given, in order: a view for tests and for code that inspects a run.

    ``notebook_launcher``'s views are chosen by ``display=``; pass this one to
    ``nblaunch.engine.run.run.Run(plan, RecordingView())`` to see exactly what a view would have
    shown.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def flush(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[Event]:
        """The events of one kind (``"stream"``, ``"log"``, ``"state"``, ...)."""
        return [event for event in self.events if event["kind"] == kind]
