"""Out-of-memory retries, their agreement across ranks and restarts, and the memory helpers.

Launch tests run 2 CPU ranks with gloo. Out-of-memory is raised two ways: a fake (the text of a
CUDA error) and a real one (a CPU allocation larger than the machine's memory).
"""

from __future__ import annotations

import time
import types

import pytest
import torch
from conftest import assert_no_ranks_left

import nblaunch
from nblaunch.engine.monitors import batch_size
from nblaunch.engine.monitors.batch_size import BatchSizeMonitor
from nblaunch.engine.plan.launch_plan import plan_launch, serialize_payload
from nblaunch.engine.run.run import Run
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.errors import DistributedHangError, NoExecutableBatchSizeError
from nblaunch.events import RunState
from nblaunch.notebook.views import RecordingView
from nblaunch.options import LaunchOptions
from nblaunch.ranks.memory.batch_size import (
    RESTART_OPTION,
    find_executable_batch_size,
    render_attempts,
)
from nblaunch.ranks.memory.memory import (
    free_memory,
    is_out_of_memory,
    per_device_batch_size,
    set_seed,
)

REAL_OOM_BYTES = 10**13  # 10 TB: more than any test machine's RAM and swap


class Recorder(RecordingView):
    """A view that keeps every event."""

    def progress(self) -> list[dict]:
        whats = ("batch_size", "effective_batch_size")
        return [e for e in self.events if e["kind"] == "progress" and e["what"] in whats]

    def texts(self) -> list[str]:
        return [e["text"] for e in self.progress()]


def launch(function, *args, num_processes=2):
    recorder = Recorder()
    plan = plan_launch(function, num_processes, LaunchOptions(device_type="cpu"))
    values = Run(plan, recorder).execute(serialize_payload(function, args))
    return values, recorder


def fake_oom(batch_size: int) -> RuntimeError:
    return RuntimeError(
        f"CUDA out of memory. Tried to allocate {batch_size * 2} MiB (GPU 0; 15.78 GiB total)"
    )


# --- recognising out-of-memory ------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "HIP out of memory. Tried to allocate 2.00 GiB",
        "XPU out of memory. Tried to allocate 1.71 GiB (GPU 0; 15.56 GiB total capacity)",
        "NPU out of memory. Tried to allocate 52.00 MiB (NPU 0; 60.96 GiB total capacity)",
        "MPS backend out of memory (MPS allocated: 18.04 GB, other allocations: 1.2 MB)",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 10000000000000 bytes. Error code 12",
        "DefaultCPUAllocator: not enough memory: you tried to allocate 80000000000 bytes.",
    ],
)
def test_out_of_memory_messages_are_recognised(message):
    assert is_out_of_memory(RuntimeError(message))


def test_out_of_memory_types_and_causes():
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert is_out_of_memory(MemoryError())
    wrapped = ValueError("the loader failed")
    wrapped.__cause__ = fake_oom(4)
    assert is_out_of_memory(wrapped)  # raise ValueError(...) from oom


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("boom"),
        RuntimeError("index out of range in self"),
        RuntimeError("Expected all tensors to be on the same device"),
        KeyboardInterrupt(),
    ],
)
def test_other_errors_are_not_out_of_memory(exc):
    assert not is_out_of_memory(exc)


def test_an_error_raised_while_handling_oom_is_not_oom():
    try:
        try:
            raise fake_oom(8)
        except RuntimeError:
            raise KeyError("cleanup failed") from None
    except KeyError as exc:
        assert not is_out_of_memory(exc)


def test_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(RuntimeError) as info:
        torch.empty(REAL_OOM_BYTES, dtype=torch.uint8)
    assert is_out_of_memory(info.value), str(info.value)


# --- the search in one process ------------------------------------------------------------------


def test_decorator_form_halves_until_it_fits():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 32:
            raise fake_oom(batch_size)
        return batch_size * scale

    assert train(10) == 320
    assert tried == [128, 64, 32]


def test_plain_call_form_and_custom_reduction():
    tried = []

    def train(batch_size, *, offset=0):
        tried.append(batch_size)
        if batch_size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size + offset

    search = find_executable_batch_size(
        train, starting_batch_size=100, reduce_batch_size_fn=lambda b: b - 25
    )
    assert search(offset=1) == 51
    assert tried == [100, 75, 50]


def test_real_cpu_oom_is_retried():
    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        nbytes = REAL_OOM_BYTES if batch_size > 16 else 1024 * batch_size
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        return batch_size, buffer.numel()

    assert train() == (16, 16 * 1024)


