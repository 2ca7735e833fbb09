"""Debugging one rank from the notebook: ``breakpoint()``, post-mortem, prompts through the parent.

A rank has no terminal. Here its debugger (:class:`RankPdb`, the standard ``pdb``) talks to the
notebook instead: when it waits for a command it sends what it printed and its prompt up the
event pipe (a ``debug`` event), and reads the answer from its task pipe (``debug_input``). The
launcher asks the person with ``input()``, so the prompt appears where ``input()`` in a cell
would, labelled with the rank; under ``nblaunch run`` it is the terminal's. The notebook's side
is a monitor (:mod:`nblaunch.engine.monitors.debug_prompts`): while a rank waits in the debugger its
badge says DEBUGGING, the others' say they wait for it, and the run's clocks are paused: the
hang watchdog does not judge and ``timeout=`` does not count.
``q`` raises ``bdb.BdbQuit`` in the rank: the run ends with every rank stopped and "rank N quit
the debugger"; a pool's ranks keep their names (peers waiting in a collective are released,
:mod:`nblaunch.engine.pool.release`).

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

from nblaunch.errors import safe_str
from nblaunch.ranks import this_rank

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
        this_rank.emit(
            {"kind": "debug", "rank": this_rank.rank(), "output": output, "prompt": prompt}
        )
        answer = this_rank.receive()
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

    def _cmdloop(self) -> None:
        # pdb takes an interrupt for "cancel this command" and prompts again; here the
        # interrupt comes from the notebook's button, and nobody is at the prompt any more:
        # it stops the task at this line, as it would without the debugger.
        self.cmdloop()

    def interaction(self, frame: FrameType | None, tb: TracebackType | Any) -> None:
        try:
            super().interaction(frame, tb)
        finally:
            # The rank runs on: its badge goes back to RUNNING, the watchdog judges again.
            this_rank.emit(
                {"kind": "debug_end", "rank": this_rank.rank(), "output": self.channel.take()}
            )


def set_trace(frame: FrameType | None = None) -> None:
    """Stop in the debugger at ``frame`` (default: the caller's)."""
    frame = frame or sys._getframe(1)
    if this_rank.current() is None:  # in the notebook itself: the ordinary debugger
        pdb.Pdb().set_trace(frame)
        return
    RankPdb().set_trace(frame)


def breakpoint(rank: int | None = None) -> None:
    """Stop in the debugger here, on every rank or on ``rank`` only.

    In the notebook (outside any rank) it is Python's own ``breakpoint()``.
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    if rank is not None and this_rank.current() is not None and this_rank.rank() != rank:
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
            f"rank {this_rank.rank()} has no failure to debug: its last task did not fail"
        )
    post_mortem(_last_failure)


@contextlib.contextmanager
def _debugging(context: this_rank.RankContext) -> Iterator[None]:
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


this_rank.add_task_hook(_debugging)
