"""The runs panel's server extension (``nblaunch.lab``) in a real Jupyter server, and what ships.

The server is started with the package's own ``jupyter-config`` file in its config folder (the
wheel installs that file; the editable install of the test venv does not), so these tests also
check that the file enables the extension. Detached runs are started from a terminal (a Python
process that exits), as a person would, and watched through the REST API only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, wait_until

from nblaunch.lab.summary import RunSummary

TRAIN = """
import sys, time, nblaunch
def train(steps, pause_s, fail):
    import torch.distributed as dist
    for step in range(steps):
        nblaunch.log_metrics({"loss": 1.0 / (step + 1) + 0.05 * dist.get_rank()}, step=step)
        print(f"step {step}", flush=True)
        time.sleep(pause_s)
    if fail and dist.get_rank() == 1:
        raise ValueError("no column 7 on rank 1")
    return dist.get_rank()
handle = nblaunch.notebook_launcher(
    train, (int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "fail"), 2,
    detach=True, display="none", device_type="cpu",
)
print(handle.id, flush=True)
"""


def start_detached(work: Path, steps: int, pause_s: float, fail: bool = False) -> str:
    """Start a detached run from a terminal (a process that exits at once); return its id."""
    script = work / "train.py"
    script.write_text(TRAIN)
    done = subprocess.run(
        [sys.executable, str(script), str(steps), str(pause_s), "fail" if fail else "ok"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


class Server:
    """A Jupyter server (``jupyter server``) on 127.0.0.1 with a token, its root ``work``."""

    def __init__(self, tmp_path: Path, work: Path, env: dict[str, str] | None = None) -> None:
        config = tmp_path / "config"
        (config / "jupyter_server_config.d").mkdir(parents=True)
        shipped = ROOT / "jupyter-config" / "jupyter_server_config.d" / "nblaunch.json"
        shutil.copy(shipped, config / "jupyter_server_config.d" / "nblaunch.json")
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), **(env or {}))
        self.log = tmp_path / "server.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--no-browser",
                "--allow-root",
                "--ip=127.0.0.1",
                f"--port={self.port}",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={work}",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 60
        while self.status("/api/status", token=True) != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the server did not start:\n" + self.log.read_text())
            time.sleep(0.3)

    def request(
        self, path: str, method: str = "GET", token: bool = True, body: dict | None = None
    ) -> tuple[int, dict | None]:
        headers = {"Authorization": f"token {self.token}"} if token else {}
        data = b"" if method == "POST" else None
        if body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read()
                return response.status, json.loads(body) if body else None
        except urllib.error.HTTPError as error:
            return error.code, None
        except OSError:
            return 0, None

    def open(self, path: str) -> Any:
        """A streamed response (server-sent events) to read line by line."""
        headers = {"Authorization": f"token {self.token}"}
        return urllib.request.urlopen(
            urllib.request.Request(self.base + path, None, headers), timeout=30
        )

    def status(self, path: str, method: str = "GET", token: bool = True) -> int:
        return self.request(path, method, token)[0]

    def runs(self) -> dict[str, dict]:
        code, body = self.request("/nblaunch/api/runs")
        assert code == 200 and body is not None
        return {run["id"]: run for run in body["runs"]}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def next_event(stream: Any) -> dict | None:
    """The next server-sent event's data, or None at the stream's end."""
    while line := stream.readline():
        if line.startswith(b"data: "):
            assert stream.readline() == b"\n"
            return json.loads(line[6:])
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Every kernel of the test's server runs this first (an IPython startup file): it attaches to
# the detached pool, as a person's `nblaunch.attach_pool()` cell would.
ATTACH_POOL = "import nblaunch\npool = nblaunch.attach_pool()\n"


@pytest.fixture(scope="module")
def _shared_server(tmp_path_factory):
    """One server for the module's tests (a start and a stop cost 5-30 s here): its root folder
    ``work`` and its detached runs' registry. Each test looks only at the runs it starts."""
    base = tmp_path_factory.mktemp("lab")
    work, registry = base / "work", base / "detached"
    work.mkdir()
    startup = base / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-attach-pool.py").write_text(ATTACH_POOL)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
        env.delenv("NBLAUNCH_RUN_DIR", raising=False)  # the default, .nblaunch/runs in the root
        server = Server(base, work, {"IPYTHONDIR": str(base / "ipython")})
    yield server, work, registry
    server.close()