def test_error_below_one_lists_the_sizes_tried():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        raise fake_oom(batch_size)

    with pytest.raises(NoExecutableBatchSizeError, match=r"tried 8, 4, 2, 1\b") as info:
        train()
    assert isinstance(info.value, RuntimeError)


def test_other_errors_propagate_at_once():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        train()
    assert tried == [64]


def test_passing_the_batch_size_is_refused():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, epochs):
        return batch_size

    with pytest.raises(TypeError, match="without its first argument 'batch_size'"):
        train(32, 1)
    with pytest.raises(TypeError, match="batch_size"):
        train(1, batch_size=4)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="starting_batch_size"):
        find_executable_batch_size(lambda b: b, starting_batch_size=0)

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda b: b)
    def train(batch_size):
        raise fake_oom(batch_size)

    with pytest.raises(ValueError, match="must return a smaller batch size"):
        train()


def test_render_attempts():
    history = [
        {"batch_size": 128, "oom": [1]},
        {"batch_size": 64, "oom": [1]},
        {"batch_size": 32, "oom": []},
    ]
    assert render_attempts(history, 2) == "128 x (rank 1: out of memory) -> 64 x -> 32 ok"
    history = [{"batch_size": 8, "oom": [0, 1], "restarted": True}, {"batch_size": 4, "oom": []}]
    assert render_attempts(history, 2) == (
        "8 x (all ranks: out of memory; all ranks restarted) -> 4 ok"
    )


# --- helpers ------------------------------------------------------------------------------------


def test_free_memory_returns_nones():
    model, optimizer = free_memory(torch.nn.Linear(2, 2), object())
    assert model is None and optimizer is None
    assert free_memory() == []


def test_set_seed_reproduces_and_per_device_batch_size_outside_a_launch():
    set_seed(7)
    first = torch.rand(3)
    assert set_seed(7) == 7
    assert torch.equal(first, torch.rand(3))
    assert per_device_batch_size(64) == 64  # one process


def test_public_names():
    assert nblaunch.find_executable_batch_size is find_executable_batch_size
    assert nblaunch.free_memory is free_memory
    assert nblaunch.set_seed is set_seed
    assert nblaunch.per_device_batch_size is per_device_batch_size
    assert nblaunch.NoExecutableBatchSizeError is NoExecutableBatchSizeError


# --- across ranks -------------------------------------------------------------------------------


def _train_with_oom(mode, starting, threshold, with_collective):
    """Fake OOM above ``threshold`` on every rank ("all") or on rank 1 only ("rank1")."""
    import torch
    import torch.distributed as dist

    from nblaunch import find_executable_batch_size, rank

    attempts = []

    @find_executable_batch_size(starting_batch_size=starting)
    def train(batch_size):
        attempts.append(batch_size)
        if (mode == "all" or rank() == 1) and batch_size > threshold:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {batch_size} MiB")
        if with_collective:
            total = torch.tensor([float(batch_size)])
            dist.all_reduce(total)  # what a training step does with its gradients
            assert total.item() == 2 * batch_size, "ranks were on different batch sizes"
        return batch_size

    return train(), attempts


def test_symmetric_oom_agrees_directly():
    values, recorder = launch(_train_with_oom, "all", 128, 32, True)
    assert [v[0] for v in values] == [32, 32]
    assert values[0][1] == values[1][1] == [128, 64, 32]
    texts = recorder.texts()
    assert "128 x (all ranks: out of memory) -> 64 x -> 32 ok" in texts
    assert texts[-1] == "batch 32 per rank x 2 ranks = 64 effective"
    assert not any(e["data"].get("status") == "restart" for e in recorder.progress())
    retrying = [e for e in recorder.events if e["kind"] == "state" and e["state"] == "RETRYING"]
    assert {e["rank"] for e in retrying} == {0, 1}


def test_oom_on_rank_1_only_without_a_collective_keeps_ranks_together():
    values, recorder = launch(_train_with_oom, "rank1", 128, 32, False)
    assert [v[0] for v in values] == [32, 32]
    # rank 0 got through 128 and 64 but ran again at the agreed sizes
    assert values[0][1] == values[1][1] == [128, 64, 32]
    assert "128 x (rank 1: out of memory) -> 64 x -> 32 ok" in recorder.texts()


def _slow_rank_0(starting):
    import time

    from nblaunch import find_executable_batch_size, rank

    @find_executable_batch_size(starting_batch_size=starting)
    def train(batch_size):
        if rank() == 1 and batch_size > 32:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        if rank() == 0 and batch_size > 32:
            time.sleep(1.5)  # a long step, outside any collective: not a reason to restart
        return batch_size

    return train()


