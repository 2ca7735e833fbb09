"""The engine's time, passed in rather than read, so its decisions can be played back.

Every judgement the engine and its monitors make ("nothing moved for N seconds", "the grace
after a secondary failure ran out", ``timeout=``) reads :meth:`Clock.now`, and every wait for
the ranks goes through :meth:`Clock.wait_s`. The real clock is ``time.monotonic`` and waits as
asked; a scripted clock (the tests' ``ScriptedClock``) jumps ahead by the wait instead, so a
scripted run that "hangs" for 300 s is judged in milliseconds.
"""

from __future__ import annotations

import time


class Clock:
    """Real time: ``time.monotonic`` seconds, and waits as long as asked."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        return time.monotonic()

    def wait_s(self, timeout: float) -> float:
        """How long a wait for the ranks' output may block, for a wait of ``timeout`` seconds."""
        return timeout


REAL_CLOCK = Clock()


# After a pause (a rank left the debugger), how long its peers get to move before the monitors
# judge again.
RESUME_GRACE_S = 3.0


class Pauses:
    """The run's clocks standing still while someone (a rank in the debugger) waits for the person.

    Its peers wait for it, which no monitor may take for a hang, and ``timeout=`` does not count
    the time. Keys are whoever stopped the clocks (``("debugger", rank)``).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._since: dict[object, float] = {}  # who stopped the clocks, since when
        self._paused_s = 0.0  # how long they stood still before, this task
        self._resumed_at = float("-inf")

    def pause(self, key: object) -> None:
        self._since.setdefault(key, self.clock.now())

    def resume(self, key: object) -> None:
        """Start the clocks again; monitors judge again ``RESUME_GRACE_S`` later."""
        since = self._since.pop(key, None)
        if since is not None:
            self._paused_s += self.clock.now() - since
            self._resumed_at = self.clock.now()

    def judging(self) -> bool:
        """Whether monitors may judge: nobody waits, and the grace after the last pause is over."""
        return not self._since and self.clock.now() - self._resumed_at >= RESUME_GRACE_S

    def paused_s(self) -> float:
        """How long the clocks stood still during this task, so far."""
        now = self.clock.now()
        return self._paused_s + (now - min(self._since.values()) if self._since else 0.0)

    def reset(self) -> None:
        """A new task: no pause so far (the grace after an earlier one still runs)."""
        self._since.clear()
        self._paused_s = 0.0
