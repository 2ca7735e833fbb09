"""The checks read torch's flight recorder: what torch issues from C++, without a comm hook.

Real ranks (2 CPU, gloo) for what the recorder's reader sends and the launcher finds; NCCL's
recorder, which this machine cannot run, through a stand-in that gives the same dump.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import time

import pytest

from nblaunch import DistributedHangError, DistributedOperationException, notebook_launcher
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.options import LaunchOptions
from nblaunch.ranks import heartbeat
from nblaunch.ranks.checks import process_groups
from nblaunch.ranks.checks.debug_report import split_site
from tests.conftest import assert_no_ranks_left


def launch(function, args=(), **kwargs):
    kwargs.setdefault("display", "none")
    kwargs.setdefault("timeout", 60)
    return notebook_launcher(function, args, num_processes=2, device_type="cpu", **kwargs)


def line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def ddp_and_its_hook():
    """DDP's own all-reduce under the default checks: no hook of nblaunch's; a user's hook is
    the one DDP reports; what the recorder's reader sent."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nblaunch.ranks.checks import recorder

    plain = DDP(torch.nn.Linear(4, 3))
    hooked = DDP(torch.nn.Linear(4, 3))
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    for _ in range(3):
        plain(torch.randn(2, 4)).sum().backward()
        hooked(torch.randn(2, 4)).sum().backward()
    reader = recorder.current()
    reader.read()
    names = [m._get_ddp_logging_data().get("comm_hook", "") for m in (plain, hooked)]
    return names, hasattr(plain, "_nblaunch_hook"), reader.sent, reader.lost


def test_ddp_keeps_its_own_all_reduce_and_the_users_hook_and_is_still_checked():
    for names, hooked, sent, lost in launch(ddp_and_its_hook):
        assert names == ["", "allreduce_hook"]  # DDP's logging names the user's hook, or none
        assert not hooked
        assert sent >= 12 and lost == 0  # construction broadcasts, 6 steps' all-reduces


def checks_and_reader():
    from nblaunch.ranks.checks import fingerprints, recorder

    return fingerprints.current() is not None, recorder.current() is not None


def test_one_rank_has_nobody_to_be_compared_with_and_no_reader():
    """A one-rank launch (one GPU) keeps the checks on but reads no recorder: every entry would
    be dropped, and the reads would cost its training loop."""
    one = notebook_launcher(checks_and_reader, num_processes=1, device_type="cpu", display="none")
    assert one == [(True, False)]
    assert launch(checks_and_reader) == [(True, True), (True, True)]


def broadcast_from_cpp():
    """A broadcast no Python wrapper sees (the process group's own method, as C++ code calls
    it), with a longer tensor on rank 1: gloo fills its start and returns."""
    import torch
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    t = torch.arange(5.0) if dist.get_rank() == 0 else torch.zeros(8)
    group.broadcast([t]).wait()  # the mismatch
    time.sleep(5)  # the launcher has the ranks' entries long before
    return t.tolist()


def test_a_mismatch_in_a_collective_torch_issued_itself_is_named_from_the_recorder():
    started = time.monotonic()
    with pytest.raises(DistributedOperationException) as info:
        launch(broadcast_from_cpp)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert message.startswith(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices must "
        "be valid.\n\nOperation: `broadcast issued by torch`\nInput shapes:\n"
        "  - Process 0: [5]\n  - Process 1: [8]\n"
    ), message
    # Where the rank was when its entry was read: in the broadcast, or already past it.
    lines = [line_of(broadcast_from_cpp, marker) for marker in ("group.broadcast", "time.sleep")]
    assert any(f"Process 1: test_recorder.py:{line}" in message for line in lines), message
    assert "(torch's numbers, from its flight recorder)" in message
    assert elapsed < 10, elapsed
    assert_no_ranks_left(10)


def ddp_step_skipped_before_a_gather():
    """Each step: DDP's backward, then nblaunch.gather of the loss; rank 1 skips step 3's
    backward, so its gather meets rank 0's gradient all-reduce."""
    import torch
    import torch.distributed as dist

    import nblaunch

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for step in range(6):
        loss = model(torch.randn(8, 4)).sum()
        if not (dist.get_rank() == 1 and step == 3):
            loss.backward()
        nblaunch.gather(loss.detach())  # rank 1's gather at step 3
        time.sleep(0.05)


def test_ddps_all_reduce_after_an_nblaunch_call_is_named_as_ddps():
    # nblaunch's own collectives once left their claim on the recorder's entries open: rank 0's
    # all-reduce went out as the gather before it, and the two ranks' entries agreed.
    started = time.monotonic()
    with pytest.raises(DistributedOperationException) as info:
        launch(ddp_step_skipped_before_a_gather)
    elapsed = time.monotonic() - started
    message = str(info.value)
    line = line_of(ddp_step_skipped_before_a_gather, "rank 1's gather at step 3")
    assert "rank 0 entered DDP's backward all-reduce" in message, message
    assert f"rank 1 called gather at test_recorder.py:{line}" in message
    assert elapsed < 10, elapsed
    assert_no_ranks_left(10)


