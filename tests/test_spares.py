"""Spare ranks (``nblaunch.engine.processes.spares``): a notebook's next launch takes processes
forked ahead.

In a real kernel, as a notebook runs the same cell again and again. Spares for an accelerator make
their device's context ahead (``nblaunch.ranks.device.warm_up``): tested on the test accelerator
``fakeacc`` (tests/devices/fake_accelerator.py), whose device module records each pin, by which
thread, on which physical device (``FAKEACC_VISIBLE_DEVICES`` plays ``CUDA_VISIBLE_DEVICES``,
latched at the first pin as CUDA latches it at its start) and when, in a log file.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from nblaunch.engine.processes import spares
from nblaunch.ranks.device import warm_up

DEVICES = Path(__file__).resolve().parent / "devices"

SPARE_PIDS = "from nblaunch.engine.processes import spares\nprint(sorted(spares.pids()))"


def _pids(kernel) -> list[int]:
    cell = kernel.run(SPARE_PIDS)
    assert cell["error"] is None, cell
    text = cell["out"].strip()[1:-1]
    return [int(p) for p in text.split(",")] if text else []


def test_the_next_launch_runs_on_spares_brought_up_to_the_notebooks_state(kernel):
    assert kernel.run("%load_ext nblaunch")["error"] is None
    assert kernel.run("%%distributed -n 2\npass", timeout=120)["error"] is None
    spares = _pids(kernel)
    assert len(spares) == 2 and all(psutil.pid_exists(p) for p in spares)

    # Set after the spares were forked: the set-up message must bring them up to date.
    kernel.run("import os\nos.environ['FOO'] = 'set later'")
    cell = kernel.run(
        "%%distributed -n 2 -o seen\nimport os, threading, torch.distributed as dist\n"
        "from nblaunch.ranks.device import warm_up\n"
        "seen = [None, None]\n"
        "threads = [t.name for t in threading.enumerate()]\n"
        "dist.all_gather_object(seen, (os.getpid(), os.environ.get('FOO'), warm_up.report(),"
        " warm_up.THREAD_NAME in threads))"
    )
    assert cell["error"] is None, cell
    seen = eval(kernel.run("seen")["result"])
    assert sorted(pid for pid, *_ in seen) == spares
    assert [foo for _, foo, *_ in seen] == ["set later", "set later"]
    # CPU spares warm nothing up: no plan, no thread.
    assert [rest for _, _, *rest in seen] == [[None, False], [None, False]]
    assert kernel.run("print(spares.warmed())")["out"].strip() == "None"

    # A launch of another size lets the waiting spares go; they exit.
    waiting = _pids(kernel)
    assert waiting and not set(waiting) & set(spares)
    assert kernel.run("%%distributed -n 3\npass")["error"] is None
    assert wait_until(lambda: not any(_alive(p) for p in waiting), timeout=5)
    assert len(_pids(kernel)) == 3

    # A failed launch leaves spares too, and the spares survive nothing of it.
    cell = kernel.run("%%distributed -n 3\nraise ValueError('boom')")
    assert cell["error"] == "ValueError"
    left = _pids(kernel)
    assert len(left) == 3
    kernel.close()  # the kernel's death ends the spares that waited for it
    assert wait_until(lambda: not any(_alive(p) for p in left), timeout=5)


SETUP_FAKEACC = """
import os, sys, time
sys.path.insert(0, {devices!r})
os.environ["NBLAUNCH_DEVICE_MODULES"] = "fake_accelerator"
os.environ["FAKEACC_LOG"] = {log!r}
import nblaunch, nblaunch.engine.processes.spares

def where():
    import os, fake_accelerator, nblaunch
    from nblaunch.ranks.device import warm_up
    record = fake_accelerator.RECORD
    return {{
        "pid": os.getpid(),
        "device": str(nblaunch.device()),
        "physical": record["physical"],
        "by": record["set_device_by"],
        "warm": warm_up.report(),
    }}

