"""What a notebook shows, and keeps once saved, when real distributed code fails (issue 56).

One notebook, run by nbclient in a real kernel on 2 CPU ranks, saved and read back: the
tracebacks of a mismatch and of a hang end at the user's line, not in nblaunch; a collective
that Accelerate issued is named at the user's call through Accelerate's line; an out-of-memory
error that Accelerate's ``find_executable_batch_size`` caught on one rank is named as the cause
of the mismatch that follows; a rank that destroyed its group is counted with what it issued;
the out-of-memory retries of nblaunch's own finder stay in the saved summary; a rank that
crashed while being stopped is shown as crashed; a launch of one rank is worded for one.
"""

from __future__ import annotations

import json
import re
import time

import nbformat
import pytest

CELLS = {
    "setup": "import os\n"
    "os.environ['ACCELERATE_USE_CPU'] = '1'\n"
    "from nblaunch import notebook_launcher\n",
    "gather": "def gather_predictions():\n"
    "    import torch\n"
    "    from accelerate import Accelerator\n"
    "    accelerator = Accelerator(cpu=True)\n"
    "    predictions = torch.zeros(4 if accelerator.process_index == 0 else 3, 2)\n"
    "    gathered = accelerator.gather(predictions)\n"
    "    return gathered.shape\n"
    "\n"
    "notebook_launcher(gather_predictions, num_processes=2)\n",
    "hang": "def wait_alone():\n"
    "    import torch.distributed as dist\n"
    "    import nblaunch\n"
    "    if nblaunch.rank() == 0:\n"
    "        dist.barrier()\n"
    "    return 1\n"
    "\n"
    "notebook_launcher(wait_alone, num_processes=2)\n",
    "destroyed": "def clean_up_early():\n"
    "    import torch\n"
    "    import torch.distributed as dist\n"
    "    import nblaunch\n"
    "    for _ in range(100):\n"
    "        dist.all_reduce(torch.ones(1))\n"
    "    if nblaunch.rank() == 1:\n"
    "        dist.destroy_process_group()  # the DDP tutorial's cleanup()\n"
    "        return 0\n"
    "    dist.all_reduce(torch.ones(1))\n"
    "    return 1\n"
    "\n"
    "notebook_launcher(clean_up_early, num_processes=2)\n",
    "accelerate_oom": "def accelerate_finder():\n"
    "    import torch\n"
    "    from accelerate import Accelerator\n"
    "    from accelerate.utils import find_executable_batch_size\n"
    "    accelerator = Accelerator(cpu=True)\n"
    "\n"
    "    @find_executable_batch_size(starting_batch_size=32)\n"
    "    def train(batch_size):\n"
    "        if accelerator.process_index == 1 and batch_size > 8:\n"
    "            torch.empty(batch_size * 10**12, dtype=torch.uint8)  # a real out-of-memory\n"
    "        return accelerator.reduce(torch.ones(batch_size)).shape\n"
    "\n"
    "    return train()\n"
    "\n"
    "notebook_launcher(accelerate_finder, num_processes=2)\n",
    "nblaunch_oom": "def nblaunch_finder():\n"
    "    import torch\n"
    "    import torch.distributed as dist\n"
    "    import nblaunch\n"
    "\n"
    "    @nblaunch.find_executable_batch_size(starting_batch_size=32)\n"
    "    def train(batch_size):\n"
    "        dist.all_reduce(torch.ones(1))\n"
    "        if nblaunch.rank() == 1 and batch_size > 8:\n"
    "            torch.empty(batch_size * 10**12, dtype=torch.uint8)\n"
    "        dist.all_reduce(torch.ones(batch_size))\n"
    "        return batch_size\n"
    "\n"
    "    return train()\n"
    "\n"
    "notebook_launcher(nblaunch_finder, num_processes=2)\n",
    "crashed": "def crash_when_stopped():\n"
    "    import os, signal, sys, time\n"
    "    import torch.distributed as dist\n"
    "    import nblaunch\n"
    "    def abort(*_):\n"
    "        print('rank 1 aborts in its clean-up', file=sys.stderr, flush=True)\n"
    "        os.abort()  # as gloo aborts a rank whose peer went away\n"
    "    if nblaunch.rank() == 1:\n"
    "        signal.signal(signal.SIGTERM, abort)  # before rank 0 can raise\n"
    "    dist.barrier()\n"
    "    if nblaunch.rank() == 0:\n"
    "        raise ValueError('boom on rank 0')\n"
    "    time.sleep(30)\n"
    "\n"
    "notebook_launcher(crash_when_stopped, num_processes=2)\n",
    "one_rank": "os.environ.pop('ACCELERATE_USE_CPU')  # nblaunch sets it for CPU ranks\n"
    "\n"
    "def one():\n"
    "    import time\n"
    "    time.sleep(1)  # the live view shows runs that last over 0.2 s\n"
    "    return 1\n"
    "\n"
    "notebook_launcher(one, num_processes=1, device_type='cpu')\n",
}


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """The notebook, executed in a real kernel and saved; its cells by name, and the file."""
    from nbclient import NotebookClient

    pytest.importorskip("accelerate")  # the compat extra (make test installs it)
    directory = tmp_path_factory.mktemp("failure-story")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS.values()]
    NotebookClient(
        notebook,
        timeout=180,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(directory)}},
    ).execute()
    path = directory / "story.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    return dict(zip(CELLS, saved.cells, strict=True)), path.read_text()


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _error(cell) -> nbformat.NotebookNode:
    (error,) = [o for o in cell.outputs if o.output_type == "error"]
    return error