@pytest.fixture
def lab_server(_shared_server, monkeypatch):
    """The module's server, whose root folder is ``work``; runs go to its ``.nblaunch/runs``,
    and this process starts detached runs in the server's registry."""
    server, work, registry = _shared_server
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(registry))
    monkeypatch.delenv("NBLAUNCH_RUN_DIR")
    return server, work


@pytest.mark.slow
def test_without_the_token_the_api_is_refused_as_the_server_refuses_its_own(lab_server):
    server, _ = lab_server
    own = server.status("/api/contents", token=False)
    assert own == 403
    assert server.status("/nblaunch/api/runs", token=False) == own
    assert server.status("/nblaunch/api/runs/x", token=False) == own
    assert server.status("/nblaunch/api/runs/x/stop", "POST", token=False) == own
    assert server.status("/nblaunch/api/runs/x/events", token=False) == own
    assert server.status("/nblaunch/api/runs") == 200
    assert server.status("/nblaunch/api/runs/x") == 404
    assert server.status("/nblaunch/api/runs/x/stop", "POST") == 404
    assert server.status("/nblaunch/api/runs/x/events") == 404


@pytest.mark.slow
def test_a_detached_run_is_listed_watched_live_and_stopped(lab_server):
    server, work = lab_server
    run_id = start_detached(work, 3000, 0.05)
    assert wait_until(lambda: run_id in server.runs(), 30)
    run = server.runs()[run_id]
    assert (run["kind"], run["state"], run["ranks"], run["detached"]) == ("run", "running", 2, True)
    assert Path(run["run_dir"]).parent == work / ".nblaunch" / "runs"

    def last_step() -> int:
        code, detail = server.request(f"/nblaunch/api/runs/{run_id}")
        assert code == 200 and detail is not None
        return detail["view"]["last_step"] or -1

    assert wait_until(lambda: last_step() >= 5, 60)
    first = last_step()
    assert wait_until(lambda: last_step() >= first + 5, 30)  # it grows: the view is live
    code, detail = server.request(f"/nblaunch/api/runs/{run_id}")
    view = detail["view"]
    assert set(view["ranks"]) == {"0", "1"} and view["ranks"]["1"]["device"] == "cpu"
    assert any(text.startswith("step ") for _, text in view["lines"])
    assert view["metrics"]["loss"]["0"][0] == [0, 1.0]
    assert server.status(f"/nblaunch/api/runs/{run_id}?since=0.running.None") == 200
    # The event stream: a picture at each change, live, and it ends with the run.
    stream = server.open(f"/nblaunch/api/runs/{run_id}/events")
    assert stream.headers["Content-Type"] == "text/event-stream"
    first = next_event(stream)
    assert first["state"] == "running"
    assert next_event(stream)["view"]["version"] > first["view"]["version"]
    code, stopped = server.request(f"/nblaunch/api/runs/{run_id}/stop", "POST")
    assert code == 200 and stopped == {"stopped": True, "state": "stopped"}  # after the stop
    events = []
    while (event := next_event(stream)) is not None:  # bounded: the socket's 30 s timeout
        events.append(event)
    assert events[-1]["state"] == "stopped" and events[-1]["view"]["ended"] is not None
    assert server.runs()[run_id]["state"] == "stopped"
    code, detail = server.request(f"/nblaunch/api/runs/{run_id}")
    assert detail["view"]["ended"] is not None and not detail["view"]["ended"]["ok"]
    code, again = server.request(f"/nblaunch/api/runs/{run_id}/stop", "POST")
    assert again == {"stopped": False, "state": "stopped"}
    # Unchanged since the tag it gave: 304, nothing sent (the panel's poll costs little).
    assert server.status(f"/nblaunch/api/runs/{run_id}?since={detail['tag']}") == 304


