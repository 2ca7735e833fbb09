"""What a task's outcome means for the caller: its values, or the one exception to raise.

Pure functions over plain data. The engine collects an :class:`Outcome` (results by rank, every
failure as a typed :class:`RootCause`, the root cause once one is known); :func:`values` and
:func:`exception_for` turn it into what the caller gets, with no process, pipe or view involved,
so every rule (primary before secondary, debug mode's verdict raised everywhere, ``sys.exit``
never ending the caller) is tested on its own (``tests/test_verdict.py``).
"""

from __future__ import annotations

import enum
import pickle
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nblaunch import errors, tracebacks
from nblaunch.errors import LaunchError, LaunchTimeoutError, RankFailedError, add_note
from nblaunch.events import Diagnosis, Event, Failure, diagnosis

# How long a secondary failure ("connection reset by peer") waits for the primary one to show.
SECONDARY_GRACE_S = 3.0
# How long the other ranks' DistributedOperationException is waited for after the first one's.
VERDICT_WAIT_S = 1.0


class Cause(str, enum.Enum):
    """Why a task ended without every rank's value."""

    FAILURE = "failure"  # a rank raised
    DEATH = "death"  # a rank's process ended without reporting
    HANG = "hang"  # no progress in collectives (the hang watchdog)
    TIMEOUT = "timeout"  # timeout= ran out
    RESTART = "restart"  # every rank must start again (a peer's out-of-memory left them blocked)
    BATCH_SIZE = "batch_size"  # the batch-size search cannot go on (out of memory at every size)
    NODE = "node"  # another machine of a multi-node run was lost
    MISMATCH = "mismatch"  # ranks called different collectives (the out-of-band checks)


@dataclass
class RootCause:
    """One failure seen during a task; the first primary one becomes the task's root cause."""

    cause: Cause
    rank: int
    message: str
    # It looks like the echo of a peer's failure, not a cause of its own.
    secondary: bool = False
    # A monitor's diagnosis brings the exception the caller gets and a title for the view.
    exception: BaseException | None = None
    title: str = ""
    # A rank's own exception (Cause.FAILURE), as its Failure record described it.
    exc_type: str = ""
    traceback: str = ""
    exception_bytes: bytes | None = None
    where: str = ""
    received_at: float = float("-inf")  # the run's clock, in the parent
    # A process that ended (Cause.DEATH).
    exitcode: int | None = None
    signal: int | None = None
    # Cause.RESTART: setup options for the fresh ranks, and the progress record to show.
    options: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] | None = None

    @classmethod
    def from_failure(cls, event: Failure, received_at: float) -> RootCause:
        """A rank's Failure record, classified as primary or secondary."""
        return cls(
            Cause.FAILURE,
            event["rank"],
            event["message"],
            secondary=errors.is_secondary_failure(event["exc_type"], event["message"]),
            exc_type=event["exc_type"],
            traceback=event["traceback"],
            exception_bytes=event["exception_bytes"],
            where=event.get("where", ""),
            received_at=received_at,
        )

    @classmethod
    def death(cls, rank: int, exitcode: int | None, after_return: bool = False) -> RootCause:
        """A rank process that ended without reporting (a crash, a kill, ``os._exit``), or,
        ``after_return``, one that returned and then ended while its peers still ran."""
        words, signum = errors.describe_exit(exitcode)
        if after_return:
            words = (
                f"{words.replace(' without raising a Python exception', '')} after it "
                "returned, while the other ranks still ran (they may wait for it in a "
                "collective)"
            )
        return cls(Cause.DEATH, rank, words, exitcode=exitcode, signal=signum)

    @property
    def is_verdict(self) -> bool:
        """Debug mode's DistributedOperationException: every rank raises it together."""
        return self.cause is Cause.FAILURE and self.exc_type.endswith(
            ".DistributedOperationException"
        )

    def describe(self) -> str:
        """One line: "rank 1 raised ValueError: boom", "rank 1 was killed by SIGKILL", ..."""
        if self.cause is Cause.FAILURE:
            first_line = (self.message.splitlines() or [""])[0]  # reports can be tables
            text = f"rank {self.rank} raised {short_type(self.exc_type)}: {first_line}"
            if self.secondary:
                text += " (a consequence of a peer's failure)"
            return text
        return f"rank {self.rank} {self.message}"

    def outcome_words(self) -> str:
        """How the rank ended, for the run's summary."""
        if self.cause is Cause.FAILURE:
            first_line = (self.message.splitlines() or [""])[0]
            return f"{short_type(self.exc_type)}: {first_line}"
        return self.message