def _traceback(cell) -> str:
    return _plain("\n".join(_error(cell).traceback))


def _summary(cell) -> str:
    """The summary a saved notebook keeps (text/plain), as a reader without widgets sees it."""
    return "\n".join(
        o.data["text/plain"]
        for o in cell.outputs
        if o.output_type == "display_data" and o.data.get("text/plain", "").startswith("nblaunch:")
    )


@pytest.mark.slow
def test_a_mismatchs_traceback_ends_at_the_users_call_through_accelerate(story):
    cells, _ = story
    error = _error(cells["gather"])
    assert error.ename == "DistributedOperationException"
    text = _traceback(cells["gather"])
    assert "nblaunch/" not in text, text  # nothing of nblaunch's inside
    # The user's launch, then the user's own line on the rank, last.
    last_frame = text[text.rindex("Cell In[") :]
    assert last_frame.startswith("Cell In[2], line 6, in gather_predictions()"), text
    assert "----> 6     gathered = accelerator.gather(predictions)" in last_frame
    # The call site: the user's line, through Accelerate's.
    assert "  - Process 0: cell line 6, through accelerate/utils/operations.py:" in error.evalue, (
        error.evalue
    )
    assert "  - Process 1: cell line 6, through accelerate/utils/operations.py:" in error.evalue


@pytest.mark.slow
def test_a_hangs_traceback_ends_at_the_waiting_ranks_line(story):
    cells, _ = story
    assert _error(cells["hang"]).ename == "DistributedHangError"
    text = _traceback(cells["hang"])
    assert "File /" not in text.split("DistributedHangError:")[1].split("Stacks")[0]
    frames = text.split("DistributedHangError: ")[0]
    assert "nblaunch/" not in frames, frames
    assert frames.rstrip().endswith("----> 5         dist.barrier()\n      6     return 1"), frames


@pytest.mark.slow
def test_a_rank_that_destroyed_its_group_is_counted_with_what_it_issued(story):
    cells, _ = story
    error = _error(cells["destroyed"])
    assert error.ename == "DistributedHangError"
    assert "rank 1 returned after 100 collectives" in error.evalue, error.evalue
    assert "Rank 1 issued 1 fewer collective than rank 0 had" in error.evalue
    assert " 0 collectives" not in error.evalue


