"""The records that travel between ranks, nodes and the notebook, and the states of runs and ranks.

Everything a view shows arrives as one of these records: the protocol is readable here, in one
place. Ranks send ``Started``, ``Log``, ``Progress``, ``Heartbeat``, ``Metrics``, ``Failure``,
``Result``, ``Finished``, ``Released`` and the debugger's ``DebugPrompt``/``DebugEnd`` over their
event pipe; the parent's relay turns the ranks' raw stdout/stderr bytes into ``Stream`` records
and adds ``RunInfo``, ``StateChange``, ``Diagnosis`` and ``RunEnded``. A view only renders
records; it never infers a state on its own. Down each rank's pipe go ``Setup``, ``Task``,
``Stop``, ``DebugInput`` and ``Release``; a joined node adds ``Death``, ``NodeNews`` and
``Collectives`` to what it sends the notebook.

Every record is a plain ``dict`` (a ``TypedDict``) with a ``kind`` key, so it pickles cheaply and
prints readably.
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Literal, Protocol, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10; typing_extensions comes with torch
    from typing_extensions import NotRequired


class Lifecycle(str, enum.Enum):
    """Where a run is in its life (a blocking, background or detached run, or a pool): what
    handles, ``nblaunch runs``, ``%dist status``, the registry's files and the Lab panel say.

    Formats as its value (``f"{Lifecycle.RUNNING}"`` is ``running``), as ``enum.StrEnum`` would
    from Python 3.11 on. A rank of a run has a state of its own (:class:`RunState`): a running
    run may have a rank stalled, in the debugger or retrying a batch size.
    """

    STARTING = "starting"
    RUNNING = "running"
    IDLE = "idle"  # a pool between tasks
    BUSY = "busy"  # a pool running a task
    BROKEN = "broken"  # a pool whose rank died: only a restart or a stop helps
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # its host ended without leaving how the run went
    CLOSED = "closed"  # a pool that was stopped, or not started yet

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RunState(str, enum.Enum):
    """Lifecycle of one rank, as the views show it (a run's own is :class:`Lifecycle`)."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RETRYING = "RETRYING"
    DEBUGGING = "DEBUGGING"  # waiting in the debugger for the person's next command
    STALLED = "STALLED"
    FAILED = "FAILED"
    DONE = "DONE"
    STOPPED = "STOPPED"


# --- sent by ranks ------------------------------------------------------------------------------


class Started(TypedDict):
    kind: Literal["started"]
    rank: int
    pid: int
    host: str
    device: str  # "cpu", "cuda:0", "xla:0 · TPU chip 3", ... (what the view's badge says)


class Log(TypedDict):
    """A logging record from a rank (nblaunch's logger or any stdlib logger)."""

    kind: Literal["log"]
    rank: int
    level: str  # "INFO", "WARNING", ...
    name: str  # logger name
    message: str
    in_order: bool  # the view shows these in rank order rather than arrival order
    seq: int  # per-rank counter of in-order records, so the parent can line them up
    collectives: int | None  # collectives the rank had issued when it logged, when known
    time: float


class Progress(TypedDict):
    """Progress of a multi-attempt operation, e.g. out-of-memory retries.

    ``what`` names the operation ("batch_size"); ``text`` is the one-line rendering that
    text views print; ``data`` holds the structured fields a widget may use.
    """

    kind: Literal["progress"]
    rank: int
    what: str
    text: str
    data: dict[str, Any]


# ``Progress.what`` of a rank whose out-of-memory error a library's batch-size finder caught
# and retried on that rank alone (``nblaunch.ranks.memory.caught_oom``).
OOM_CAUGHT = "oom_caught"


class Heartbeat(TypedDict):
    """Where a rank's main thread is, sent about once a second while a task runs."""

    kind: Literal["heartbeat"]
    rank: int
    where: str  # "file.py:12 in train"
    collective: str | None  # "all_reduce" when inside a torch.distributed call, else None
    wait_s: float  # total seconds spent inside collectives so far
    busy_s: float  # total seconds of the task so far
    last_output: float  # time.time() of the last write to stdout/stderr
    stack: str  # formatted stack of every thread, for hang reports
    seq: int | None  # collectives issued on the default process group so far, when known
    still_s: float  # seconds since the main thread last made visible progress
    in_flight: InFlightInfo | None  # the collective the rank waits in, when it waits in one
    groups: dict[str, int]  # process group name -> number of its last collective issued
    # The point-to-point request the task waits on, the operations posted as
    # [direction, group, peer, tag, count], and each group's global ranks
    # (nblaunch.ranks.checks.waits).
    p2p_wait: NotRequired[PointToPoint | None]
    p2p_posted: NotRequired[list[list[Any]]]
    members: NotRequired[dict[str, list[int]]]


class PointToPoint(TypedDict):
    """A point-to-point operation a rank posted: its number among the same posts to that peer."""

    op: str  # "send" or "recv"
    group: str  # process group name; "0" is the default group
    peer: int  # global rank; -1 for a receive from any source
    tag: int | None  # None where the backend ignores tags (not gloo)
    n: int  # 1 for the first operation of this direction, group, peer and tag


class InFlightInfo(TypedDict):
    """A collective a rank issued and waits in, as its process group and flight recorder say."""

    group: str  # process group name; "0" is the default group
    group_desc: str  # "default_pg", or a subgroup's description
    seq: int  # its number on that group
    label: str  # "DDP gradient all-reduce", "FSDP all-gather", "all_reduce"
    shapes: list[list[int]]  # input tensor shapes, when the flight recorder is on


class Collectives(TypedDict):
    """Collectives ranks issued (the out-of-band checks), as a joined node passes them on.

    In a rank each call goes to its launcher down a pipe of its own
    (``nblaunch.ranks.checks.fingerprints``), 13 bytes per call, not through the event pipe.
    """

    kind: Literal["collectives"]
    calls: list[CollectiveCall]


class CollectiveCall(TypedDict):
    """One collective call: who issued it, its process group, its number there, and its facts
    (operation, call site, shapes, dtypes, arguments: ``nblaunch.ranks.checks.debug_report.FACTS``,
    what the launcher compares; debug mode's record of them is taken too)."""

    rank: int
    task: int  # the task it belongs to (a pool runs many)
    group: str  # process group name; "0" is the default group
    n: int  # the checked collectives of ``group`` in the task, counted from 1
    size: int  # ranks in the group
    record: tuple[Any, ...] | dict[str, Any]
    # Also, with a group's first call of a task only: "members", the group's ranks.


class Failure(TypedDict):
    """A Python exception that ended a task on a rank."""

    kind: Literal["failure"]
    rank: int
    exc_type: str  # qualified name, e.g. "builtins.ValueError"
    message: str
    traceback: str  # formatted remote traceback
    exception_bytes: bytes | None  # the pickled exception (with traceback), when it pickles
    where: str  # innermost user frame, "file.py:12 in train"


class DebugPrompt(TypedDict):
    """A rank's debugger waits for a command (nblaunch.ranks.debugger)."""

    kind: Literal["debug"]
    rank: int
    output: str  # what the debugger printed since its last prompt
    prompt: str  # "(Pdb) "


class DebugEnd(TypedDict):
    """A rank left its debugger's prompt and runs on (or quits)."""

    kind: Literal["debug_end"]
    rank: int
    output: str


class Metrics(TypedDict):
    """Numbers a rank logged with ``nblaunch.log_metrics`` at one step."""

    kind: Literal["metrics"]
    rank: int
    step: int
    values: dict[str, float]
    time: float


class Result(TypedDict):
    kind: Literal["result"]
    rank: int
    value_bytes: bytes
    called_exit: bool  # the task ended with sys.exit(0) (value None), not a return


class Finished(TypedDict):
    """A rank left its task (after its Result or Failure)."""

    kind: Literal["finished"]
    rank: int


# --- made by the parent -------------------------------------------------------------------------


class Stream(TypedDict):
    """One line a rank wrote to a file descriptor (1 or 2).

    ``carriage`` is True for a line ended by ``\\r`` (a progress bar redrawing itself): a view
    updates the rank's current line in place instead of adding one.
    """

    kind: Literal["stream"]
    rank: int
    fd: int
    text: str
    carriage: bool


class RunInfo(TypedDict):
    """The header of a run: sent once, before anything else."""

    kind: Literal["run_info"]
    world_size: int
    device_kind: str  # "cpu", "NVIDIA H200", ...
    start_method: str
    debug: bool
    checks: bool  # the out-of-band collective checks (off under debug mode, which checks first)
    run_dir: str
    warnings: list[str]
    notes: list[str]  # what nblaunch did that is worth knowing but is no problem
    started_at: float


def checking_mode(info: RunInfo | dict[str, Any]) -> str:
    """How a run checks its collectives, as the views' headers say it."""
    if info.get("debug"):
        return "debug on"
    return "checks on" if info.get("checks") else "checks off"


class StateChange(TypedDict):
    kind: Literal["state"]
    rank: int
    state: RunState
    detail: str  # e.g. the line where a stalled rank sits


class Diagnosis(TypedDict):
    """A finding for the error/progress panel: root cause, hang, shape mismatch, straggler.

    ``severity`` is "error" for what ends the run, "warning" or "info" otherwise.
    """

    kind: Literal["diagnosis"]
    title: str
    body: str
    severity: Literal["error", "warning", "info"]
    rank: int | None
    secondary: list[str]  # one line per secondary failure folded under the root cause


def diagnosis(
    title: str,
    body: str,
    severity: Literal["error", "warning", "info"],
    rank: int | None,
    secondary: list[str] | None = None,
) -> Diagnosis:
    """A ``Diagnosis`` record (``secondary``: the other ranks' failures, one line each)."""
    return {
        "kind": "diagnosis",
        "title": title,
        "body": body,
        "severity": severity,
        "rank": rank,
        "secondary": secondary or [],
    }


class RunEnded(TypedDict):
    kind: Literal["run_ended"]
    ok: bool
    elapsed_s: float
    ranks: dict[int, str]  # rank -> one-line outcome ("returned 3", "ValueError: boom")
    restarts: NotRequired[int]  # how often the whole run started again (max_restarts=)


def after_restarts(ended: RunEnded | dict[str, Any]) -> str:
    """``" after 1 restart"`` for a run that started again, as the views' end lines say it."""
    count = ended.get("restarts", 0)
    return f" after {count} restart{'s' if count != 1 else ''}" if count else ""


# --- sent down to a rank, and by joined nodes ----------------------------------------------------

# Message kinds the parent sends down a rank's task pipe.
SETUP = "setup"
TASK = "task"
STOP = "stop"
RELEASE = "release"


class Setup(TypedDict):
    """The first message to a rank: its environment, device and process group (plan.py)."""

    kind: Literal["setup"]
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    mp_start_method: str
    backend: str
    init_method: str | None  # "xla://" on TPUs; None: nblaunch's own store
    device_type: str
    init_process_group: bool
    debug: bool
    launcher_pid: int
    num_threads: int | None
    options: dict[str, Any]  # for in-rank features (log level, hang timeout, debug_on_error)


class Task(TypedDict):
    kind: Literal["task"]
    payload: bytes  # cloudpickled (function, args, kwargs)
    task_id: int
    all_ranks: bool  # only a task on every rank may make the default group again


def task_message(payload: bytes, task_id: int, ranks: list[int], world_size: int) -> Task:
    """The ``Task`` for ``ranks`` of a run of ``world_size`` ranks."""
    return {
        "kind": "task",
        "payload": payload,
        "task_id": task_id,
        "all_ranks": len(ranks) == world_size,
    }


class Stop(TypedDict):
    kind: Literal["stop"]


class DebugInput(TypedDict):
    """The person's answer to a ``DebugPrompt``."""

    kind: Literal["debug_input"]
    line: str


class Release(TypedDict):
    """Between tasks: issue these calls, which peers wait in and this rank's task never issued
    (``nblaunch.ranks.release``); answered by ``Released``."""

    kind: Literal["release"]
    calls: list[CollectiveCall]
    timeout_s: float


class Released(TypedDict):
    """A rank issued the calls of a ``Release`` (``ok``), or could not (``problem``)."""

    kind: Literal["released"]
    rank: int
    ok: bool
    problem: str


class Death(TypedDict):
    """A joined node's rank process ended without reporting (the notebook's own are reaped)."""

    kind: Literal["death"]
    rank: int
    exitcode: int | None


class NodeNews(TypedDict, total=False):
    """About a joined node itself: ``what`` is "started" (host, ranks, pid), "done" (outcome),
    "error" (message) or "forged_control" (message)."""

    kind: Literal["node"]
    what: str
    host: str
    ranks: list[int]
    pid: int
    outcome: str
    message: str


Event = (
    Started
    | Log
    | DebugPrompt
    | DebugEnd
    | Metrics
    | Progress
    | Heartbeat
    | Collectives
    | Failure
    | Result
    | Finished
    | Released
    | Stream
    | RunInfo
    | StateChange
    | Diagnosis
    | RunEnded
)


class EventSink(Protocol):
    """What the relay feeds: a view (widget, text) or a recorder in tests."""

    def handle(self, event: Event) -> None:
        """Take one record; must be cheap (coalesce, render later in ``flush``)."""

    def flush(self, force: bool = False) -> None:
        """Called often by the relay (tens of times a second): render what changed, at a rate
        the view chooses, or now when ``force`` (the thread is about to block)."""

    def close(self) -> None:
        """The run is over: render the final state."""


class NullView:
    """Shows nothing (``display="none"``); the per-rank log files are still written."""

    def handle(self, event: Event) -> None:
        pass

    def flush(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