def test_a_rank_waiting_for_a_slow_peer_says_so_and_no_restart_happens():
    values, recorder = launch(_slow_rank_0, 64)
    assert values == [32, 32]
    statuses = [(e["rank"], e["data"]["status"]) for e in recorder.progress()]
    assert (1, "waiting") in statuses and (1, "agreed") in statuses
    assert statuses.index((1, "waiting")) < statuses.index((1, "agreed"))
    assert not any(status == "restart" for _, status in statuses)
    assert "rank 1: every rank finished attempt 1; rank 1 ran out of memory, all retry with 32" in (
        recorder.texts()
    )


def test_oom_on_rank_1_while_rank_0_waits_in_a_collective_restarts_all_ranks():
    started = time.monotonic()
    values, recorder = launch(_train_with_oom, "rank1", 64, 32, True)
    elapsed = time.monotonic() - started
    assert [v[0] for v in values] == [32, 32]
    # fresh processes after the restart: each tried only the agreed size
    assert values[0][1] == values[1][1] == [32]
    restarts = [e for e in recorder.progress() if e["data"]["status"] == "restart"]
    assert len(restarts) == 1
    assert restarts[0]["data"]["blocked_ranks"] == [0]
    texts = recorder.texts()
    assert "64 x (rank 1: out of memory; all ranks restarted) -> 32 ok" in texts
    assert texts[-1] == "batch 32 per rank x 2 ranks = 64 effective"
    assert elapsed < 60
    assert_no_ranks_left(10)


def test_real_cpu_oom_on_rank_1_in_a_launch():
    def train():
        import torch

        from nblaunch import find_executable_batch_size, rank

        @find_executable_batch_size(starting_batch_size=64)
        def inner(batch_size):
            big = rank() == 1 and batch_size > 16
            buffer = torch.empty(10**13 if big else batch_size, dtype=torch.uint8)
            return batch_size, buffer.numel()

        return inner()

    values, recorder = launch(train)
    assert values == [(16, 16), (16, 16)]
    assert "64 x (rank 1: out of memory) -> 32 x -> 16 ok" in recorder.texts()


def test_no_size_fits_raises_on_every_rank():
    with pytest.raises(NoExecutableBatchSizeError, match=r"tried 4, 2, 1\b"):
        launch(_train_with_oom, "rank1", 4, 0, False)


def test_per_device_batch_size_and_device_specific_seeds_in_a_launch():
    def work():
        import torch

        from nblaunch import per_device_batch_size, set_seed

        errors = ""
        try:
            per_device_batch_size(63)
        except ValueError as exc:
            errors = str(exc)
        set_seed(3)
        same = torch.rand(1).item()
        set_seed(3, device_specific=True)
        own = torch.rand(1).item()
        return per_device_batch_size(64), errors, same, own

    values, recorder = launch(work)
    assert [v[0] for v in values] == [32, 32]
    assert "use a multiple of 2 (62 or 64)" in values[0][1]
    assert values[0][2] == values[1][2]
    assert values[0][3] != values[1][3]
    assert "batch 32 per rank x 2 ranks = 64 effective" in recorder.texts()


# --- the parent-side monitor, fed by hand -------------------------------------------------------


class _FakePlan:
    world_size = 2


class _FakeRun:
    def __init__(self) -> None:
        self.outcome = types.SimpleNamespace(finished=set(), results={}, failures=[])
        self.task_ranks = [0, 1]
        self.clock = 100.0
        self.states = dict.fromkeys(self.task_ranks, RunState.RUNNING)

    def set_state(self, rank: int, state: RunState, detail: str = "") -> None:
        self.states[rank] = state

    def now(self) -> float:
        return self.clock


def _waiting_event(rank=1, batch_size=128):
    return {
        "kind": "progress",
        "rank": rank,
        "what": "batch_size",
        "text": "",
        "data": {
            "status": "waiting",
            "key": "0:train",
            "attempt": 1,
            "batch_size": batch_size,
            "next_batch_size": batch_size // 2,
            "history": [],
            "ranks": [rank],
        },
    }


def _beat(rank, collective):
    return {"kind": "heartbeat", "rank": rank, "collective": collective, "where": "t.py:3 in f"}


