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
