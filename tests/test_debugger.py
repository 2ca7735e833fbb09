"""Debugging a rank: breakpoint() prompts, quitting, post-mortems, moving variables.

The prompts are answered as a person would: through the terminal's stdin for a script, through
the kernel's stdin channel (``input_request``) for a notebook.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import assert_no_ranks_left

SCRIPT = textwrap.dedent(
    """
    import sys
    import nblaunch

    def train():
        import torch, torch.distributed as dist
        x = nblaunch.rank() * 10
        nblaunch.breakpoint(rank=1)
        t = torch.tensor([float(x + 1)])
        dist.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        timeout = float(sys.argv[1]) if len(sys.argv) > 1 else None
        print("RESULT", nblaunch.notebook_launcher(
            train, (), 2, device_type="cpu", display="text", timeout=timeout, hang_timeout=1.0
        ))
    """
)


@functools.cache
def pdb_stops_on_the_call() -> bool:
    """Whether this Python's own pdb shows the ``set_trace()`` line itself when it stops there.

    Python 3.13's does (it enters the debugger at once); earlier ones show the next line.
    nblaunch follows the Python it runs on, so a rank shows what plain ``breakpoint()`` would.
    """
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder, "probe.py")  # a file, so that pdb can show its lines
        probe.write_text("import pdb\npdb.set_trace()\nafter = 1\n")
        done = subprocess.run(
            [sys.executable, str(probe)], input="c\n", capture_output=True, text=True, timeout=60
        )
    shown = [line for line in done.stdout.splitlines() if line.startswith("-> ")]
    assert shown in (["-> pdb.set_trace()"], ["-> after = 1"]), done.stdout
    assert (shown == ["-> pdb.set_trace()"]) == (sys.version_info >= (3, 13)), done.stdout
    return shown == ["-> pdb.set_trace()"]


def stop_line(call: str, after: str) -> str:
    """The ``-> `` line a rank shows when it stops at ``call`` (``after`` is the next line)."""
    return f"-> {call if pdb_stops_on_the_call() else after}"


def run_script(
    tmp_path, answers: list[str], *args: str, answer_after: float = 0.0, source: str = SCRIPT
):
    """Run ``source`` in a terminal-like subprocess, typing ``answers`` ``answer_after`` s
    apart (the first one too)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    assert process.stdin is not None
    for answer in answers:
        time.sleep(answer_after)
        process.stdin.write(answer + "\n")
        process.stdin.flush()
    out, _ = process.communicate(timeout=120)
    return process.returncode, out


def test_breakpoint_on_one_rank_prompts_in_the_terminal_and_continues(tmp_path):
    code, out = run_script(tmp_path, ["p x", "p x + 100", "c"])
    assert code == 0, out
    # what this Python's pdb shows: the breakpoint line (3.13+) or the line after it
    assert stop_line("nblaunch.breakpoint(rank=1)", "t = torch.tensor([float(x + 1)])") in out
    assert out.count("[rank 1] (Pdb) ") == 3 and "[rank 0] (Pdb)" not in out
    assert "\n10\n" in out.replace("(Pdb) ", "\n") and "110" in out
    assert "RESULT [12.0, 12.0]" in out


def test_time_in_the_debugger_is_neither_a_hang_nor_a_timeout(tmp_path):
    # hang_timeout=1 s and timeout=2 s, and the person takes 2.5 s to answer each prompt
    # while rank 0 waits in all_reduce.
    code, out = run_script(tmp_path, ["p x", "c"], "2", answer_after=2.5)
    assert code == 0, out
    assert "RESULT [12.0, 12.0]" in out
    assert "DistributedHangError" not in out and "LaunchTimeoutError" not in out


def test_quitting_the_debugger_ends_the_run_on_every_rank(tmp_path):
    code, out = run_script(tmp_path, ["q"])
    assert code != 0
    assert (
        "RankFailedError: rank 1 of 2 quit the debugger (q); the run was stopped on every rank"
        in out
    )
    assert "RESULT [" not in out
    assert_no_ranks_left(5)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """One kernel for the notebook tests, with the extension loaded."""
    from conftest import Kernel

    kernel = Kernel(tmp_path_factory.mktemp("debugger"))
    kernel.run("%load_ext nblaunch")
    yield kernel
    kernel.close()


