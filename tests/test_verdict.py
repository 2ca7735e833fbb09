"""The verdict on its own: outcomes built by hand, no process started."""

from __future__ import annotations

import pickle
from pathlib import Path

import cloudpickle
import pytest

from nblaunch import tracebacks
from nblaunch.engine import verdict
from nblaunch.engine.verdict import Cause, Context, Outcome, RootCause
from nblaunch.errors import LaunchError, LaunchTimeoutError, RankFailedError

CONTEXT = Context(world_size=2, task_ranks=(0, 1))


def raised(rank: int, exc: BaseException, traceback: str = "") -> RootCause:
    """What the engine makes of a rank's Failure record for ``exc``."""
    exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return RootCause.from_failure(
        {
            "kind": "failure",
            "rank": rank,
            "exc_type": exc_type,
            "message": str(exc),
            "traceback": traceback or f"Traceback (most recent call last):\n{exc_type}: {exc}\n",
            "exception_bytes": cloudpickle.dumps(exc),
            "where": "train.py:3 in train",
        },
        received_at=0.0,
    )


def test_values_come_back_in_rank_order():
    outcome = Outcome(results={1: pickle.dumps("b"), 0: pickle.dumps("a")})
    assert verdict.values(outcome, [0, 1]) == ["a", "b"]


def test_a_value_that_cannot_be_unpickled_is_named_with_its_rank():
    outcome = Outcome(results={0: pickle.dumps(1), 1: b"not a pickle"})
    with pytest.raises(LaunchError, match="rank 1's return value cannot be unpickled here"):
        verdict.values(outcome, [0, 1])


def test_the_rank_s_own_exception_comes_back_with_the_rank_and_the_others():
    root = raised(1, ValueError("boom"))
    echo = raised(0, RuntimeError("Connection closed by peer"))
    assert echo.secondary and not root.secondary
    outcome = Outcome(failures=[echo, root])
    exc, diagnosis = verdict.exception_for(root, outcome, CONTEXT)
    assert type(exc) is ValueError and str(exc) == "boom"
    assert exc.__notes__[0].splitlines() == [
        "raised on rank 1 of 2",
        "Other ranks:",
        "  rank 0 raised RuntimeError: Connection closed by peer"
        " (a consequence of a peer's failure)",
    ]
    assert (
        diagnosis is not None
        and diagnosis["title"] == "rank 1 of 2 failed: rank 1 raised ValueError: boom"
    )
    assert diagnosis["rank"] == 1


def test_a_secondary_root_says_it_looks_like_a_consequence():
    root = raised(0, RuntimeError("Connection reset by peer"))
    exc, _ = verdict.exception_for(root, Outcome(failures=[root]), CONTEXT)
    assert "looks like a consequence of a peer's failure" in exc.__notes__[0]


def test_debug_mode_s_verdict_raised_everywhere_names_no_culprit():
    from nblaunch.errors import DistributedOperationException

    report = "processes called different collectives at the same step"
    failures = [raised(r, DistributedOperationException(report)) for r in (0, 1)]
    outcome = Outcome(failures=failures)
    exc, _ = verdict.exception_for(failures[0], outcome, CONTEXT)
    assert exc.__notes__[0] == "raised on every rank (2 of 2), with the same message"
    # One rank short: it is rank 0's error, and rank 1 is among the others.
    exc, _ = verdict.exception_for(
        failures[0], outcome, Context(world_size=3, task_ranks=(0, 1, 2))
    )
    assert exc.__notes__[0].startswith("raised on rank 0 of 3\nOther ranks:\n  rank 1 raised")


def test_a_death_names_the_signal_the_log_and_the_last_output(tmp_path: Path):
    death = RootCause.death(1, -9)
    context = Context(
        world_size=2, task_ranks=(0, 1), run_dir=tmp_path, tails={1: ["step 3", "step 4"]}
    )
    exc, diagnosis = verdict.exception_for(death, Outcome(failures=[death]), context)
    assert isinstance(exc, RankFailedError) and exc.signal == 9 and exc.exitcode == -9
    assert str(exc).startswith("rank 1 of 2 was killed by SIGKILL (killed from outside")
    assert f"Its full output is in {tmp_path / 'rank1.log'}." in str(exc)
    assert str(exc).endswith("Its last output:\n    step 3\n    step 4")
    assert diagnosis is not None


def test_sys_exit_on_a_rank_never_ends_the_caller():
    root = raised(1, SystemExit(3))
    exc, _ = verdict.exception_for(root, Outcome(failures=[root]), CONTEXT)
    assert isinstance(exc, RankFailedError) and exc.exitcode == 3
    assert str(exc) == "rank 1 of 2 called sys.exit(3)"


