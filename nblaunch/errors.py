"""Exceptions raised by nblaunch.

When a rank raises, the caller gets *that* exception, re-created in the parent with the remote
traceback attached and a note naming the rank; the classes below are for everything else::

    NblaunchError
    ├── LaunchError                     nothing started: bad arguments, unpicklable payload,
    │   │                               busy port, devices held by a pool
    │   └── RendezvousTimeoutError      multi-node: not every node joined in time
    ├── RankFailedError                 a rank died without a Python exception (signal, exit
    │   │                               code), or its exception could not be re-created
    │   └── LaunchTimeoutError          ``timeout=`` ran out with ranks still running
    ├── DistributedHangError            ranks sat in collectives that could never complete
    ├── RunStoppedError                 a background or detached run was stopped (Stop
    │                                   button, RunHandle.stop(), ``nblaunch runs stop``)
    ├── PoolRestartedError              a pool's cell ended with ranks that could not be
    │                                   stopped: fresh ranks, the names are gone
    ├── NoExecutableBatchSizeError      find_executable_batch_size ran out of memory at every
    │                                   batch size down to 1 (also a RuntimeError)
    └── DistributedOperationException   debug mode: ranks called a collective with mismatched
                                        shapes, dtypes, devices, or different operations
"""

from __future__ import annotations

import re
import signal as _signal


class NblaunchError(Exception):
    """Base class of every error nblaunch raises itself."""


class LaunchError(NblaunchError):
    """The launch was refused before any process started.

    The message names what is wrong and how to fix it; nothing ran and nothing was lost.
    """


class AuthenticationError(LaunchError):
    """A multi-node run read something from its store that was not written with the run's
    secret: another client writes to the store, or a node was given another secret."""


class RendezvousTimeoutError(LaunchError, TimeoutError):
    """A multi-node run: not every node joined the rendezvous within ``rdzv_timeout``.

    Start ``python -m nblaunch join ENDPOINT --run-id RUN`` (the command the notebook printed)
    on each missing node, check that those nodes can reach the endpoint, or launch with fewer
    nodes. Nothing ran.

    Attributes
    ----------
    endpoint : str
        The rendezvous endpoint, ``host:port``.
    joined, expected : int
        How many nodes joined (this one included), out of how many.
    """

    def __init__(self, message: str, *, endpoint: str, joined: int, expected: int) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.joined = joined
        self.expected = expected

    def __reduce__(self):
        return (
            _rebuild_rendezvous_timeout,
            (str(self), self.endpoint, self.joined, self.expected),
        )


def _rebuild_rendezvous_timeout(message, endpoint, joined, expected):
    return RendezvousTimeoutError(message, endpoint=endpoint, joined=joined, expected=expected)