def test_breakpoint_in_a_cell_prompts_in_the_notebook(notebook):
    cell = notebook.run(
        "%%distributed -n 2\nimport nblaunch, torch, torch.distributed as dist\n"
        "x = rank * 10\nnblaunch.breakpoint(rank=1)\ny = torch.tensor([x + 1.0])\n"
        "dist.all_reduce(y)\ny.item()",
        answers=["p x", "c"],
    )
    assert cell["error"] is None, cell
    assert cell["prompts"] == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    assert stop_line("nblaunch.breakpoint(rank=1)", "y = torch.tensor([x + 1.0])") in cell["out"]
    assert "\n10\n" in cell["out"]
    assert cell["result"] == "12.0"  # rank 1 went on, and met rank 0 in the all_reduce


def test_every_rank_s_breakpoint_takes_its_turn_and_q_stops_the_run(notebook):
    cell = notebook.run(
        "%%distributed -n 2\nx = rank\nbreakpoint()\nprint('after', x)", answers=["q", "q"]
    )
    assert cell["error"] == "RankFailedError"
    assert "quit the debugger (q); the run was stopped on every rank" in cell["message"]
    assert sorted(cell["prompts"])[0].startswith("[rank 0]") or len(cell["prompts"]) == 1
    assert all(p.endswith("(Pdb) ") for p in cell["prompts"])


