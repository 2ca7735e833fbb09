"""Debugging one rank from the notebook: ``breakpoint()``, post-mortem, prompts through the parent.

A rank has no terminal. Here its debugger (:class:`RankPdb`, the standard ``pdb``) talks to the
notebook instead: when it waits for a command it sends what it printed and its prompt up the
event pipe (a ``debug`` event), and reads the answer from its task pipe (``debug_input``). The
launcher asks the person with ``input()``, so the prompt appears where ``input()`` in a cell
would, labelled with the rank; under ``nblaunch run`` it is the terminal's. The notebook's side
is :class:`DebugPrompts`, a monitor (:mod:`nblaunch.features`): while a rank waits in the
debugger its badge says DEBUGGING, the others' say they wait for it, and the run's clocks are
paused (``Run.pause``): the hang watchdog does not judge and ``timeout=`` does not count.
``q`` raises ``bdb.BdbQuit`` in the rank: the run ends with every rank stopped and "rank N quit
the debugger".

In a rank ``breakpoint()`` stops there (``PYTHONBREAKPOINT=0`` still turns it off);
:func:`breakpoint` with ``rank=`` stops on that rank only. ``debug_on_error=True`` holds a failing
rank at its frame for a post-mortem before it reports the failure, and a pool rank keeps its
last failure for ``%dist debug`` (:func:`post_mortem_last`).
"""

from __future__ import annotations

import bdb
import contextlib
import io
import os
import pdb
import sys
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

from nblaunch import worker
from nblaunch.errors import safe_str
from nblaunch.events import RunState, diagnosis

# The setup option that asks for a post-mortem of a failing task before it is reported.
DEBUG_ON_ERROR_OPTION = "debug_on_error"
# The failure of the rank's last task, kept for a post-mortem (%dist debug in a pool).
_last_failure: BaseException | None = None


class _PromptChannel(io.TextIOBase):
    """pdb's stdin and stdout on a rank: output is collected and sent with each prompt."""

    def __init__(self) -> None:
        self._written: list[str] = []

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def take(self) -> str:
        """What was written since the last prompt."""
        text = "".join(self._written)
        self._written.clear()
        return text

    def readline(self, size: int | None = -1) -> str:
        text = self.take()
        output, prompt = text, ""
        if text.endswith(RankPdb.PROMPT):  # cmd.Cmd writes the prompt, then reads a line
            output, prompt = text[: -len(RankPdb.PROMPT)], RankPdb.PROMPT
        worker.emit({"kind": "debug", "rank": worker.rank(), "output": output, "prompt": prompt})
        answer = worker.receive()
        if answer.get("kind") != "debug_input":  # the parent went away or is stopping the run
            return "q\n"
        return answer["line"] + "\n"


class RankPdb(pdb.Pdb):
    """``pdb`` whose prompts go to the notebook; a ``debug_end`` event follows each stop."""

    PROMPT = "(Pdb) "

    def __init__(self) -> None:
        self.channel = _PromptChannel()
        super().__init__(stdin=self.channel, stdout=self.channel, nosigint=True)
        self.prompt = self.PROMPT

    def interaction(self, frame: FrameType | None, tb: TracebackType | Any) -> None:
        try:
            super().interaction(frame, tb)
        finally:
            # The rank runs on: its badge goes back to RUNNING, the watchdog judges again.
            worker.emit({"kind": "debug_end", "rank": worker.rank(), "output": self.channel.take()})


def ask(rank: int, output: str, prompt: str) -> str:
    """In the notebook: show what a rank's debugger printed and ask for its next command.

    ``input()`` reaches the notebook's prompt in a kernel and the terminal under ``nblaunch
    run``. Where nothing can answer (a kernel run without stdin, stdin closed), the rank goes on.
    """
    if output:
        sys.stdout.write(output if output.endswith("\n") else output + "\n")
        sys.stdout.flush()
    try:
        return input(f"[rank {rank}] {prompt or RankPdb.PROMPT}")
    except (EOFError, NotImplementedError):  # IPython's StdinNotImplementedError included
        print(f"[rank {rank}] nothing here can answer the debugger (no input); continuing")
        return "c"


class DebugPrompts:
    """The notebook's side of ranks' debuggers (a :class:`nblaunch.features.Monitor`): asks
    the person for each prompt and sends the answer down the rank's pipe; shows who waits."""

    def __init__(self, plan: Any) -> None:
        self.debugging: set[int] = set()  # ranks waiting in the debugger

    def on_event(self, run: Any, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "started" and self.debugging:  # a peer's own "started" read after its prompt
            run.set_state(event["rank"], RunState.RUNNING, self._waiting())
        elif kind == "debug":
            self._prompt(run, event)
        elif kind == "debug_end":
            self._left(run, event)

    def check(self, run: Any) -> None:
        return None

    def _prompt(self, run: Any, event: dict[str, Any]) -> None:
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

    def _left(self, run: Any, event: dict[str, Any]) -> None:
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

    def _say_waiting(self, run: Any) -> None:
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


def set_trace(frame: FrameType | None = None) -> None:
    """Stop in the debugger at ``frame`` (default: the caller's)."""
    frame = frame or sys._getframe(1)
    if worker.current() is None:  # in the notebook itself: the ordinary debugger
        pdb.Pdb().set_trace(frame)
        return
    RankPdb().set_trace(frame)


def breakpoint(rank: int | None = None) -> None:
    """Stop in the debugger here, on every rank or on ``rank`` only.

    In the notebook (outside any rank) it is Python's own ``breakpoint()``.
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    if rank is not None and worker.current() is not None and worker.rank() != rank:
        return
    set_trace(sys._getframe(1))


def _breakpointhook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` in a rank: ``breakpoint()`` talks to the notebook."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    set_trace(sys._getframe(1))


def post_mortem(exc: BaseException) -> None:
    """Open the debugger at the frame where ``exc`` was raised."""
    if exc.__traceback__ is None:
        return
    debugger = RankPdb()
    debugger.channel.write(f"post-mortem of {type(exc).__name__}: {safe_str(exc)}\n")
    debugger.reset()
    debugger.interaction(None, exc.__traceback__)


def forget_failure() -> None:
    """A new cell begins: the previous cell's failure is no longer what %dist debug opens."""
    global _last_failure
    _last_failure = None


def post_mortem_last() -> None:
    """On a pool rank: open the debugger at the frame of this rank's last failure.

    Raises
    ------
    LookupError
        This rank's last task did not fail.
    """
    if _last_failure is None:
        raise LookupError(
            f"rank {worker.rank()} has no failure to debug: its last task did not fail"
        )
    post_mortem(_last_failure)


@contextlib.contextmanager
def _debugging(context: worker.RankContext) -> Iterator[None]:
    """Around each task: ``breakpoint()`` reaches the notebook; a failure is kept (and
    debugged at once with ``debug_on_error``)."""
    global _last_failure
    previous = sys.breakpointhook
    sys.breakpointhook = _breakpointhook
    try:
        yield
    except (KeyboardInterrupt, bdb.BdbQuit):
        raise
    except BaseException as exc:
        _last_failure = exc
        if context.options.get(DEBUG_ON_ERROR_OPTION):
            with contextlib.suppress(bdb.BdbQuit):  # q: report the failure without more ado
                post_mortem(exc)
        raise
    finally:
        sys.breakpointhook = previous


worker.add_task_hook(_debugging)
