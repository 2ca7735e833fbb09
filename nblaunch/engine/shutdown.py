"""How a run's ranks are stopped: politely when the run went well, quickly when the cause is
known, escalating on an interrupt; and what they say meanwhile is still read.

Functions of a :class:`~nblaunch.engine.run.Run`, which calls them from its methods of the same
names (a multi-node run adds its other nodes around them).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from nblaunch.engine import checks, verdict
from nblaunch.engine.verdict import Cause
from nblaunch.events import RunState

if TYPE_CHECKING:
    from nblaunch.engine.run import Run

# After a root cause, how long the other ranks get to stop before SIGKILL.
STOP_GRACE_S = 2.0
# How long the other ranks get to stop once a root cause (a failure, a death, a hang) is known.
KNOWN_CAUSE_GRACE_S = 0.5


def stop_on_interrupt(run: Run) -> None:
    """The notebook was interrupted: SIGINT every rank, then escalate; within ~5 s in all."""
    try:
        run.backend.interrupt()
        deadline = run.now() + 1.5
        while run.backend.alive() and run.now() < deadline:
            if run.relay is not None:
                run.relay.poll(0.05)
            run.backend.reap()
            if all(r.rank in run.outcome.finished or r.ended for r in run.backend.ranks):
                break
    except KeyboardInterrupt:
        pass  # a second interrupt: go straight on to stopping
    for rank in range(run.plan.world_size):
        if run.states.get(rank) not in (RunState.DONE, RunState.FAILED):
            run.set_state(rank, RunState.STOPPED, "interrupted")


def finish(run: Run) -> None:
    """Stop every rank (asking nicely first when the run went well) and close everything."""
    backend = run.backend
    ok = len(run.outcome.results) == run.plan.world_size
    try:
        if ok:
            # The watch loop ends at the last Result; that rank's Finished may not be read yet.
            for rank in sorted(run.outcome.results):
                run.set_state(rank, RunState.DONE)
            run.hang_up(limit_s=5.0)
        else:
            for ended in backend.reap():  # ended on their own since the last turn
                if ended.rank not in run.outcome.finished:
                    run.on_death(ended.rank, ended.exitcode)
            reason = verdict.stop_reason(run.outcome.root, run.plan.timeout)
            for rank in range(run.plan.world_size):
                if rank not in run.outcome.finished and run.states.get(rank) in (
                    RunState.STARTING,
                    RunState.RUNNING,
                    RunState.STALLED,
                ):
                    run.set_state(rank, RunState.STOPPED, reason)
        root = run.outcome.root
        if root is not None and root.cause in (
            Cause.FAILURE,
            Cause.DEATH,
            Cause.HANG,
            Cause.MISMATCH,
        ):
            # The cause is known and the others are most likely blocked in a collective
            # they cannot finish: they get half a second, and being killed is no news.
            backend.stop(grace=KNOWN_CAUSE_GRACE_S, quiet=True)
        else:
            backend.stop(grace=STOP_GRACE_S)
    except KeyboardInterrupt:
        backend.stop(grace=0.0)
        raise
    finally:
        if run.relay is not None:
            run.relay.drain_output(timeout=1.0)
            if not ok:
                mark_crashed(run)
            run.publish(run.run_ended(ok))
            run.relay.close()
        backend.close()
        checks.close_reader(run.plan)
        run.view.close()
        release_run_dir(run)


# The signals a stop sends: a rank that ended by another one crashed on its own.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


def mark_crashed(run: Run) -> None:
    """A rank being stopped that crashed on its own (gloo aborting with SIGABRT after a
    mismatch, a segmentation fault) is shown as it ended, with its last lines, not as stopped."""
    for process in run.backend.ranks:
        code = process.exitcode
        if code is None or code >= 0 or -code in _STOP_SIGNALS:
            continue
        if process.rank in run.outcome.finished or run.states.get(process.rank) in (
            RunState.FAILED,
            RunState.DONE,
        ):
            continue
        death = verdict.RootCause.death(process.rank, code)
        tail = [line for line in run.relay.tails.get(process.rank, ()) if line.strip()]
        if tail:
            death.message += f"; its last output: {tail[-1].strip()[:200]}"
        run.outcome.finished.add(process.rank)
        run.outcome.failures.append(death)
        run.set_state(process.rank, RunState.FAILED, death.message)


def release_run_dir(run: Run) -> None:
    """The run wrote its last: its directory may be pruned from now on (``run_dirs``)."""
    if run.plan.run_lease is not None:
        run.plan.run_lease.release()


def relay_until_hung_up(run: Run, timeout: float) -> None:
    """Keep reading output while the stopped ranks shut down, until each has closed its
    pipes (its last words) or exited; those still exiting are left to exit on their own."""
    assert run.relay is not None
    deadline = run.now() + timeout
    while run.now() < deadline:
        run.backend.reap()
        if all(run.relay.hung_up(rank.rank) for rank in run.backend.alive()):
            break
        run.relay.poll(0.01)
    run.backend.let_go([r for r in run.backend.alive() if run.relay.hung_up(r.rank)])