@pytest.mark.slow
def test_out_of_memory_under_accelerates_finder_is_named_as_the_cause(story):
    cells, _ = story
    error = _error(cells["accelerate_oom"])
    first = error.evalue.splitlines()[0]
    assert first.startswith(
        "rank 1 of 2 ran out of memory at batch_size=32: Accelerate's find_executable_batch_size "
        "caught it and retried that rank alone with a smaller batch (out of memory again at 28, "
        "25, 22, 19, 17, 15, 13, 11, 9) while rank 0 went on"
    ), error.evalue
    assert "DefaultCPUAllocator: can't allocate memory" in error.evalue
    assert "Fix: use nblaunch's find_executable_batch_size" in error.evalue
    assert "Input shapes:\n  - Process 0: [32]\n  - Process 1: [8]" in error.evalue
    # The saved summary names it too, and keeps the story.
    summary = _summary(cells["accelerate_oom"])
    assert "error: rank 1 of 2 ran out of memory at batch_size=32" in summary
    assert (
        "rank 1: out of memory at batch_size=32, 28, 25, 22, 19, 17, 15, 13, 11, 9, caught by "
        "Accelerate's find_executable_batch_size, which retries this rank alone"
    ) in summary, summary


@pytest.mark.slow
def test_the_saved_summary_keeps_nblaunchs_out_of_memory_retries(story):
    cells, _ = story
    cell = cells["nblaunch_oom"]
    assert not [o for o in cell.outputs if o.output_type == "error"]
    summary = _summary(cell)
    assert "32 x (rank 1: out of memory; all ranks restarted)" in summary, summary
    assert "-> 8 ok" in summary, summary
    assert "-> 8 ...\n" not in summary + "\n"  # the restart's line, told again when it ended
    assert "batch 8 per rank x 2 ranks = 16 effective" in summary, summary


@pytest.mark.slow
def test_a_rank_that_crashed_while_stopped_is_shown_as_crashed(story):
    cells, _ = story
    cell = cells["crashed"]
    assert _error(cell).ename == "ValueError"
    summary = _summary(cell)
    assert re.search(
        r"rank 1: FAILED · was killed by SIGABRT \(aborted, often a failed assertion in C\+\+ "
        r"code\); its last output: rank 1 aborts in its clean-up",
        summary,
    ), summary
    assert "STOPPED" not in summary
    assert "rank 1 was killed by SIGABRT" in _error(cell).evalue + "\n".join(_error(cell).traceback)


@pytest.mark.slow
def test_one_rank_is_worded_for_one(story):
    cells, saved = story
    assert [o.data["text/plain"] for o in cells["one_rank"].outputs if "data" in o][-1] == "[1]"
    assert "all 1 ranks" not in saved
    shown = json.dumps(json.loads(saved)["metadata"].get("widgets", {}))
    assert "ACCELERATE_USE_CPU=1 set so Accelerate and Transformers use the CPU" in shown


@pytest.mark.slow
def test_the_first_launch_of_a_fresh_kernel_shows_its_view_at_once(tmp_path):
    """Right after ``%load_ext nblaunch`` the ranks' process server still imports torch: the
    view shows, saying so, instead of a blank cell until the ranks run (5-7 s before)."""
    from conftest import Kernel

    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext nblaunch")
        msg_id = kernel.client.execute(
            "from nblaunch import notebook_launcher\n"
            "def f():\n"
            "    return 1\n"
            "notebook_launcher(f, num_processes=2)\n"
        )
        began, shown, said, ended = time.monotonic(), None, None, None
        while ended is None and time.monotonic() - began < 120:
            message = kernel.client.get_iopub_msg(timeout=120)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            now = time.monotonic() - began
            if shown is None and message["msg_type"] in ("comm_open", "display_data"):
                shown = now
            if said is None and "import torch" in json.dumps(message["content"]):
                said = now
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                ended = now
    finally:
        kernel.close()
    assert ended is not None and said is not None, (shown, said, ended)
    # Shown while the ranks were still starting: well before the cell ended.
    assert shown <= said < ended / 2, (shown, said, ended)