def test_the_watch_of_a_dead_hosts_run_goes_with_its_directory(tmp_path, monkeypatch):
    """A run whose host died keeps its watch (what the host sent is all there is) while it is
    listed, and no longer once its directory was removed."""
    import signal

    from nblaunch.engine.detached import registry as detached
    from nblaunch.lab.runs import RunsIndex

    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(tmp_path / "detached"))
    monkeypatch.delenv("NBLAUNCH_RUN_DIR", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    run_id = start_detached(work, 3000, 0.05)
    entry = detached.find(run_id)
    index = RunsIndex(work)
    try:
        assert wait_until(lambda: (index.detail(run_id) or {}).get("view", {}).get("lines"), 60)
        os.kill(entry.pid, signal.SIGKILL)  # the host dies; its ranks follow it
        assert wait_until(lambda: index.records()[0]["state"] != "running", 30)
        assert run_id in index._watches  # no history on disk: the watch is the picture
        shutil.rmtree(entry.run_dir)
        assert run_id not in [record["id"] for record in index.records()]
        assert index._watches == {}
    finally:
        index.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_failed_run_is_listed_with_the_first_line_of_its_root_cause(lab_server):
    server, work = lab_server
    run_id = start_detached(work, 3, 0.05, fail=True)
    assert wait_until(lambda: server.runs().get(run_id, {}).get("state") == "failed", 60)
    run = server.runs()[run_id]
    assert "ValueError" in run["cause"] and "no column 7 on rank 1" in run["cause"]
    assert "\n" not in run["cause"] and run["ended"] >= run["started"]
    _, detail = server.request(f"/nblaunch/api/runs/{run_id}")
    assert detail["view"]["ended"]["ranks"]["1"].startswith("ValueError")


POOL = """
import time, nblaunch
pool = nblaunch.start_pool(2, detach=True, device_type="cpu")
print(pool.entry.run_id, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_detached_pool_is_listed_with_the_kernel_that_holds_it_and_stopped(lab_server):
    server, work = lab_server
    (work / "pool.py").write_text(POOL)
    # A terminal holds it first: a process, not a kernel of this server.
    terminal = subprocess.Popen(
        [sys.executable, "pool.py"], cwd=work, stdout=subprocess.PIPE, text=True
    )
    try:
        pool_id = terminal.stdout.readline().strip()
        run = server.runs()[pool_id]
        assert (run["kind"], run["state"], run["ranks"]) == ("pool", "running", 2)
        assert run["holder"]["pid"] == terminal.pid and run["holder"]["kernel"] is None
        terminal.kill()  # as a kernel crashes: the pool goes on, held by nobody
        terminal.wait(10)
        assert wait_until(lambda: server.runs()[pool_id]["holder"] is None, 10)
        assert server.runs()[pool_id]["state"] == "running"
        # A notebook's kernel of this server attaches (its startup file does).
        code, session = server.request(
            "/api/sessions",
            "POST",
            body={"path": "train.ipynb", "type": "notebook", "kernel": {"name": "python3"}},
        )
        assert code == 201, code

        def holder_kernel() -> dict | None:
            holder = server.runs()[pool_id]["holder"]
            return holder and holder["kernel"]

        assert wait_until(holder_kernel, 60, interval=0.5)
        assert holder_kernel() == {"kernel_id": session["kernel"]["id"], "path": "train.ipynb"}
        code, detail = server.request(f"/nblaunch/api/runs/{pool_id}")
        assert detail["holder"]["kernel"]["path"] == "train.ipynb"
        code, stopped = server.request(f"/nblaunch/api/runs/{pool_id}/stop", "POST")
        assert stopped == {"stopped": True, "state": "stopped"}
        assert wait_until(lambda: server.runs()[pool_id]["state"] == "stopped", 30)
        assert server.runs()[pool_id]["holder"] is None
    finally:
        terminal.kill()
        terminal.wait(10)


@pytest.mark.slow
def test_another_user_s_runs_are_neither_listed_nor_reachable(lab_server):
    if os.getuid() != 0:
        pytest.skip("making files of another uid needs root")
    server, work = lab_server
    other = 65534  # nobody
    runs = work / ".nblaunch" / "runs"
    mine, theirs = runs / "20261204-100000-000000-aaaa", runs / "20261204-110000-000000-bbbb"
    for run_dir in (mine, theirs):
        run_dir.mkdir(parents=True)
        (run_dir / "rank0.log").write_text("step 0\nstep 1\n")
    os.chown(theirs, other, other)
    # Their detached run, in a registry only root could write into: the entry and its
    # directory are theirs, and its "host" is a process of theirs.
    registry = Path(os.environ["NBLAUNCH_DETACHED_DIR"])  # the server's
    registry.mkdir(mode=0o700, exist_ok=True)
    host = subprocess.Popen(
        ["setpriv", f"--reuid={other}", f"--regid={other}", "--clear-groups",
         sys.executable, "-c", "import time; time.sleep(60)", "nblaunch.host"]
    )  # fmt: skip
    try:
        entry = {
            "run_id": theirs.name + "-d",
            "run_dir": str(theirs),
            "pid": host.pid,
            "socket": str(theirs / "stream.sock"),
            "kind": "run",
            "started_at": time.time(),
            "world_size": 2,
            "state": "running",
        }
        path = registry / f"{entry['run_id']}.json"
        path.write_text(json.dumps(entry))
        os.chown(path, other, other)
        listed = server.runs()
        assert mine.name in listed and listed[mine.name]["state"] == "ended"
        assert listed[mine.name]["ranks"] == 1 and not listed[mine.name]["detached"]
        assert theirs.name not in listed and entry["run_id"] not in listed
        for run_id in (theirs.name, entry["run_id"]):
            assert server.status(f"/nblaunch/api/runs/{run_id}") == 404
            assert server.status(f"/nblaunch/api/runs/{run_id}/stop", "POST") == 404
            assert server.status(f"/nblaunch/api/runs/{run_id}/events") == 404
        assert host.poll() is None  # not signalled
        code, detail = server.request(f"/nblaunch/api/runs/{mine.name}")
        assert detail["view"]["ranks"]["0"]["lines"] == ["step 0", "step 1"]
        code, refused = server.request(f"/nblaunch/api/runs/{mine.name}/stop", "POST")
        assert code == 200 and refused["stopped"] is False and "kernel" in refused["why"]
    finally:
        host.kill()
        host.wait(5)


# --- what ships -----------------------------------------------------------------------------------


def _build_script():
    spec = importlib.util.spec_from_file_location("build_lab", ROOT / "scripts" / "build_lab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_lab_extension_was_built_from_its_sources_as_they_are():
    build = _build_script()
    assert build.STAMP.read_text().strip() == build.sources_hash(), (
        "nblaunch/lab/labextension is not the build of labextension/: run make lab-build"
    )
    built = json.loads((build.BUILT / "package.json").read_text())
    assert built["name"] == "nblaunch-lab" and built["jupyterlab"]["_build"]["load"]
    assert (build.BUILT / built["jupyterlab"]["_build"]["load"]).is_file()


def test_the_stamp_changes_with_any_source(tmp_path):
    build = _build_script()
    copy = tmp_path / "labextension"
    shutil.copytree(build.SOURCES, copy, ignore=shutil.ignore_patterns("node_modules", "lib"))
    before = build.sources_hash(copy)
    source = copy / "src" / "index.ts"
    source.write_text(source.read_text() + "\n// changed\n")
    assert build.sources_hash(copy) != before


@pytest.mark.slow
def test_the_wheel_enables_the_server_extension_and_ships_the_lab_extension(tmp_path):
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("needs hatchling (pip install hatchling)")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("nblaunch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "nblaunch-0.1.0.data/data/"
    config = data + "etc/jupyter/jupyter_server_config.d/nblaunch.json"
    assert config in names
    enabled = json.loads(zipfile.ZipFile(wheel).read(config))
    assert enabled["ServerApp"]["jpserver_extensions"] == {"nblaunch.lab": True}
    shipped = data + "share/jupyter/labextensions/nblaunch-lab/"
    assert shipped + "package.json" in names
    built = json.loads(zipfile.ZipFile(wheel).read(shipped + "package.json"))
    assert shipped + built["jupyterlab"]["_build"]["load"] in names
    assert "nblaunch/lab/handlers.py" in names


# --- the picture, without a server ----------------------------------------------------------------


def test_the_summary_keeps_lines_bounded_and_redraws_a_progress_line():
    summary = RunSummary()
    summary.handle({"kind": "run_info", "world_size": 2, "run_dir": "/r", "warnings": []})
    for i in range(100):
        summary.handle(
            {"kind": "stream", "rank": 0, "fd": 1, "text": f"line {i}\n", "carriage": False}
        )
    for pct in (10, 50, 100):
        summary.handle({"kind": "stream", "rank": 1, "fd": 2, "text": f"{pct}%", "carriage": True})
    summary.handle(
        {"kind": "metrics", "rank": 0, "step": 3, "values": {"loss": float("nan")}, "time": 0}
    )
    picture = summary.to_json()
    assert (
        picture["ranks"]["0"]["lines"][-1] == "line 99"
        and len(picture["ranks"]["0"]["lines"]) == 40
    )
    assert picture["ranks"]["1"]["lines"] == ["100%"]
    assert picture["metrics"]["loss"]["0"] == [[3, None]] and picture["last_step"] == 3
    json.dumps(picture, allow_nan=False)  # what the browser parses: no NaN
    assert picture["version"] == 105
