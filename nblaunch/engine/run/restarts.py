"""Whole-run restarts after a failure (``max_restarts=``), as torchrun's elastic agent does.

When a rank fails, dies or hangs and restarts are left, every rank is stopped and the whole run
starts again on fresh processes; the ranks read ``TORCHELASTIC_RESTART_COUNT`` to know the
attempt, so code that checkpoints resumes. :class:`Attempts` decides whether an ended attempt is
restarted and keeps why each one ended, for the view and for the exception raised when the
restarts are spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nblaunch import tracebacks
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import add_note
from nblaunch.events import Event, diagnosis

# Ends of an attempt that a restart may cure, as torchrun counts them: a worker that failed or
# died, and a hang (torchrun would wait for it forever). timeout= is the caller's own deadline,
# and a request for a restart (a batch-size search) restarts on its own.
RESTARTABLE = (Cause.FAILURE, Cause.DEATH, Cause.HANG)


@dataclass
class Attempts:
    """The attempts of one launch: at most ``max_restarts + 1``.

    Parameters
    ----------
    max_restarts
        How many times the whole run may start again after a failure.
    """

    max_restarts: int
    # Why each attempt that was restarted ended, in order ("rank 1 raised ValueError: boom").
    causes: list[str] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        """How many restarts happened (the ranks' ``TORCHELASTIC_RESTART_COUNT``)."""
        return len(self.causes)

    def due(self, root: RootCause | None) -> bool:
        """Whether an attempt that ended with ``root`` starts again."""
        return root is not None and root.cause in RESTARTABLE and self.restarts < self.max_restarts

    def record(self, root: RootCause) -> str:
        """Count a restart after ``root``; return the line the view shows for it."""
        # A hang's message is a whole sentence naming its ranks; the others name no rank yet.
        cause = root.message if root.cause is Cause.HANG else root.describe()
        self.causes.append(cause)
        attempt = self.restarts  # the attempt that just ended, from 1
        return (
            f"attempt {attempt} of {self.max_restarts + 1} ended: {self.causes[-1]}; "
            f"starting the run again (restart {attempt} of {self.max_restarts})"
        )

    def annotate(self, exc: BaseException) -> None:
        """Add why each earlier attempt ended to the exception of the last one."""
        if not self.causes:
            return
        total = self.max_restarts + 1
        for number, cause in enumerate(self.causes, start=1):
            add_note(exc, f"attempt {number} of {total} ended: {cause}")
        add_note(exc, f"attempt {total} of {total} ended as above: no restarts left")


def restart_notice(attempts: Attempts, root: RootCause) -> tuple[str, Event]:
    """Count a restart after ``root``: the line the ranks' states show, and the diagnosis the
    view shows for it (the failing rank's traceback from the user's frame on)."""
    message = attempts.record(root)
    body = tracebacks.without_launcher_text(root.traceback)
    return message, diagnosis(message, body, "warning", root.rank)