def test_a_timeout_is_a_launch_timeout_error_without_a_diagnosis():
    root = RootCause(Cause.TIMEOUT, 1, "timeout=5 s ran out with rank(s) 1 of 2 still running")
    exc, diagnosis = verdict.exception_for(root, Outcome(), CONTEXT)
    assert isinstance(exc, LaunchTimeoutError) and isinstance(exc, TimeoutError)
    assert diagnosis is None


def test_a_monitor_s_exception_is_raised_as_it_is_with_the_debug_hint_for_a_hang():
    hang = RuntimeError("rank 1 waits in all_reduce")
    root = RootCause(Cause.HANG, 1, "no progress", exception=hang, title="ranks stuck")
    exc, diagnosis = verdict.exception_for(root, Outcome(), CONTEXT)
    assert exc is hang and "debug=True" in exc.__notes__[0]
    assert diagnosis is not None and diagnosis["title"] == "ranks stuck"
    quiet = RuntimeError("same, in debug mode")
    root = RootCause(Cause.HANG, 1, "no progress", exception=quiet)
    exc, _ = verdict.exception_for(
        root, Outcome(), Context(world_size=2, task_ranks=(0, 1), debug=True)
    )
    assert not getattr(exc, "__notes__", [])


def test_the_debug_hint_only_for_failures_inside_a_collective():
    in_collective = raised(
        0,
        RuntimeError("Connection closed by peer"),
        traceback='  File "/x/torch/distributed/distributed_c10d.py", line 2806, in all_reduce\n',
    )
    elsewhere = raised(0, ValueError("bad input"))
    exc, _ = verdict.exception_for(in_collective, Outcome(failures=[in_collective]), CONTEXT)
    assert "debug=True" in exc.__notes__[0]
    exc, _ = verdict.exception_for(elsewhere, Outcome(failures=[elsewhere]), CONTEXT)
    assert "debug=True" not in exc.__notes__[0]


@pytest.mark.parametrize(
    "gloo_says",
    [
        # torch 2.9+
        "op.preamble.length <= op.nbytes. 580 vs 4. Received data size doesn't match expected "
        "size. Is there a distributed collective mismatch in your code?",
        "op.preamble.length <= op.nbytes. 580 vs 4",  # torch 2.8
    ],
)
def test_gloo_s_size_check_abort_is_a_failure_inside_a_collective(gloo_says):
    # A rank that gloo aborts (SIGABRT, no Python traceback) when the ranks' collectives differ
    # in size: only gloo's line says it was in a collective, and it gets the debug hint.
    last_output = (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        f"  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] {gloo_says}"
    )
    assert verdict.failed_in_collective(last_output)
    assert not verdict.failed_in_collective("terminate called after throwing std::bad_alloc")


def test_an_exception_that_does_not_unpickle_keeps_its_type_name_and_traceback():
    root = raised(1, ValueError("boom"))
    root.exception_bytes = b"garbage"
    exc, _ = verdict.exception_for(root, Outcome(failures=[root]), CONTEXT)
    assert isinstance(exc, RankFailedError)
    assert str(exc).startswith("rank 1 of 2 raised builtins.ValueError: boom")
    assert exc.remote_traceback == root.traceback


def test_outcome_words_and_descriptions():
    root = raised(1, ValueError("first line\nsecond line"))
    assert root.outcome_words() == "ValueError: first line"
    assert root.describe() == "rank 1 raised ValueError: first line"
    assert RootCause.death(0, 3).describe() == (
        "rank 0 exited with code 3 without raising a Python exception"
    )
    assert RootCause.death(1, -9, after_return=True).message.startswith(
        "was killed by SIGKILL (killed from outside, often by the out-of-memory killer) after it "
        "returned, while the other ranks still ran"
    )
    outcome = Outcome(failures=[root, RootCause.death(0, -11)])
    assert [f.rank for f in outcome.deaths()] == [0]
    assert outcome.primaries() == outcome.failures


# --- settling on the root cause ----------------------------------------------------------------


def at(failure: RootCause, received_at: float) -> RootCause:
    failure.received_at = received_at
    return failure


def test_the_first_primary_failure_wins_at_once_even_after_a_secondary_one():
    echo = at(raised(0, RuntimeError("Connection reset by peer")), 10.0)
    cause = at(raised(1, ValueError("boom")), 10.5)
    assert verdict.settle(Outcome(failures=[echo]), [0, 1], now=10.1) is None
    assert verdict.settle(Outcome(failures=[echo, cause]), [0, 1], now=10.6) is cause