@dataclass
class Outcome:
    """What a task collected; :func:`values` or :func:`exception_for` says what it means."""

    results: dict[int, bytes] = field(default_factory=dict)
    failures: list[RootCause] = field(default_factory=list)  # raised and died, in arrival order
    finished: set[int] = field(default_factory=set)
    root: RootCause | None = None
    # A library's batch-size finder caught an out-of-memory error on these ranks and retried
    # them alone (their latest ``Progress`` of it: ``nblaunch.ranks.memory.caught_oom``).
    caught_oom: dict[int, dict[str, Any]] = field(default_factory=dict)

    def primaries(self) -> list[RootCause]:
        return [f for f in self.failures if not f.secondary]

    def deaths(self) -> list[RootCause]:
        return [f for f in self.failures if f.cause is Cause.DEATH]


@dataclass(frozen=True)
class Context:
    """What the verdict needs to know about the run besides its outcome."""

    world_size: int
    task_ranks: tuple[int, ...]
    debug: bool = False
    run_dir: Path | None = None
    # The last lines each rank printed (shown with a death).
    tails: dict[int, Iterable[str]] = field(default_factory=dict)


# The signals a stop sends: a rank that ended by another one crashed on its own.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


def crashed_while_stopped(
    exits: dict[int, int | None], settled: set[int], tails: dict[int, Any]
) -> list[RootCause]:
    """The ranks being stopped that crashed on their own (gloo aborting with SIGABRT after a
    mismatch, a segmentation fault), as deaths with their last line of output, so that they are
    shown as they ended and not as stopped. ``exits``: each rank's exit code (negative: the
    signal); ``settled``: ranks whose end is known already."""
    found = []
    for rank, code in sorted(exits.items()):
        if code is None or code >= 0 or -code in STOP_SIGNALS or rank in settled:
            continue
        death = RootCause.death(rank, code)
        tail = [line for line in tails.get(rank, ()) if line.strip()]
        if tail:
            death.message += f"; its last output: {tail[-1].strip()[:200]}"
        found.append(death)
    return found


def settle(outcome: Outcome, task_ranks: Iterable[int], now: float) -> RootCause | None:
    """The task's root cause once it can be named, or None while it is worth waiting.

    The first primary failure wins at once, except debug mode's verdict: every rank raises it
    together, so it waits up to ``VERDICT_WAIT_S`` for every task rank's, and the report can say
    it was raised everywhere. A failure that only looks like the echo of a peer's (secondary)
    wins when no primary one arrived within ``SECONDARY_GRACE_S`` of it. ``now`` is
    the run's clock, the clock of ``RootCause.received_at``.
    """
    primaries = outcome.primaries()
    if primaries:
        first = primaries[0]
        everyone = {f.rank for f in outcome.failures} >= set(task_ranks)
        if not first.is_verdict or everyone or now - first.received_at >= VERDICT_WAIT_S:
            return first
        return None
    if outcome.failures and now - outcome.failures[0].received_at > SECONDARY_GRACE_S:
        return outcome.failures[0]
    return None


def values(outcome: Outcome, task_ranks: Iterable[int]) -> list[Any]:
    """Every task rank's return value, in rank order.

    Raises
    ------
    LaunchError
        A value that cannot be unpickled in this process (a class only the ranks know).
    """
    import cloudpickle

    found = []
    for rank in task_ranks:
        try:
            found.append(cloudpickle.loads(outcome.results[rank]))
        except Exception as exc:
            raise LaunchError(
                f"rank {rank}'s return value cannot be unpickled here: {type(exc).__name__}: {exc}"
            ) from None
    return found


