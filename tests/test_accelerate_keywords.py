"""Accelerate's ``notebook_launcher`` keywords, each with Accelerate's meaning: real rank
processes (2 CPU ranks, gloo) where the meaning is what the ranks see, pure checks for the
mapping and its errors. See docs/compat.md."""

from __future__ import annotations

import inspect
import io
import os
import re
import socket

import pytest

from nblaunch import LaunchError, notebook_launcher
from nblaunch.engine.plan.launch_plan import plan_launch
from nblaunch.engine.run.restarts import Attempts
from nblaunch.engine.verdict import Cause, RootCause
from nblaunch.notebook import accelerate_keywords
from nblaunch.notebook.views import TextView
from nblaunch.options import LaunchOptions, format_line_prefix


def launch(function, args=(), n=2, *accelerate_args, **kwargs):
    kwargs.setdefault("display", "none")
    return notebook_launcher(function, args, n, *accelerate_args, device_type="cpu", **kwargs)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_keyword_of_accelerates_notebook_launcher_is_accepted():
    accelerate = pytest.importorskip("accelerate")
    theirs = inspect.signature(accelerate.notebook_launcher).parameters
    ours = inspect.signature(notebook_launcher).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)


def test_accelerates_positional_order_after_num_processes_works_as_in_accelerate(monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    theirs = list(inspect.signature(accelerate.notebook_launcher).parameters)
    assert theirs[3:] == list(accelerate_keywords.POSITIONAL)  # the order this maps
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    port = free_port()

    def seen():
        import torch.distributed as dist

        print(f"hello from {dist.get_rank()}")
        return os.environ["ACCELERATE_MIXED_PRECISION"], os.environ["MASTER_PORT"]

    # Accelerate's own call, every value by position (its defaults, a port, a line prefix).
    values = notebook_launcher(
        seen, (), 2, "fp16", str(port), "127.0.0.1", 0, 1, "static", "", None, "none", 0, 0.1,
        "[${rank}]: ", device_type="cpu", display="text",
    )  # fmt: skip
    assert values == [("fp16", str(port))] * 2
    assert "[1]: hello from 1\n" in out.getvalue()
    # The issue's call: mixed_precision by position.
    assert launch(lambda: os.environ["ACCELERATE_MIXED_PRECISION"], (), 2, "no") == ["no"] * 2
    # A value that has no meaning here is refused as its keyword would be.
    with pytest.raises(LaunchError, match="node_rank=1: "):
        launch(print, (), 2, "no", "29500", "127.0.0.1", 1, 2)


def test_more_positional_arguments_than_accelerate_takes_or_one_given_twice_is_a_type_error():
    with pytest.raises(TypeError, match=r"at most 15 positional arguments, as Accelerate's"):
        launch(print, (), 2, *([None] * 13))
    with pytest.raises(TypeError, match="multiple values for argument 'mixed_precision'"):
        launch(print, (), 2, "fp16", mixed_precision="bf16")
    with pytest.raises(TypeError, match="multiple values for argument 'use_port'"):
        launch(print, (), 2, "no", "29500", use_port="29501")


# --- mixed_precision, use_port ---------------------------------------------------------------


def test_mixed_precision_makes_accelerator_in_the_function_train_in_bf16():
    pytest.importorskip("accelerate")

    def train():
        import torch
        from accelerate import Accelerator

        accelerator = Accelerator()
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        seen = []  # the dtype the inner layer computes in, under Accelerate's autocast
        model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        loss = model(torch.randn(2, 4)).sum()
        accelerator.backward(loss)
        optimizer.step()
        return os.environ["ACCELERATE_MIXED_PRECISION"], accelerator.mixed_precision, str(seen[0])

    expected = ("bf16", "bf16", "torch.bfloat16")
    assert launch(train, mixed_precision="BF16") == [expected, expected]
    # Without the keyword, what the notebook set is left as it is.
    assert "ACCELERATE_MIXED_PRECISION" not in plan_launch(print, 1).rank_env(0)


def test_mixed_precision_refuses_a_mode_accelerate_does_not_know():
    with pytest.raises(LaunchError, match=r"mixed_precision='fp4' is not one of no, fp8, fp16"):
        launch(print, mixed_precision="fp4")


def test_use_port_is_the_master_port_and_may_be_a_string():
    port = free_port()
    assert launch(lambda: os.environ["MASTER_PORT"], use_port=str(port)) == [str(port)] * 2
    with pytest.raises(LaunchError, match="use_port='1' and master_port=2 disagree"):
        launch(print, use_port="1", master_port=2)
    with pytest.raises(LaunchError, match="use_port must be a port number, got 'http'"):
        launch(print, use_port="http")


# --- the rendezvous keywords -----------------------------------------------------------------


def translate(**changes):
    values = dict(
        use_port=None,
        master_port=None,
        node_rank=0,
        num_nodes=1,
        rdzv_backend="static",
        rdzv_endpoint="",
        rdzv_conf=None,
        rdzv_id="none",
        rdzv_timeout=None,
    )
    values.update(changes)
    return accelerate_keywords.translate(**values)


def test_accelerates_defaults_mean_not_given():
    assert translate() == accelerate_keywords.Rendezvous(None, None, None, None)
    meeting = translate(rdzv_backend="c10d", rdzv_endpoint="head:29400", rdzv_id="run7")
    assert (meeting.rdzv_endpoint, meeting.rdzv_id) == ("head:29400", "run7")
    assert translate(rdzv_conf={"join_timeout": 30, "rank": 0}).rdzv_timeout == 30


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"node_rank": 1, "num_nodes": 2}, r"node_rank=1: .* always node 0 .*nblaunch join"),
        ({"rdzv_conf": {"rank": 1}}, r"node_rank=1: "),
        ({"rdzv_backend": "etcd"}, r"rdzv_backend='etcd': .* pass 'static' or 'c10d'"),
        ({"rdzv_conf": {"read_timeout": 5}}, r"rdzv_conf keys \['read_timeout'\] have no meaning"),
        ({"rdzv_conf": {"join_timeout": 5}, "rdzv_timeout": 9}, r"join_timeout=5 .* disagree"),
    ],
)
def test_a_rendezvous_value_with_no_meaning_here_names_the_nblaunch_way(changes, message):
    with pytest.raises(LaunchError, match=message):
        translate(**changes)


