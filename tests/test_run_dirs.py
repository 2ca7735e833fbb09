"""Run directories: names that sort by time, and a live run's directory never pruned.

The fault sweep's first data-loss case: two processes in one folder with ``NBLAUNCH_KEEP_RUNS=2``,
one running for seconds while the other made three quick launches, lost the first one's logs
and metrics while it ran, silently.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import wait_until

from nblaunch import LaunchError, notebook_launcher
from nblaunch.engine.plan.run_dirs import is_live, new_run_dir, prune_runs


def test_names_made_within_one_second_sort_in_the_order_they_were_made(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NBLAUNCH_KEEP_RUNS", "0")
    made = []
    for _ in range(30):
        path, lease = new_run_dir(None)
        lease.release()
        made.append(path.name)
    assert sorted(made) == made


def test_a_live_run_is_neither_pruned_nor_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NBLAUNCH_KEEP_RUNS", "1")
    live, live_lease = new_run_dir(None)
    finished = []
    for _ in range(3):
        path, lease = new_run_dir(None)
        lease.release()
        finished.append(path)
    assert live.exists() and is_live(live)
    # A run that ends prunes again: one finished run is kept, not one more (issue 45: 51 of 50).
    assert [p for p in finished if p.exists()] == finished[-1:]
    live_lease.release()  # once finished, it counts first (it finished last): the other goes
    assert live.exists() and not finished[-1].exists()
    assert prune_runs(tmp_path, keep=1) == []


def test_the_base_keeps_the_newest_finished_runs_and_no_more(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NBLAUNCH_KEEP_RUNS", "3")
    made = []
    for _ in range(6):
        path, lease = new_run_dir(None)
        made.append(path)
        lease.release()
    assert sorted(p for p in tmp_path.iterdir()) == made[-3:]


def test_another_process_cannot_prune_a_run_this_one_holds(tmp_path):
    # The lease is an flock: it holds across processes, and ends with the process that held it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from nblaunch.engine.plan.run_dirs import new_run_dir\n"
            "path, lease = new_run_dir(None); print(path, flush=True); sys.stdin.read()",
        ],
        env={**_env(), "NBLAUNCH_RUN_DIR": str(tmp_path), "NBLAUNCH_KEEP_RUNS": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = Path(holder.stdout.readline().strip())
        assert held.is_dir() and is_live(held)
        assert prune_runs(tmp_path, keep=1) == []  # the only run is live
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not is_live(held)  # the process ended: so did its hold


def test_a_bad_keep_runs_is_named_with_what_it_may_be(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path))
    for bad in ("abc", "-3", "2.5"):
        monkeypatch.setenv("NBLAUNCH_KEEP_RUNS", bad)
        with pytest.raises(LaunchError, match=f"NBLAUNCH_KEEP_RUNS='{bad}'.*whole number"):
            notebook_launcher(print, num_processes=1, device_type="cpu", display="none")
    assert not any(tmp_path.iterdir())  # refused before anything was made


def test_a_long_run_keeps_its_logs_and_metrics_while_another_process_launches(tmp_path):
    # The sweep's case as found: process A trains for a few seconds with prints and
    # log_metrics; this process makes three quick launches in the same folder, keeping 2.
    script = tmp_path / "long_run.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from pathlib import Path
            from nblaunch import log_metrics, notebook_launcher

            def train(go):
                for step in range(40):
                    print(f"step {step}", flush=True)
                    log_metrics({"loss": 1.0 / (step + 1)}, step=step)
                    if step == 5:  # the other process launches while this one runs
                        Path(go).touch()
                        deadline = time.monotonic() + 60
                        while not Path(go + ".done").exists() and time.monotonic() < deadline:
                            time.sleep(0.05)
                return "trained"

            print(notebook_launcher(train, (sys.argv[1],), num_processes=2, device_type="cpu",
                                    display="none"))
            """
        )
    )
    go = tmp_path / "go"
    env = {**_env(), "NBLAUNCH_RUN_DIR": str(tmp_path / "runs"), "NBLAUNCH_KEEP_RUNS": "2"}
    long_run = subprocess.Popen(
        [sys.executable, str(script), str(go)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert wait_until(go.exists, timeout=120), "the long run did not reach step 5"
        (running,) = (tmp_path / "runs").iterdir()
        quick = subprocess.run(
            [
                sys.executable,
                "-c",
                "from nblaunch import notebook_launcher\n"
                "for _ in range(3):\n"
                "    notebook_launcher(print, ('quick',), num_processes=2, device_type='cpu',"
                " display='none')",
            ],
            env=env,
            timeout=180,
            capture_output=True,
            text=True,
        )
        assert quick.returncode == 0, quick.stderr
        assert running.exists(), "a live run's directory was pruned"
        (tmp_path / "go.done").touch()
        out, _ = long_run.communicate(timeout=120)
    finally:
        if long_run.poll() is None:
            long_run.kill()
            long_run.wait(timeout=10)
    assert "['trained', 'trained']" in out
    for rank in (0, 1):
        assert "step 39" in (running / f"rank{rank}.log").read_text()
    assert (running / "metrics.jsonl").read_text().count('"loss"') == 80
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    # The live one was neither pruned nor counted; at its end it counted first, as the run
    # that finished last (its logs are not lost to runs that started after it), then the
    # newest of the others.
    assert runs == sorted([running.name, runs[-1]]) and len(runs) == 2
    # Now finished, the long run counts like any other: once the next launch ends, it goes.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from nblaunch.engine.plan.run_dirs import new_run_dir; new_run_dir(None)[1].release()",
        ],
        env=env,
        check=True,
        timeout=60,
    )
    assert not running.exists()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("NBLAUNCH_")}