def exception_for(
    root: RootCause, outcome: Outcome, context: Context
) -> tuple[BaseException, Diagnosis | None]:
    """The exception the caller gets for ``root``, and the diagnosis the view shows (none for
    a timeout).

    The exception is the failing rank's own (its type, message and traceback), or the
    monitor's diagnosis, with a note naming the rank, the other ranks' failures and, when the
    failure happened in a collective without debug mode, the way to check collectives.
    """
    n = context.world_size
    rank = root.rank
    others = [f.describe() for f in outcome.failures if f is not root and f.rank != rank]
    if root.exception is not None:  # a monitor's diagnosis (e.g. a hang) brings its own
        exc = root.exception
        title = root.title or str(exc).splitlines()[0]
        cause = out_of_memory_first(root, outcome, n)
        if cause:
            rank, title = min(outcome.caught_oom), cause.split(":")[0]
            exc.args = (f"{cause}\n\n{exc.args[0] if exc.args else ''}", *exc.args[1:])
        else:
            hint = debug_hint(root, exc, context.debug)
            if hint:
                add_note(exc, hint)
        return exc, diagnosis(title, str(exc), "error", rank, others)
    if root.cause is Cause.TIMEOUT:  # the view says it with the ranks' badges
        return LaunchTimeoutError(root.message, rank=rank, world_size=n), None
    if root.cause is Cause.DEATH:
        message = f"rank {rank} of {n} {root.message}."
        if context.run_dir is not None:
            message += f" Its full output is in {context.run_dir / f'rank{rank}.log'}."
        tail = "\n".join(context.tails.get(rank, ()))
        if tail:
            message += f"\nIts last output:\n{_indent(tail)}"
        exc = RankFailedError(
            message, rank=rank, world_size=n, exitcode=root.exitcode, signal=root.signal
        )
    elif root.exc_type == "bdb.BdbQuit":  # the person ended the run from the debugger
        exc = RankFailedError(
            f"rank {rank} of {n} quit the debugger (q); the run was stopped on every rank",
            rank=rank,
            world_size=n,
        )
        return exc, diagnosis(str(exc), str(exc), "error", rank)
    else:
        exc = recreate_exception(root, n)
    if isinstance(exc, SystemExit):  # never ends the caller's script or kernel
        exc = exit_failure(exc, rank, n)
    note = f"raised on rank {rank} of {n}"
    alike = same_failure_everywhere(root, outcome, context.task_ranks)
    if alike:
        # Debug mode's verdict, reached by every rank together: no rank is the culprit.
        note = f"raised on every rank ({len(alike)} of {n}), with the same message"
        said = {f.describe() for f in alike}
        others = [line for line in others if line not in said]
    elif root.secondary:
        note += " (it looks like a consequence of a peer's failure; no other cause was seen)"
    if others:
        note += "\nOther ranks:\n" + "\n".join(f"  {line}" for line in others)
    hint = debug_hint(root, exc, context.debug)
    if hint:
        note += f"\n{hint}"
    add_note(exc, note)
    title = f"rank {rank} of {n} failed: {root.describe()}"
    body = tracebacks.without_launcher_text(root.traceback) or root.message  # the user's frames
    return exc, diagnosis(title, body, "error", rank, others)


def out_of_memory_first(root: RootCause, outcome: Outcome, world_size: int) -> str:
    """The cause to name first when ranks parted ways (a mismatch, a hang) after a library's
    batch-size finder caught an out-of-memory error on some of them and retried those alone;
    "" otherwise. Its first line, up to the colon, is the view's title."""
    if root.cause not in (Cause.MISMATCH, Cause.HANG) or not outcome.caught_oom:
        return ""
    ranks = sorted(outcome.caught_oom)
    first = outcome.caught_oom[ranks[0]].get("data") or {}
    sizes = [size for size in first.get("sizes") or [] if isinstance(size, int)]
    at = f" at batch_size={sizes[0]}" if sizes else ""
    again = f" (out of memory again at {', '.join(map(str, sizes[1:]))})" if sizes[1:] else ""
    finder = first.get("finder") or "a batch-size finder"
    who = " and ".join(f"rank {r}" for r in ranks)
    others = [r for r in range(world_size) if r not in outcome.caught_oom]
    went_on = " and ".join(f"rank {r}" for r in others) or "the others"
    return (
        f"{who} of {world_size} ran out of memory{at}: {finder} caught it and retried "
        f"{'that rank' if len(ranks) == 1 else 'those ranks'} alone with a smaller batch"
        f"{again} while {went_on} went on at the old size, so the ranks' collectives parted "
        f"ways (the report below). Out of memory: {first.get('error', '')}\n"
        "Fix: use nblaunch's find_executable_batch_size (`from nblaunch import "
        "find_executable_batch_size`, the same decorator): every rank agrees on each attempt, "
        "so all of them retry together at the same smaller batch size."
    )


def same_failure_everywhere(
    root: RootCause, outcome: Outcome, task_ranks: Iterable[int]
) -> list[RootCause]:
    """Every task rank's failure when all raised debug mode's verdict, the root's; else []."""
    if not root.is_verdict:
        return []
    alike = {
        f.rank: f
        for f in outcome.failures
        if f.cause is Cause.FAILURE and (f.exc_type, f.message) == (root.exc_type, root.message)
    }
    ranks = list(task_ranks)
    return [alike[r] for r in ranks] if set(alike) == set(ranks) else []