def test_the_launcher_refuses_them_before_anything_starts(tmp_path):
    with pytest.raises(LaunchError, match="node_rank=1"):
        launch(print, node_rank=1, num_nodes=2, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(LaunchError, match="max_restarts=1 works on one machine"):
        launch(print, max_restarts=1, num_nodes=2, rdzv_endpoint="127.0.0.1:29400")


# --- monitor_interval, log_line_prefix_template -----------------------------------------------


def test_monitor_interval_reaches_the_plan_and_must_be_positive():
    assert plan_launch(print, 1, LaunchOptions(monitor_interval=0.1)).monitor_interval == 0.1
    with pytest.raises(LaunchError, match="monitor_interval must be a positive number"):
        launch(print, monitor_interval=0)
    assert launch(lambda: 1, monitor_interval=0.5) == [1, 1]


def test_line_prefix_template_takes_torchruns_fields_and_braces():
    assert format_line_prefix("[${role_name}${rank}]:", 3) == "[default3]:"
    assert format_line_prefix("[{rank}|{local_rank}] ", 9, 1) == "[9|1] "
    with pytest.raises(LaunchError, match=r"log_line_prefix_template='\[\$\{node\}\]'"):
        format_line_prefix("[${node}]", 0)


def test_log_line_prefix_template_prefixes_the_text_views_lines(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)

    def hello():
        import torch.distributed as dist

        print(f"hello from {dist.get_rank()}")

    launch(hello, display="text", log_line_prefix_template="[${rank}]: ")
    assert "[0]: hello from 0\n" in out.getvalue() and "[1]: hello from 1\n" in out.getvalue()
    assert "[rank 1]" not in out.getvalue()
    with pytest.raises(LaunchError, match="cannot be filled in"):
        launch(print, display="text", log_line_prefix_template="{oops}")


def test_the_text_view_gives_local_ranks_of_a_multi_node_run():
    out = io.StringIO()
    view = TextView(out, out, line_prefix="${rank}/${local_rank} ", ranks_per_node=4)
    view.handle({"kind": "stream", "rank": 6, "fd": 1, "text": "hi", "carriage": False})
    view.close()
    assert out.getvalue() == "6/2 hi\n"


# --- max_restarts ----------------------------------------------------------------------------


def test_attempts_restart_failures_deaths_and_hangs_until_spent():
    attempts = Attempts(max_restarts=2)
    failure = RootCause(Cause.FAILURE, 1, "boom", exc_type="ValueError")
    assert not attempts.due(None)
    assert not attempts.due(RootCause(Cause.TIMEOUT, 0, "ran out"))
    assert attempts.due(failure) and attempts.due(RootCause(Cause.HANG, 0, "hung"))
    assert attempts.record(failure) == (
        "attempt 1 of 3 ended: rank 1 raised ValueError: boom; starting the run again "
        "(restart 1 of 2)"
    )
    attempts.record(RootCause(Cause.DEATH, 0, "was killed by SIGKILL"))
    assert attempts.restarts == 2 and not attempts.due(failure)
    exc = ValueError("boom")
    attempts.annotate(exc)
    assert exc.__notes__ == [
        "attempt 1 of 3 ended: rank 1 raised ValueError: boom",
        "attempt 2 of 3 ended: rank 0 was killed by SIGKILL",
        "attempt 3 of 3 ended as above: no restarts left",
    ]


def checkpointing_loop(checkpoint_dir):
    """Ten steps; rank 0 saves a checkpoint after each, and both resume from it. Rank 1 fails
    at step 4 of the first attempt, before the step's collective, so step 3 was saved last."""
    import json
    import pathlib
    import time

    import torch.distributed as dist

    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = pathlib.Path(checkpoint_dir) / "checkpoint.json"
    start = json.loads(path.read_text())["step"] + 1 if path.exists() else 0
    for step in range(start, 10):
        if step == 4 and rank == 1 and attempt == 0:
            deadline = time.monotonic() + 10  # rank 0 saves step 3 first, as a slow step would
            while json.loads(path.read_text())["step"] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise ValueError(f"rank 1 failed at step {step}")
        dist.barrier()  # the step's collective: rank 0 waits here for the failed rank 1
        if rank == 0:  # written whole, then renamed: a reader never sees half a file
            path.with_suffix(".tmp").write_text(json.dumps({"step": step}))
            path.with_suffix(".tmp").replace(path)
    return attempt, start


def test_max_restarts_starts_the_run_again_and_a_checkpointing_loop_resumes(tmp_path, capsys):
    results = launch(checkpointing_loop, (str(tmp_path),), max_restarts=2, display="text")
    assert results == [(1, 4), (1, 4)]  # attempt 1 of both ranks resumed after step 3
    err = capsys.readouterr().err
    ended = "nblaunch: attempt 1 of 3 ended: rank 1 raised ValueError: rank 1 failed at step 4"
    assert ended in err
    assert "starting the run again (restart 1 of 2)" in err


def test_the_restart_notice_shows_the_users_frames_and_the_end_line_says_it_restarted(capsys):
    def fails_once():
        import torch.distributed as dist

        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
            raise ValueError("first attempt fails")
        return dist.get_rank()

    assert launch(fails_once, max_restarts=1, display="text") == [0, 1]
    said = capsys.readouterr()
    notice = said.err[said.err.index("nblaunch: attempt 1 of 2 ended") :]
    assert notice.splitlines()[1:3] == [
        "Traceback (most recent call last):",
        f'  File "{__file__}", line {fails_once.__code__.co_firstlineno + 4}, in fails_once',
    ], notice
    assert "worker.py" not in said.err and "_run_task" not in said.err
    assert re.search(r"^nblaunch: finished in [\d.]+ s after 1 restart$", said.out, re.M), said.out


def test_max_restarts_raises_when_spent_with_every_attempts_cause():
    def always_fails():
        import torch.distributed as dist

        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if dist.get_rank() == 1:
            raise ValueError(f"boom in attempt {attempt}")
        dist.barrier()

    with pytest.raises(ValueError, match="boom in attempt 1") as info:
        launch(always_fails, max_restarts=1)
    notes = info.value.__notes__
    assert "attempt 1 of 2 ended: rank 1 raised ValueError: boom in attempt 0" in notes
    assert notes[-1] == "attempt 2 of 2 ended as above: no restarts left"


def test_a_hang_counts_as_a_failure_and_is_restarted():
    def hangs_once():
        import torch.distributed as dist

        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and dist.get_rank() == 0:
            dist.barrier()  # rank 1 returns without it: rank 0 waits for ever
        return attempt

    assert launch(hangs_once, max_restarts=1, hang_timeout=2) == [1, 1]
