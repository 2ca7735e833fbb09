"""The notebook's side of a rank's debugger: the person answers each prompt (see
:mod:`nblaunch.ranks.debugger`).

While a rank waits in the debugger its badge says DEBUGGING, the others' say they wait for it,
and the run's clocks are paused (``RunContext.pause``): the hang watchdog does not judge and
``timeout=`` does not count.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

from nblaunch.engine.monitors.protocol import RunContext
from nblaunch.events import RunState, diagnosis
from nblaunch.ranks.debugger import RankPdb


def ask(rank: int, output: str, prompt: str) -> str:
    """In the notebook: show what a rank's debugger printed and ask for its next command.

    ``input()`` reaches the notebook's prompt in a kernel and the terminal under ``nblaunch
    run``. Where nothing can answer (a kernel run without stdin, stdin closed), the rank goes on.
    """
    if output:
        sys.stdout.write(output if output.endswith("\n") else output + "\n")
        sys.stdout.flush()
    try:
        with interruptible():
            return input(f"[rank {rank}] {prompt or RankPdb.PROMPT}")
    except (EOFError, NotImplementedError):  # IPython's StdinNotImplementedError included
        print(f"[rank {rank}] nothing here can answer the debugger (no input); continuing")
        return "c"


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """The interrupt button raises ``KeyboardInterrupt`` here, while the person is asked.

    A pool counts interrupts during a task and acts on them between turns of its loop, which
    never come while ``input()`` waits: at a prompt the interrupt must land at once.
    """
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: no interrupt reaches it anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class DebugPrompts:
    """The notebook's side of ranks' debuggers (a
    :class:`nblaunch.engine.monitors.protocol.Monitor`): asks the person for each prompt and
    sends the answer down the rank's pipe; shows who waits."""

    def __init__(self, plan: Any) -> None:
        self.debugging: set[int] = set()  # ranks waiting in the debugger

    def on_event(self, run: RunContext, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "started" and self.debugging:  # a peer's own "started" read after its prompt
            run.set_state(event["rank"], RunState.RUNNING, self._waiting())
        elif kind == "debug":
            self._prompt(run, event)
        elif kind == "debug_end":
            self._left(run, event)

    def ranks_ended(self) -> None: ...  # nothing of the ranks' is held here

    def check(self, run: RunContext) -> None:
        return None

    def _prompt(self, run: RunContext, event: dict[str, Any]) -> None:
        rank = event["rank"]
        if not run.runs_here(rank):  # a rank on another node: its pipe is not ours
            run.publish(
                diagnosis(
                    f"breakpoint() on rank {rank} (another node) cannot be answered here",
                    "Debug ranks of this machine, or run the code on one node.",
                    "warning",
                    rank,
                )
            )
            return
        if rank not in self.debugging:
            self.debugging.add(rank)
            run.pause(("debugger", rank))
            run.set_state(rank, RunState.DEBUGGING, "waiting for your command (c continues)")
            self._say_waiting(run)
            run.show_now()  # the badges show before the prompt blocks this thread
        line = ask(rank, event["output"], event["prompt"])
        run.send_to_rank(rank, {"kind": "debug_input", "line": line})

    def _left(self, run: RunContext, event: dict[str, Any]) -> None:
        rank = event["rank"]
        if event.get("output"):
            print(event["output"], end="", flush=True)
        if rank in self.debugging:
            self.debugging.discard(rank)
            run.resume(("debugger", rank))
            run.set_state(rank, RunState.RUNNING)
            self._say_waiting(run)

    def _waiting(self) -> str:
        """What a rank not in the debugger does while another is (empty when none is)."""
        return f"waiting for rank {min(self.debugging)} (in the debugger)" if self.debugging else ""

    def _say_waiting(self, run: RunContext) -> None:
        """The other running ranks' badges: waiting for a rank in the debugger, or not.

        A rank still starting is counted too: a rank in its user code has joined the process
        group with all of them, and their own "started" may be read only after the prompt.
        """
        detail = self._waiting()
        for rank in run.task_ranks:
            state = run.states.get(rank)
            if state in (RunState.RUNNING, RunState.STARTING) and rank not in self.debugging:
                run.publish(
                    {"kind": "state", "rank": rank, "state": RunState.RUNNING, "detail": detail}
                )