class RankFailedError(NblaunchError):
    """A rank ended without an exception that could be shown as it was raised.

    Happens when a rank is killed by a signal (segfault, out-of-memory killer, ``kill -9``),
    calls ``os._exit``, or raises an exception the parent cannot re-create.

    Attributes
    ----------
    rank, world_size : int
        Which rank failed, out of how many.
    exitcode : int or None
        The process exit code, when it exited.
    signal : int or None
        The signal number that killed it, when one did.
    remote_traceback : str
        The rank's own traceback text, when it had one.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world_size: int,
        exitcode: int | None = None,
        signal: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exitcode = exitcode
        self.signal = signal
        self.remote_traceback = remote_traceback

    def __reduce__(self):  # keep the keyword-only context through pickling
        return (
            _rebuild_rank_failed,
            (
                str(self),
                self.rank,
                self.world_size,
                self.exitcode,
                self.signal,
                self.remote_traceback,
            ),
        )


def _rebuild_rank_failed(message, rank, world_size, exitcode, signal, remote_traceback):
    return RankFailedError(
        message,
        rank=rank,
        world_size=world_size,
        exitcode=exitcode,
        signal=signal,
        remote_traceback=remote_traceback,
    )


class LaunchTimeoutError(RankFailedError, TimeoutError):
    """``timeout=`` ran out; the ranks named in the message were still running and were stopped.

    ``rank`` is the lowest rank that was still running.
    """


class DistributedHangError(NblaunchError):
    """Ranks waited in collectives that could never complete, so the launcher stopped them.

    Typical causes: ranks left a loop at different steps (use ``set_trigger``/``check_trigger``),
    called different collectives, or one rank is stuck outside any collective. The message holds
    every rank's position and stack; ``stacks`` maps rank to stack text.
    """

    def __init__(self, message: str, *, stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.stacks = dict(stacks or {})

    def __reduce__(self):
        return (DistributedHangError, (str(self),), {"stacks": self.stacks})


class RunStoppedError(NblaunchError):
    """A background or detached run was stopped before every rank returned.

    Raised by ``RunHandle.result()`` after the view's Stop button, ``RunHandle.stop()`` or
    ``nblaunch runs stop``; a blocking launch that is stopped raises ``KeyboardInterrupt`` as
    any interrupted cell does. What the ranks wrote until then is in the run directory.
    """


class PoolRestartedError(NblaunchError):
    """A pool's cell ended with ranks that could not be stopped, so the pool started fresh ones.

    The names earlier cells defined are gone: run the cells that make them again. The first
    line says which ranks did not stop and why nothing could free them (typically a rank
    waiting in a point-to-point ``recv``, or in a collective with the checks off); the cell's
    own error (the rank's exception, or ``KeyboardInterrupt``) is its ``__cause__``.
    """


class NoExecutableBatchSizeError(NblaunchError, RuntimeError):
    """``find_executable_batch_size`` ran out of memory at every size down to 1.

    The message lists the sizes tried. Make the model or its inputs smaller (shorter
    sequences, lower precision, gradient checkpointing) or spread it over more devices.
    """


class DistributedOperationException(NblaunchError):
    """Debug mode found ranks calling a collective with arguments that do not match.

    Raised on every rank at once, so none of them hangs. The message is a table of what each
    rank passed (shapes, dtypes, devices, operation and call site).
    """


# Messages that a rank sees when a *peer* died: never the root cause of a failed run.
_SECONDARY_PATTERNS = re.compile(
    "|".join(
        [
            r"connection closed by peer",
            r"connection reset by peer",
            r"broken pipe",
            r"socket closed",
            r"timed out in .*(recv|send|connect)",
            r"read error .*: (eof|connection)",
            r"nccl communicator was aborted",
            r"remote process exited",
            r"ncclremoteerror",
            r"process group watchdog",
            r"distbackenderror",
            r"the server socket has failed",
            r"gloo.*(connection|peer)",
        ]
    ),
    re.IGNORECASE,
)


def is_secondary_failure(exc_type: str, message: str) -> bool:
    """True when an exception looks like the echo of a peer's death, not a cause of its own.

    Parameters
    ----------
    exc_type
        Qualified type name, e.g. ``"torch.distributed.DistBackendError"``.
    message
        The exception message.
    """
    return bool(_SECONDARY_PATTERNS.search(f"{exc_type}: {message}"))


# Not an exit status (those are 0-255): the rank's forkserver died, so its end could not be
# seen (see Supervisor.reap).
FORKSERVER_LOST = 256


def describe_exit(exitcode: int | None) -> tuple[str, int | None]:
    """Turn a multiprocessing exit code into words and a signal number.

    Negative exit codes mean "killed by signal -code" in multiprocessing.
    """
    if exitcode is None:
        return "was still running", None
    if exitcode == FORKSERVER_LOST:
        return (
            "could no longer be watched: the forkserver that started it died during the run "
            "(killed from outside, or by the out-of-memory killer), so nblaunch stopped the "
            "ranks; the next launch starts a new forkserver",
            None,
        )
    if exitcode < 0:
        signum = -exitcode
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        hint = {
            "SIGSEGV": " (a segmentation fault, often in a C extension)",
            "SIGKILL": " (killed from outside, often by the out-of-memory killer)",
            "SIGABRT": " (aborted, often a failed assertion in C++ code)",
            "SIGBUS": " (a bus error: often shared memory (/dev/shm) too small)",
        }.get(name, "")
        return f"was killed by {name}{hint}", signum
    return f"exited with code {exitcode} without raising a Python exception", None


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in naming the type when the exception's ``__str__`` fails."""
    try:
        return str(exc)
    except Exception as error:
        return f"<{type(exc).__name__}: str() raised {type(error).__name__}: {error!r}>"


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11+); on 3.10 the same ``__notes__`` list,
    which tracebacks there do not print."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