def launch():
    began = time.time()
    values = nblaunch.notebook_launcher(where, num_processes=2, device_type="fakeacc",
                                        display="none")
    print(repr((began, values)))
"""


def _launch(kernel) -> tuple[float, list[dict]]:
    cell = kernel.run("launch()", timeout=120)
    assert cell["error"] is None, cell
    return eval(cell["out"].strip().splitlines()[-1])  # the last line: after any warning


def _warmed(log: Path, pids: list[int]) -> dict[int, list[tuple[int, int, str, float]]]:
    """What the log says each of ``pids`` pinned: (index, physical device, thread, time)."""
    pins: dict[int, list] = {pid: [] for pid in pids}
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, index, physical, thread, at = line.split()
        if int(pid) in pins:
            pins[int(pid)].append((int(index), int(physical), thread, float(at)))
    return pins


def _wait_warmed(kernel, log: Path) -> list[int]:
    """The spares waiting now, once each has pinned its device in its warm-up thread."""
    pids = _pids(kernel)
    assert len(pids) == 2
    assert wait_until(lambda: all(_warmed(log, pids).values()), timeout=30), _warmed(log, pids)
    return pids


@pytest.mark.slow
def test_accelerator_spares_make_their_context_ahead_on_the_device_they_would_get(kernel, tmp_path):
    log = tmp_path / "pins.log"
    setup = SETUP_FAKEACC.format(devices=str(DEVICES), log=str(log))
    assert kernel.run(setup)["error"] is None
    _, values = _launch(kernel)  # fresh ranks: nothing warmed up
    assert [v["warm"] for v in values] == [None, None]
    assert [v["physical"] for v in values] == [[0], [1]]

    # (a) Each spare pinned its own device in its warm-up thread before the launch began; the
    # launch ran on those processes, pinned there again in the set-up (CUDA's current device is
    # per thread), and never touched another device.
    spare_pids = _wait_warmed(kernel, log)
    pins = _warmed(log, spare_pids)
    began, values = _launch(kernel)
    assert [v["pid"] for v in values] == spare_pids
    for rank, value in enumerate(values):
        assert value["device"] == f"fakeacc:{rank}"
        [(index, physical, thread, at)] = pins[value["pid"]]
        assert (index, physical, thread) == (rank, rank, warm_up.THREAD_NAME) and at < began
        assert value["physical"] == [rank, rank]
        assert value["by"] == [warm_up.THREAD_NAME, "MainThread"]
        warm = value["warm"]
        assert warm["device"] == f"fakeacc:{rank}" and warm["error"] is None
        assert warm["started_at"] < began and warm["seconds"] is not None

    # (b) The device plan changed after the spares warmed up: they are let go, and fresh ranks
    # land on the devices the new mapping names (a reused spare would stay on the old one).
    for variable, value, physical in (
        ("FAKEACC_VISIBLE_DEVICES", "1,0", [1, 0]),
        ("CUDA_VISIBLE_DEVICES", "0", [1, 0]),
    ):
        stale = _wait_warmed(kernel, log)
        assert kernel.run(f"os.environ[{variable!r}] = {value!r}")["error"] is None
        _, values = _launch(kernel)
        assert not {v["pid"] for v in values} & set(stale)
        assert [v["warm"] for v in values] == [None, None]
        assert [v["physical"] for v in values] == [[p] for p in physical]
        assert wait_until(lambda stale=stale: not any(_alive(p) for p in stale), timeout=10)

    # The spares forked since warmed up under the new mapping, and are taken again.
    spare_pids = _wait_warmed(kernel, log)
    _, values = _launch(kernel)
    assert [v["pid"] for v in values] == spare_pids
    assert [v["physical"] for v in values] == [[1, 1], [0, 0]]
    assert [v["warm"]["device"] for v in values] == ["fakeacc:0", "fakeacc:1"]


def test_warm_up_plans_only_accelerators_and_reads_their_environment():
    env = {
        "CUDA_VISIBLE_DEVICES": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "XPU_THING": "x",
        "NCCL_DEBUG": "INFO",
        "PATH": "/bin",
    }
    assert warm_up.plan("cpu", env) is None and warm_up.plan("xla", env) is None
    assert warm_up.plan("cuda", env) == {
        "device_type": "cuda",
        "env": {"CUDA_VISIBLE_DEVICES": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    }
    assert set(warm_up.device_env("xpu", env)) == {
        "CUDA_VISIBLE_DEVICES",
        "PYTORCH_CUDA_ALLOC_CONF",
        "XPU_THING",
    }
    # The launcher's test: the set-up's device environment, and the rank's device its index.
    warm = warm_up.plan("cuda", env)
    rank0 = {**env, "RANK": "0", "LOCAL_RANK": "0"}
    assert spares._same_device(warm, "cuda", rank0)
    assert spares._same_device(None, "cpu", None)  # CPU spares touched no device
    for changed in (
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
        {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        {"LOCAL_RANK": "1"},
    ):
        assert not spares._same_device(warm, "cuda", {**rank0, **changed}), changed
    assert spares._same_device(warm, "cuda", {**rank0, "NCCL_DEBUG": "WARN"})


def test_a_spare_refuses_a_set_up_for_another_device_than_it_warmed(monkeypatch):
    import os

    for name in warm_up.device_env("xpu", os.environ):  # this machine's own, if any
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(
        warm_up, "_report", {"device": "cuda:0", "started_at": time.time(), "seconds": 0.3}
    )

    def setup(device_type="cuda", **env):
        return {"device_type": device_type, "env": {"CUDA_VISIBLE_DEVICES": "1", **env}}

    warm_up.check(setup(LOCAL_RANK="0"))  # what it warmed up for
    for wrong in (
        setup(LOCAL_RANK="1"),
        setup("xpu", LOCAL_RANK="0"),
        setup(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="0"),
        setup(LOCAL_RANK="0", PYTORCH_CUDA_ALLOC_CONF="x"),
    ):
        with pytest.raises(RuntimeError, match="made its context on cuda:0.*NBLAUNCH_SPARE_RANKS"):
            warm_up.check(wrong)
    monkeypatch.setattr(warm_up, "_report", None)
    warm_up.check(setup(LOCAL_RANK="1"))  # not a warmed spare: nothing to check


def test_no_spares_when_turned_off(tmp_path, monkeypatch):
    from conftest import Kernel

    monkeypatch.setenv("NBLAUNCH_SPARE_RANKS", "0")
    kernel = Kernel(tmp_path)
    try:
        assert kernel.run("%load_ext nblaunch")["error"] is None
        assert kernel.run("%%distributed -n 2\npass", timeout=120)["error"] is None
        cell = kernel.run(
            "import nblaunch.engine.processes.spares as s\nprint(s._worker, s.pids())"
        )
        assert cell["out"].strip() == "None []"
    finally:
        kernel.close()


SCRIPT = """
import nblaunch
import nblaunch.engine.processes.spares as spares

def pid():
    import os
    return os.getpid()

if __name__ == "__main__":
    for _ in range(2):
        assert nblaunch.notebook_launcher(pid, num_processes=2, display="none")
    print("spares:", spares._worker, spares.pids())
"""


def test_a_script_forks_no_spares(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spares: None []" in done.stdout, done.stdout


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_after_reset_f_the_next_launches_fork_their_ranks(kernel):
    """``%reset -f`` deletes ``__main__.__spec__``, which multiprocessing reads as it prepares
    a rank (spares, and the ranks of a launch that has none)."""
    launch = "import nblaunch\nprint(nblaunch.notebook_launcher(lambda: 1, (), 2, display='none'))"
    assert kernel.run(launch, timeout=120)["out"].strip() == "[1, 1]"
    assert kernel.run("%reset -f")["error"] is None
    for _ in range(2):  # on the spares forked before the reset, then on ranks forked after
        cell = kernel.run(launch, timeout=120)
        assert cell["error"] is None and cell["out"].strip() == "[1, 1]", cell
