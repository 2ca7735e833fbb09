"""The live view in a real Jupyter kernel: the quick-start notebook, and the Stop button."""

from __future__ import annotations

import importlib.util
import queue
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest
from conftest import RANKS_LEFT_CODE, ROOT, WIDGET_STATE, WIDGET_VIEW, load_run_notebook

QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
# What the notebook's last cell shows; the README's quick start shows it too (test_examples.py).
TOTAL_SHOWN = "tensor([3.])"


run_notebook = load_run_notebook()


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[nbformat.NotebookNode, Path]:
    """The quick-start notebook executed once in a real kernel, in a scratch directory."""
    workdir = tmp_path_factory.mktemp("quickstart")
    path = workdir / "quickstart.ipynb"
    shutil.copy(QUICKSTART, path)
    notebook = nbformat.read(path, as_version=4)
    if importlib.util.find_spec("nblaunch.notebook.magics") is None:
        # The magics arrive with their own issue; the view is what this file tests.
        for cell in notebook.cells:
            cell.source = cell.source.replace("%load_ext nblaunch\n", "")
    run_notebook.execute(notebook, path, timeout=240)
    return notebook, workdir


def _outputs(notebook: nbformat.NotebookNode) -> list[tuple[int, dict]]:
    return [(i, out) for i, cell in enumerate(notebook.cells) for out in cell.get("outputs", [])]


def _launch_cell(notebook: nbformat.NotebookNode) -> int:
    return next(i for i, c in enumerate(notebook.cells) if "notebook_launcher(" in c.source)


def _cell(notebook: nbformat.NotebookNode, start: str) -> int:
    return next(i for i, c in enumerate(notebook.cells) if c.source.startswith(start))


@pytest.mark.slow
def test_quickstart_runs_and_leaves_a_summary(executed):
    notebook, workdir = executed
    outputs = _outputs(notebook)
    assert not [out for _, out in outputs if out.output_type == "error"]
    launch = _launch_cell(notebook)
    # Everything the run shows lands in the cell that launched it (the cells after it are the
    # `%%distributed` example, checked below).
    assert {i for i, out in outputs if out.output_type != "stream" and i <= launch} == {launch}
    cell_outputs = [out for i, out in outputs if i == launch]
    views = [out for out in cell_outputs if WIDGET_VIEW in out.get("data", {})]
    assert len(views) == 1
    summary = next(
        out.data
        for out in cell_outputs
        if out.output_type == "display_data" and "text/html" in out.get("data", {})
    )
    text = summary["text/plain"]
    assert text.startswith("nblaunch: finished in ")
    assert "rank 0: DONE · returned" in text and "rank 1: DONE · returned" in text
    run_dir = re.search(r"logs: (.+)", text).group(1)
    assert ">DONE<" in summary["text/html"] and "rank1.log" in summary["text/html"]
    result = next(out for out in cell_outputs if out.output_type == "execute_result")
    assert result.data["text/plain"] == "[64.0, 64.0]"
    # Every line is on disk too.
    log1 = (workdir / run_dir / "rank1.log").read_text()
    assert "rank 1 step 7: all_reduce -> 15" in log1 and "quickstart: rank 1 done" in log1


@pytest.mark.slow
def test_quickstart_distributed_cell_brings_rank_0s_total_back(executed):
    notebook, _ = executed
    cell = notebook.cells[_cell(notebook, "%%distributed")]
    assert not [out for out in cell.outputs if out.output_type == "error"]
    # The `total` cell shows rank 0's all-reduced tensor: 1 + 2 on 2 ranks.
    result = notebook.cells[_cell(notebook, "total")].outputs
    assert [out.data["text/plain"] for out in result] == [TOTAL_SHOWN]