def test_without_stdin_a_breakpoint_goes_on(notebook):
    cell = notebook.run(
        "%%distributed -n 2\nimport torch, torch.distributed as dist\nbreakpoint()\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert cell["error"] is None, cell
    assert cell["out"].count("nothing here can answer the debugger (no input); continuing") == 2
    assert cell["result"] == "2.0"


def test_pdb_option_opens_a_post_mortem_before_the_failure_is_reported(notebook):
    cell = notebook.run(
        "%%distributed -n 2 --pdb\nz = 5 + rank\nif rank == 1:\n    raise ValueError('boom')",
        answers=["p z", "c"],
    )
    assert cell["error"] == "ValueError" and cell["message"] == "boom"
    assert cell["prompts"] == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    assert "post-mortem of ValueError: boom" in cell["out"]
    assert "-> raise ValueError('boom')" in cell["out"] and "\n6\n" in cell["out"]


def test_the_interrupt_button_works_at_a_pools_debugger_prompt(notebook):
    # Fault sweep case 5: pressed twice at a pool's (Pdb) prompt, the interrupt did nothing;
    # only typing an answer freed the kernel. One-shot launches stopped at once.
    assert notebook.run("%dist start -n 2")["error"] is None
    try:
        notebook.run("%%distributed\nkept = rank + 1")
        cell = notebook.run(
            "%%distributed\nimport nblaunch\nnblaunch.breakpoint(rank=1)\nrank",
            answers=[],
            answer_after=None,  # nobody answers: the person presses the interrupt button
            interrupt_after=3.0,
            timeout=30,
        )
        assert cell["prompts"] == ["[rank 1] (Pdb) "]
        assert cell["error"] == "KeyboardInterrupt", cell
        assert cell["seconds"] - cell["interrupted_at"] < 6.0
        # The pool is ready, with its names: the rank in the debugger was interrupted too.
        assert notebook.run("%%distributed\nkept")["result"] == "1"
    finally:
        notebook.run("%dist stop")


def test_q_in_a_pools_debugger_while_a_peer_waits_in_a_collective_keeps_the_names(notebook):
    # Fault sweep case 2: the pool was restarted and every name lost, said only in a note.
    assert notebook.run("%dist start -n 2")["error"] is None
    try:
        made = notebook.run(
            "%%distributed\nimport torch, torch.distributed as dist, nblaunch\n"
            "model = torch.nn.Linear(3, 2)"
        )
        assert made["error"] is None, made
        cell = notebook.run(
            "%%distributed\nt = torch.ones(2)\nnblaunch.breakpoint(rank=0)\ndist.all_reduce(t)",
            answers=["q"],
            timeout=30,
        )
        assert cell["prompts"] == ["[rank 0] (Pdb) "]
        assert cell["error"] == "RankFailedError", cell
        assert cell["message"].startswith("rank 0 of 2 quit the debugger (q)")
        said = "\n".join(cell["traceback"])
        assert "rank 0 issued torch.distributed.all_reduce (cell line 4)" in said, said
        assert "which rank 1 waited in; rank 1 was stopped there, its names kept" in said
        assert cell["seconds"] < 3.0, cell  # no wait for a restart
        after = notebook.run(
            "%%distributed\nnames = [None] * world_size\n"
            "dist.all_gather_object(names, type(model).__name__)\n"
            "s = torch.tensor([rank + 1.0])\ndist.all_reduce(s)\n(names, s.item())"
        )
        assert after["result"] == "(['Linear', 'Linear'], 3.0)", after
        assert "restarts: 0" in notebook.run("%dist status")["out"]
    finally:
        notebook.run("%dist stop")


def test_pool_post_mortem_and_variables_between_kernel_and_ranks(notebook):
    assert notebook.run("%dist start -n 2")["error"] is None
    try:
        failed = notebook.run(
            "%%distributed\nimport torch\nw = torch.ones(2) * rank\nq = 7\n"
            "if rank == 1:\n    raise KeyError('k')"
        )
        assert failed["error"] == "KeyError"
        debug = notebook.run("%dist debug", answers=["p q + rank", "c"])
        assert debug["error"] is None, debug
        assert "post-mortem of KeyError: 'k'" in debug["out"] and "\n8\n" in debug["out"]
        assert debug["prompts"] == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]

        pulled = notebook.run("%dist pull w --rank 1\nprint(type(w).__name__, w.tolist())")
        assert "Tensor [1.0, 1.0]" in pulled["out"], pulled
        notebook.run("v = 41\n%dist push v")
        assert notebook.run("%%distributed\nv + rank")["result"] == "41"
        assert notebook.run("%%distributed --ranks 1\nv + rank")["result"] == "42"

        missing = notebook.run("%dist pull nope")
        assert missing["error"] == "NameError"
        assert "rank 0 has no name 'nope' (its names:" in missing["message"]
        # A %dist command's UsageError is printed, as IPython prints a magic's usage errors.
        locked = notebook.run("import threading\nlk = threading.Lock()\n%dist push lk")
        assert "UsageError: lk (a _thread.lock) cannot be sent to the ranks" in locked["out"]
        # ... and so is a rank's value that cannot come back (fault sweep case 11: TypeError).
        notebook.run("%%distributed\nimport threading\nrank_lock = threading.Lock()")
        pulled_lock = notebook.run("%dist pull rank_lock")
        assert pulled_lock["error"] is None, pulled_lock
        assert "UsageError: %dist pull: " in pulled_lock["out"]
        assert "lock that cannot be pickled back to the notebook" in pulled_lock["out"]
        undefined = notebook.run("%dist push undefined_name")["out"]
        assert "UsageError: %dist push: the notebook has no variable 'undefined_name'" in undefined
        # The ranks still work after all that.
        assert notebook.run("%%distributed --ranks 1\nv + rank")["result"] == "42"
        nothing = notebook.run("%dist debug")["out"]
        assert "UsageError: %dist debug: the last cell did not fail with an exception" in nothing
    finally:
        notebook.run("%dist stop")


DDP_SCRIPT = textwrap.dedent(
    """
    import nblaunch

    def train():
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            loss = model(torch.ones(8, 4) * (nblaunch.rank() + 1)).pow(2).mean()
            if step == 2:
                nblaunch.breakpoint(rank=1)  # rank 0 meanwhile waits in DDP's backward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().sum().item() for p in model.parameters()]

    if __name__ == "__main__":
        print("RESULT", nblaunch.notebook_launcher(
            train, (), 2, device_type="cpu", display="text", hang_timeout=1.0
        ))
    """
)


def test_breakpoint_inside_ddp_training_waits_for_the_person_and_trains_on(tmp_path):
    # Answered 3 s late: longer than hang_timeout, while rank 0 waits in DDP's all-reduce.
    code, out = run_script(
        tmp_path, ["p step, round(loss.item(), 3) > 0"], answer_after=3.0, source=DDP_SCRIPT
    )
    assert code == 0, out
    assert "(2, True)" in out
    result = next(line for line in out.splitlines() if line.startswith("RESULT"))
    weights = ast.literal_eval(result.removeprefix("RESULT "))
    assert weights[0] == weights[1]  # both ranks took every step together