def test_a_collective_torch_issued_is_placed_on_the_users_line_not_the_processs_command():
    # A rank forked by the forkserver has `python -c` as its outermost frame: a look at the task's
    # thread after it left the task once named DDP's all-reduce "<string>:1". Such a look is
    # skipped, and the entries a failed task made last are placed on its error's line.
    from nblaunch.ranks.checks import recorder
    from nblaunch.ranks.checks.debug_mode import UNKNOWN

    root = subprocess.run(
        [sys.executable, "-c",
         "import sys; from nblaunch.ranks.checks.debug_mode import site_of; "
         "print(site_of(sys._getframe()))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert root.stdout.strip() == UNKNOWN, root.stdout
    assert recorder._site_after([(5, UNKNOWN), (7, "cell line 3")], 4) == "cell line 3"
    assert recorder._site_after([(5, "cell line 2"), (7, "cell line 3")], 6) == "cell line 3"

    def backward():
        raise RuntimeError("gloo: connection closed by peer")

    try:
        backward()
    except RuntimeError as error:
        line = line_of(backward, "raise RuntimeError")
        assert split_site(recorder._error_site(error))[0] == f"test_recorder.py:{line}"


def test_with_the_recorder_off_the_header_says_what_is_not_checked(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    plan = plan_launch(print, 2, LaunchOptions(device_type="cpu"))
    said = [w for w in plan.warnings if w.startswith("TORCH_FR_BUFFER_SIZE=0")]
    assert len(said) == 1 and "DDP's gradient all-reduce" in said[0], plan.warnings
    assert not any(
        w.startswith("TORCH_FR_BUFFER_SIZE")
        for w in plan_launch(print, 2, LaunchOptions(device_type="cpu", debug=True)).warnings
    )
    # The calls from Python are still checked.
    with pytest.raises(DistributedOperationException, match="shape mismatches"):
        launch(shape_mismatch)


def shape_mismatch():
    import torch
    import torch.distributed as dist

    t = torch.zeros(2) if dist.get_rank() == 0 else torch.zeros(3)
    dist.broadcast(t, 0)


def ddp_after_a_send_and_receive():
    """A send/recv pair, then DDP steps until rank 1 leaves the loop: rank 0 waits in DDP's
    gradient all-reduce. gloo counts the pair in the group's status, not in its recorder's
    collective numbers."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    t = torch.ones(2)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    for step in range(20):
        model(torch.randn(8, 4)).sum().backward()  # rank 0 waits here
        if dist.get_rank() == 1 and step == 3:
            break


def test_a_hang_after_a_send_and_receive_names_the_collective_from_the_recorder():
    started = time.monotonic()
    with pytest.raises(DistributedHangError) as info:
        launch(ddp_after_a_send_and_receive)
    elapsed = time.monotonic() - started
    text = str(info.value)
    # Collective #10: DDP's 2 broadcasts at construction, 4 steps' all-reduce and the bucket
    # rebuild's broadcast, and the all-reduce rank 0 waits in; not the send and receive (gloo's
    # status counts them, #11 there: they are taken out).
    assert "rank 0 waits in DDP gradient all-reduce (collective #10, shapes [[20]])" in text, text
    assert elapsed < 30, elapsed
    assert_no_ranks_left(10)


# --- NCCL's recorder, through a stand-in --------------------------------------------------------


def nccl_dump(started: int, completed: int) -> dict:
    """What ``_dump_nccl_trace`` gives (the fields read here) for a rank whose DDP all-reduce
    #7 on the default group was enqueued and never completed."""
    entry = {
        "record_id": 6,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": 7,
        "profiling_name": "nccl:all_reduce",
        "input_sizes": [[8392704]],
        "input_dtypes": ["Float"],
        "state": "started" if started >= 7 else "scheduled",
        "is_p2p": False,
    }
    status = {
        "last_enqueued_collective": 7,
        "last_started_collective": started,
        "last_completed_collective": completed,
    }
    return {"entries": [entry], "pg_status": {"0": status}}


@pytest.mark.parametrize(
    ("started", "said"),
    [
        (7, "started on the GPU, waiting for its peers"),
        (6, "enqueued, not started on the GPU: it waits behind earlier work (collective #6 "),
    ],
)
def test_a_hang_on_nccl_names_the_collective_and_how_far_nccl_got(monkeypatch, started, said):
    monkeypatch.setattr(process_groups, "_dumps", lambda **_: [nccl_dump(started, 6)])
    entry = process_groups.in_flight("0", 7)
    assert (entry.operation, entry.shapes, entry.group_desc) == (
        "all_reduce",
        [[8392704]],
        "default_pg",
    )
    assert entry.progress.startswith(said)
    assert process_groups.group_status() == {"0": (7, 6)}
    assert process_groups.pending(process_groups.group_status()) == ("0", 7)
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)
    described = beat._in_flight(("0", 7), None)
    assert described["label"] == f"all_reduce ({entry.progress})"
    assert described["shapes"] == [[8392704]]


def test_a_collective_is_described_once_gloo_recorded_it(monkeypatch):
    """gloo counts DDP's all-reduce as issued before it records it: a heartbeat between the
    two says nothing of it, and the next one names it from the recorder's entry; without an
    entry by then, or with the recorder off, from the stack alone."""
    dump = nccl_dump(-1, 6)
    entry = dump["entries"].pop()
    entry.update(profiling_name="gloo:all_reduce")
    monkeypatch.setattr(process_groups, "_dumps", lambda **_: [dump])
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)

    def _engine_run_backward():  # torch.autograd.graph's name for the backward pass
        return beat._in_flight(("0", 7), None)

    assert _engine_run_backward() is None
    dump["entries"].append(entry)  # gloo's worker thread recorded it
    described = _engine_run_backward()
    assert (described["label"], described["shapes"]) == ("DDP gradient all-reduce", [[8392704]])
    dump["entries"].clear()  # never recorded (or overwritten)
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)
    assert _engine_run_backward() is None
    assert _engine_run_backward()["label"] == "collective in backward()"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)
    assert _engine_run_backward()["label"] == "collective in backward()"