@pytest.mark.slow
def test_saved_widget_state_shows_both_ranks_done_and_their_lines(executed):
    notebook, _ = executed
    state = notebook.metadata["widgets"][WIDGET_STATE]["state"]
    view_id = next(
        out.data[WIDGET_VIEW]["model_id"]
        for _, out in _outputs(notebook)
        if WIDGET_VIEW in out.get("data", {})
    )
    assert state[view_id]["model_name"] == "VBoxModel"
    values = [m["state"].get("value", "") for m in state.values() if m["model_name"] == "HTMLModel"]
    badges = next(v for v in values if "nbl-ranks" in v)
    assert "rank 0 · DONE" in badges and "rank 1 · DONE" in badges
    head = next(v for v in values if "nbl-head" in v)
    assert "2 ranks" in head and "finished</b>" in head
    tabs = next(m["state"] for m in state.values() if m["model_name"] == "TabModel")
    assert tabs["titles"] == ["All ranks", "rank 0", "rank 1"]
    everything, rank0, rank1 = (
        state[ref.removeprefix("IPY_MODEL_")]["state"]["value"] for ref in tabs["children"]
    )
    for step in range(8):
        assert f"rank 0 step {step}:" in rank0 and f"rank 1 step {step}:" in rank1
        assert f"rank 0 step {step}:" in everything and f"rank 1 step {step}:" in everything
    assert "rank 1 step" not in rank0
    # The progress bar redrew one line: only its last state is left, once per rank.
    assert rank1.count("evaluating ########## 100%") == 1
    assert "10%" not in rank1 and everything.count("evaluating ########## 100%") == 2


@pytest.mark.slow
def test_make_demo_prints_what_the_view_showed(executed):
    notebook, _ = executed
    shown = run_notebook.describe(notebook)
    assert "[live rank view (widget)], its All ranks log:" in shown
    assert "  [1] rank 1 step 7: all_reduce -> 15" in shown.splitlines()
    assert "  [0] rank 0 step 7: all_reduce -> 15" in shown.splitlines()
    assert "rank 1: DONE · returned" in shown


# --- the Stop button, clicked while the launcher keeps the kernel's main thread busy -------------

STOP_CODE = """
import os, psutil, time
from nblaunch import notebook_launcher

def work():
    import time
    from nblaunch import rank
    for i in range(3000):
        print(f"rank {rank()} tick {i}", flush=True)
        time.sleep(0.05)
    return "never"

notebook_launcher(work, num_processes=2, display="auto")
"""


class _Kernel:
    """A real ipykernel, driven message by message like a frontend."""

    def __init__(self, cwd: Path) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd))

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def messages(self, msg_id: str, timeout: float):
        """Yield iopub messages until ``msg_id``'s cell is idle or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                yield None
                continue
            yield msg
            if (
                msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id
            ):
                return
        raise AssertionError(f"the cell did not finish within {timeout} s")

    def click(self, comm_id: str) -> None:
        """What JupyterLab sends when a Button is clicked."""
        content = {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        self.client.shell_channel.send(self.client.session.msg("comm_msg", content))


@pytest.mark.slow
def test_stop_button_interrupts_every_rank_while_the_cell_runs(tmp_path):
    kernel = _Kernel(tmp_path)
    try:
        msg_id = kernel.client.execute(STOP_CODE)
        stop_id = clicked_at = finished_at = None
        errors = []
        view_updates = 0
        for msg in kernel.messages(msg_id, timeout=120):
            if msg is None:
                pass
            elif msg["msg_type"] == "comm_open":
                state = msg["content"]["data"]["state"]
                if state.get("_model_name") == "ButtonModel" and state["description"] == "Stop":
                    stop_id = msg["content"]["comm_id"]
                    opened_at = time.monotonic()
            elif msg["msg_type"] == "comm_msg":
                view_updates += 1
            elif msg["msg_type"] == "error":
                errors.append(msg["content"]["ename"])
                finished_at = time.monotonic()
            # Click once the ranks have been printing for a while (the view keeps updating).
            if stop_id and clicked_at is None and time.monotonic() - opened_at > 4:
                assert view_updates > 5, "the view should be updating while the cell runs"
                kernel.click(stop_id)
                clicked_at = time.monotonic()
        assert clicked_at is not None, "the view never showed a Stop button"
        assert errors == ["KeyboardInterrupt"]
        assert finished_at - clicked_at < 10.0  # the interrupt escalates within a few seconds
        # No rank is left behind, and a later cell gets nothing from the stopped run.
        msg_id = kernel.client.execute(RANKS_LEFT_CODE)
        later = [m for m in kernel.messages(msg_id, timeout=30) if m is not None]
        later = [m for m in later if m["parent_header"].get("msg_id") == msg_id]
        streams = [m["content"]["text"] for m in later if m["msg_type"] == "stream"]
        assert streams == ["[]\n"]
        assert not [m for m in later if m["msg_type"] in ("display_data", "comm_msg", "error")]
    finally:
        kernel.close()