def test_monitor_restarts_when_a_peer_sits_in_a_collective():
    monitor, run = BatchSizeMonitor(_FakePlan()), _FakeRun()
    monitor.on_event(run, _beat(0, "all_reduce"))  # before the notice: does not count
    monitor.on_event(run, _waiting_event())
    assert run.states[1] is RunState.RETRYING  # the badge says the search goes on
    assert monitor.check(run) is None
    monitor.on_event(run, _beat(0, "all_reduce"))
    root = monitor.check(run)
    assert root.cause is Cause.RESTART
    assert "rank 0 in all_reduce (t.py:3 in f)" in root.message
    resume = root.options[RESTART_OPTION]["0:train"]
    assert resume["batch_size"] == 64
    assert resume["history"] == [{"batch_size": 128, "oom": [1], "restarted": True}]
    assert isinstance(root.exception, DistributedHangError)


def test_monitor_waits_for_a_busy_peer_and_clears_after_agreement(monkeypatch):
    monkeypatch.setattr(batch_size, "STUCK_WITHOUT_HEARTBEAT_S", 0.0)
    monitor, run = BatchSizeMonitor(_FakePlan()), _FakeRun()
    monitor.on_event(run, _waiting_event())
    for _ in range(5):
        monitor.on_event(run, _beat(0, None))  # computing, outside any collective
    assert monitor.check(run) is None
    agreed = _waiting_event(rank=0)
    agreed["data"]["status"] = "oom"
    monitor.on_event(run, agreed)
    monitor.on_event(run, _beat(0, "all_reduce"))
    monitor.on_event(run, _beat(0, "all_reduce"))
    assert monitor.check(run) is None  # nobody waits any more


def test_monitor_without_heartbeats_restarts_after_a_while():
    monitor, run = BatchSizeMonitor(_FakePlan()), _FakeRun()
    monitor.on_event(run, _waiting_event(batch_size=1))
    run.clock += batch_size.STUCK_WITHOUT_HEARTBEAT_S - 0.1
    assert monitor.check(run) is None
    run.clock += 0.2
    root = monitor.check(run)  # next size would be 0: no restart, the error instead
    assert isinstance(root.exception, NoExecutableBatchSizeError)
    assert "tried 1" in root.message


def test_searches_in_a_persistent_pool_stay_in_step_across_tasks():
    from nblaunch.notebook.pool import Pool

    with Pool(2, device_type="cpu", display="none") as pool:
        # a search on rank 0 alone cannot agree with rank 1: said at once, not a hang
        with pytest.raises(DistributedHangError, match="run it on every rank"):
            pool.run_on([0], _train_with_oom, "all", 4, 2, False)
        # a task where rank 1 fails before its search must not shift later agreements
        first = pool.run(_train_with_oom, "rank1", 64, 16, False)
        with pytest.raises(ValueError, match="rank 1 stops early"):
            pool.run(_fail_on_rank_1_before_search)
        second = pool.run(_train_with_oom, "rank1", 64, 16, False)
    assert [v[0] for v in first] == [v[0] for v in second] == [16, 16]


@pytest.mark.slow
def test_a_pool_cannot_restart_blocked_ranks_and_says_which_size_to_use():
    from nblaunch.notebook.pool import Pool

    with Pool(2, device_type="cpu", display="none") as pool:
        with pytest.raises(DistributedHangError, match="run again with starting_batch_size=32"):
            pool.run(_train_with_oom, "rank1", 64, 32, True)
        assert pool.run(_train_with_oom, "rank1", 32, 32, True) == [(32, [32]), (32, [32])]


def _fail_on_rank_1_before_search():
    from nblaunch import find_executable_batch_size, rank

    if rank() == 1:
        raise ValueError("rank 1 stops early")
    return find_executable_batch_size(lambda batch_size: batch_size, starting_batch_size=8)()


def test_monitor_leaves_failures_to_the_launcher_and_reports_a_rank_that_returned():
    monitor, run = BatchSizeMonitor(_FakePlan()), _FakeRun()
    monitor.on_event(run, _waiting_event())
    run.outcome.failures.append(RootCause(Cause.FAILURE, 0, "boom"))
    assert monitor.check(run) is None
    run.outcome.failures.clear()
    run.outcome.results[0] = b""
    root = monitor.check(run)
    assert isinstance(root.exception, DistributedHangError)
    assert "rank(s) 0, which returned without calling it" in root.message


def _only_rank_1_searches():
    from nblaunch import find_executable_batch_size, rank

    if rank() == 0:
        return 0

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    return train()


def test_a_search_that_only_some_ranks_call_is_reported_not_left_hanging():
    with pytest.raises(DistributedHangError, match="which returned without calling it"):
        launch(_only_rank_1_searches)
