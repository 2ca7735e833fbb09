"""Spare ranks (``nblaunch.engine.spares``): a notebook's next launch takes processes forked ahead.

In a real kernel, as a notebook runs the same cell again and again.
"""

from __future__ import annotations

import psutil
from conftest import wait_until

SPARE_PIDS = "import nblaunch.engine.spares\nprint(sorted(nblaunch.engine.spares.pids()))"


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
        "%%distributed -n 2 -o seen\nimport os, torch.distributed as dist\n"
        "seen = [None, None]\n"
        "dist.all_gather_object(seen, (os.getpid(), os.environ.get('FOO')))"
    )
    assert cell["error"] is None, cell
    seen = eval(kernel.run("seen")["result"])
    assert sorted(pid for pid, _ in seen) == spares
    assert [foo for _, foo in seen] == ["set later", "set later"]

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


def test_no_spares_when_turned_off(tmp_path, monkeypatch):
    from conftest import Kernel

    monkeypatch.setenv("NBLAUNCH_SPARE_RANKS", "0")
    kernel = Kernel(tmp_path)
    try:
        assert kernel.run("%load_ext nblaunch")["error"] is None
        assert kernel.run("%%distributed -n 2\npass", timeout=120)["error"] is None
        cell = kernel.run("import nblaunch.engine.spares as s\nprint(s._worker, s.pids())")
        assert cell["out"].strip() == "None []"
    finally:
        kernel.close()


def test_a_script_forks_no_spares():
    import nblaunch
    import nblaunch.engine.spares as spares

    assert nblaunch.notebook_launcher(_pid, num_processes=2, display="none")
    assert spares._worker is None and spares.pids() == []


def _pid() -> int:
    import os

    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