def test_a_collective_gloo_counts_as_waiting_after_it_completed_gives_way_to_the_next(monkeypatch):
    """gloo's count of completed collectives can stay one behind while the next one waits
    (seen once in 30 hangs under load): its recorder marks the finished one retired, and the
    one the rank waits in is named, with its number and shapes."""

    def entry(number, sizes, retired):
        return {
            "process_group": ("0", "default_pg"),
            "collective_seq_id": number,
            "profiling_name": "gloo:all_reduce",
            "input_sizes": sizes,
            "retired": retired,
            "is_p2p": False,
        }

    status = {"last_enqueued_collective": 11, "last_completed_collective": 9}
    dump = {"entries": [entry(10, [[20]], True), entry(11, [[30]], False)]}
    dump["pg_status"] = {"0": status}
    monkeypatch.setattr(process_groups, "_dumps", lambda **_: [dump])
    assert process_groups.pending(process_groups.group_status()) == ("0", 10)
    found = process_groups.in_flight("0", 10)
    assert (found.seq, found.shapes) == (11, [[30]])
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)
    assert beat._in_flight(("0", 10), None)["seq"] == 11
    dump["entries"][1]["retired"] = True  # both done: the one asked for, as before
    assert process_groups.in_flight("0", 10).seq == 10


def test_a_collective_described_from_another_stack_is_described_again(monkeypatch):
    """The task's thread can move on between the counts and the stack read: a collective
    first described from another stack is named again from the one it waits on."""
    dump = nccl_dump(-1, 6)
    dump["entries"][0].update(profiling_name="gloo:all_reduce")
    monkeypatch.setattr(process_groups, "_dumps", lambda **_: [dump])
    beat = heartbeat.HeartbeatThread(0, send=lambda event: None)

    def next_forward():
        return beat._in_flight(("0", 7), None)["label"]

    def _engine_run_backward():
        return beat._in_flight(("0", 7), None)["label"]

    assert next_forward() == "all_reduce"
    assert _engine_run_backward() == "DDP gradient all-reduce"


def test_a_group_without_a_default_backend_is_numbered_by_its_backend_for_the_device():
    """A group made with a backend per device type has no default backend to number it (the
    default group made again in a rank came out so); its backend for the rank's device does."""

    from nblaunch.ranks import this_rank

    class Backend:
        def _get_sequence_number_for_group(self):
            return 7

    class Group:
        def _get_sequence_number_for_group(self):
            raise RuntimeError("ProcessGroup undefined does not yet support sequence numbers.")

        def _get_backend(self, device):
            asked.append(device)
            return Backend()

    asked = []
    assert process_groups.sequence_number(Group()) == 7
    assert asked == [this_rank.device()]
    assert process_groups.sequence_number(object()) is None


def test_gloo_says_nothing_of_its_progress(monkeypatch):
    dump = nccl_dump(-1, 6)
    dump["entries"][0]["profiling_name"] = "gloo:all_reduce"
    monkeypatch.setattr(process_groups, "_dumps", lambda **_: [dump])
    assert process_groups.in_flight("0", 7).progress == ""


# --- scripts/gpu-bench ----------------------------------------------------------------------------


def test_gpu_benchs_dry_run_prints_every_measure():
    """``scripts/gpu-bench --cpu``: the GPU benchmark's dry run on 2 CPU ranks, under a minute."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu-bench"
    started = time.monotonic()
    done = subprocess.run(
        [str(script), "--cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| measure (2 CPU rank(s), gloo) | value | detail |", done.stdout
    names = [line.split(" | ")[0].removeprefix("| ") for line in table[1:]]
    assert names == [
        "launch: first, then warm (spare ranks, their device context made ahead)",
        "launch: warm, spares let go (device environment changed since they warmed up)",
        "launch: warm, a DDP model, AdamW and one step",
        "default checks on a DDP step, checked vs unchecked blocks in one launch",
        "flight recorder: one full read / one look at the counts",
        "a real out-of-memory retried down to a batch that fits",
    ], done.stdout
    assert "failed" not in done.stdout
    assert elapsed < 60, elapsed