def debug_hint(root: RootCause, exc: BaseException, debug: bool) -> str:
    """Suggest debug mode when a run without it failed or stalled inside a collective."""
    if debug or getattr(exc, "debug_adds_nothing", False):  # (a rank returned early: hang.py)
        return ""
    text = f"{root.traceback}\n{root.message}\n{errors.safe_str(exc)}"
    if root.cause is not Cause.HANG and not failed_in_collective(text):
        return ""
    return (
        "This happened inside a torch.distributed collective: run with debug=True "
        "(%%distributed --debug, or NBLAUNCH_DEBUG=1) to check that every rank passes "
        "the same shapes, dtypes and devices to each collective."
    )


# A traceback frame inside one of torch.distributed's collectives (not its set-up calls).
_COLLECTIVE_FRAME = re.compile(
    r'distributed_c10d\.py", line \d+, in (all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*'
    r"|reduce|gather\w*|scatter\w*|all_to_all\w*|barrier|monitored_barrier|send|recv|isend|irecv"
    r"|batch_isend_irecv)\b"
)


# gloo's abort when a rank receives more than its collective expects. torch 2.9's gloo adds "Is
# there a distributed collective mismatch in your code?"; torch 2.8's says only this.
_GLOO_SIZE_MISMATCH = "op.preamble.length <= op.nbytes"


def failed_in_collective(text: str) -> bool:
    """True when a failure's traceback or message shows it happened in a collective: a frame of
    a torch.distributed collective, or gloo/NCCL saying the collectives did not match."""
    return (
        bool(_COLLECTIVE_FRAME.search(text))
        or "collective mismatch" in text.lower()
        or _GLOO_SIZE_MISMATCH in text
    )


def recreate_exception(failure: RootCause, world_size: int) -> BaseException:
    """Unpickle the rank's own exception; fall back to ``RankFailedError`` with its traceback."""
    rank = failure.rank
    if failure.exception_bytes:
        try:
            from tblib import pickling_support  # noqa: F401  (registers the unpicklers)

            exc = pickle.loads(failure.exception_bytes)
            if isinstance(exc, BaseException):
                return tracebacks.make_readable(exc, failure.traceback)
        except Exception:
            pass
    return RankFailedError(
        f"rank {rank} of {world_size} raised {failure.exc_type}: {failure.message}\n\n"
        f"Remote traceback:\n{failure.traceback}",
        rank=rank,
        world_size=world_size,
        remote_traceback=failure.traceback,
    )


def exit_failure(exit_: SystemExit, rank: int, world_size: int) -> RankFailedError:
    """``sys.exit(code)`` with a failing code on a rank, as the caller's error."""
    # The code as the rank passed it (an unpickled SystemExit keeps only its args).
    code = exit_.args[0] if len(exit_.args) == 1 else (exit_.args or None)
    return RankFailedError(
        f"rank {rank} of {world_size} called sys.exit({code!r})",
        rank=rank,
        world_size=world_size,
        exitcode=code if isinstance(code, int) else 1,  # Python exits 1 for a message
    )


def short_type(qualified: str) -> str:
    return qualified.removeprefix("builtins.")


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def timed_out(outcome: Outcome, world_size: int, timeout: float | None) -> RootCause:
    """The root cause when ``timeout=`` ran out: it names the ranks still running."""
    running = sorted(r for r in range(world_size) if r not in outcome.finished)
    names = ", ".join(str(r) for r in running)
    return RootCause(
        Cause.TIMEOUT,
        running[0] if running else 0,
        f"timeout={timeout:g} s ran out with rank(s) {names} of {world_size} still running; "
        "they were stopped",
    )


def stop_reason(root: RootCause | None, timeout: float | None) -> str:
    """Why the ranks still running are being stopped, for their badges."""
    if root is None:
        return "stopped"
    if root.cause is Cause.HANG:
        return "stopped: the ranks could not make progress (see the error)"
    if root.cause is Cause.TIMEOUT:
        return f"stopped: timeout={timeout:g} s ran out"
    if root.cause is Cause.MISMATCH:
        return "stopped: the ranks called mismatched collectives (see the error)"
    return f"stopped after rank {root.rank} failed"


def run_ended(
    outcome: Outcome, task_ranks: Iterable[int], ok: bool, elapsed_s: float, restarts: int = 0
) -> Event:
    """The ``run_ended`` event: whether the run went well, each task rank's outcome, and how
    often the run started again (``max_restarts=``), when it did."""
    outcomes: dict[int, str] = {}
    for rank in task_ranks:
        if rank in outcome.results:
            outcomes[rank] = "returned"
        else:
            failure = next((f for f in outcome.failures if f.rank == rank), None)
            outcomes[rank] = "stopped" if failure is None else failure.outcome_words()
    ended: Event = {"kind": "run_ended", "ok": ok, "elapsed_s": elapsed_s, "ranks": outcomes}
    if restarts:
        ended["restarts"] = restarts
    return ended