def test_a_secondary_failure_wins_only_after_the_grace():
    echo = at(raised(0, RuntimeError("Connection reset by peer")), 10.0)
    outcome = Outcome(failures=[echo])
    assert verdict.settle(outcome, [0, 1], now=10.0 + verdict.SECONDARY_GRACE_S - 0.1) is None
    assert verdict.settle(outcome, [0, 1], now=10.0 + verdict.SECONDARY_GRACE_S + 0.1) is echo


def test_a_death_is_a_primary_cause():
    death = RootCause.death(1, -11)
    assert verdict.settle(Outcome(failures=[death]), [0, 1], now=0.0) is death


def test_debug_mode_s_verdict_waits_for_every_rank_s_or_for_its_limit():
    from nblaunch.errors import DistributedOperationException

    first = at(raised(0, DistributedOperationException("mismatch")), 5.0)
    second = at(raised(1, DistributedOperationException("mismatch")), 5.2)
    assert verdict.settle(Outcome(failures=[first]), [0, 1], now=5.1) is None
    assert verdict.settle(Outcome(failures=[first, second]), [0, 1], now=5.2) is first
    late = 5.0 + verdict.VERDICT_WAIT_S
    assert verdict.settle(Outcome(failures=[first]), [0, 1], now=late) is first
    # A task on rank 0 alone does not wait for rank 1.
    assert verdict.settle(Outcome(failures=[first]), [0], now=5.1) is first


def test_the_diagnosis_shows_a_ranks_traceback_from_the_users_frame_on():
    package = tracebacks._PACKAGE_DIR
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{package}ranks/worker.py", line 398, in _run_task\n'
        "    value = function(*args, **kwargs)\n"
        "            ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "/work/train.py", line 6, in train\n'
        "    log(x)\n"
        f'  File "{package}ranks/metrics.py", line 9, in log\n'
        '    raise TypeError("x")\n'
        "TypeError: x\n"
    )
    root = raised(1, TypeError("x"), text)
    _, diagnosis = verdict.exception_for(root, Outcome(failures=[root]), CONTEXT)
    assert diagnosis is not None
    body = diagnosis["body"]
    assert body.splitlines()[1] == '  File "/work/train.py", line 6, in train'
    assert "_run_task" not in body and "ranks/metrics.py" in body  # only the leading frames
    # With no frame of the user's (nblaunch raised it), the last of nblaunch's stays.
    own = (
        "Traceback (most recent call last):\n"
        f'  File "{package}ranks/worker.py", line 398, in _run_task\n'
        "    value = function(*args, **kwargs)\n"
        f'  File "{package}ranks/worker.py", line 407, in _run_task\n'
        "    value_bytes = cloudpickle.dumps(value)\n"
        "TypeError: cannot pickle\n"
    )
    assert tracebacks.without_launcher_text(own).splitlines()[1:] == own.splitlines()[3:]


def test_an_out_of_memory_a_finder_caught_is_named_before_the_mismatch_it_caused():
    from nblaunch.errors import DistributedOperationException

    def mismatch() -> RootCause:
        report = DistributedOperationException("Cannot apply desired operation ... [32] vs [8]")
        return RootCause(Cause.MISMATCH, 0, "shapes", exception=report, title="ranks disagree")

    caught = {
        "kind": "progress",
        "rank": 1,
        "what": "oom_caught",
        "text": "",
        "data": {
            "finder": "Accelerate's find_executable_batch_size",
            "sizes": [32, 16],
            "error": "CUDA out of memory. Tried to allocate 2.00 GiB",
        },
    }
    exc, shown = verdict.exception_for(mismatch(), Outcome(caught_oom={1: caught}), CONTEXT)
    first, *rest = str(exc).split("\n")
    assert first == (
        "rank 1 of 2 ran out of memory at batch_size=32: Accelerate's find_executable_batch_size "
        "caught it and retried that rank alone with a smaller batch (out of memory again at 16) "
        "while rank 0 went on at the old size, so the ranks' collectives parted ways (the report "
        "below). Out of memory: "
        "CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert rest[0].startswith("Fix: use nblaunch's find_executable_batch_size")
    assert str(exc).endswith("Cannot apply desired operation ... [32] vs [8]")
    assert shown["title"] == "rank 1 of 2 ran out of memory at batch_size=32"
    assert shown["rank"] == 1
    # Without a caught out-of-memory, and for a rank's own failure, nothing is added.
    exc, shown = verdict.exception_for(mismatch(), Outcome(), CONTEXT)
    assert str(exc).startswith("Cannot apply") and shown["title"] == "ranks disagree"
    failure = raised(1, ValueError("boom"))
    exc, _ = verdict.exception_for(failure, Outcome(caught_oom={1: caught}), CONTEXT)
    assert str(exc) == "boom"
