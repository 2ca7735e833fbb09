"""Trust on the network: a third process attacks a two-node loopback run through its store.

The notebook node is this test process (rendezvous on 127.0.0.2), the other node a ``python -m
nblaunch join`` subprocess, the attacker a third process that connects to the store as any
client on the network could.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import wait_until
from test_multinode import HEAD, Recorder, TwoNodes
from test_multinode import nodes as nodes  # the same two-node fixture

from nblaunch import AuthenticationError, RendezvousTimeoutError
from nblaunch.cluster.trust import RunSecret, SigningStore

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SECRET_MARKER = "TOPSECRET-credential-4711"  # travels in the payload: must not be readable

ATTACKER = """
import datetime, os, pickle, sys, time
import torch.distributed as dist

host, port, run_id, action, out = sys.argv[1:6]
store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=60))
base = f"nblaunch/{run_id}/"


class Evil:
    # unpickling this writes a file: the proof that forged bytes were unpickled
    def __reduce__(self):
        return (open, (os.path.join(out, "pwned"), "w"))


evil = pickle.dumps(Evil())


def wait_for(key, seconds=60):
    store.wait([key], datetime.timedelta(seconds=seconds))


if action == "during":
    wait_for(base + "config")
    store.queue_push(base + "hello", evil)  # a forged node announcement
    wait_for(base + "complete")
    with open(os.path.join(out, "payload.bin"), "wb") as f:
        f.write(store.get(base + "payload"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # take one batch of the other node's output lines
        if store.queue_len(base + "up") > 0:
            record = store.queue_pop(base + "up")
            if len(record) > 100:  # a batch of events, not an empty liveness beat (~50 bytes)
                break
        time.sleep(0.002)
    store.queue_push(base + "up", evil)  # a forged batch of events
    store.set(base + "control", "stop")  # an unsigned order to stop
elif action == "config":
    wait_for(base + "config")
    store.set(base + "config", evil)
    open(os.path.join(out, "config-forged"), "w").close()
elif action == "rendezvous":
    key = "torch.rendezvous." + run_id
    wait_for(key)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        store.set(key, evil)
        time.sleep(0.2)
open(os.path.join(out, "done"), "w").close()
"""


class Attacker:
    def __init__(self, nodes: TwoNodes, action: str, tmp_path: Path) -> None:
        script = tmp_path / "attacker.py"
        script.write_text(textwrap.dedent(ATTACKER))
        self.out = tmp_path
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(script),
                HEAD,
                str(nodes.port),
                nodes.run_id,
                action,
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    @property
    def pwned(self) -> bool:
        return (self.out / "pwned").exists()


# --- the pieces ----------------------------------------------------------------------------------


def test_sealed_records_open_only_with_the_secret_and_under_their_key():
    secret = RunSecret.new()
    sealed = secret.seal({"token": SECRET_MARKER}, "nblaunch/run/config")
    assert SECRET_MARKER.encode() not in sealed  # encrypted
    assert secret.open(sealed, "nblaunch/run/config") == {"token": SECRET_MARKER}
    with pytest.raises(AuthenticationError):
        secret.open(sealed, "nblaunch/run/payload")  # moved to another key
    altered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(AuthenticationError):
        secret.open(altered, "nblaunch/run/config")
    with pytest.raises(AuthenticationError):
        RunSecret.new().open(sealed, "nblaunch/run/config")  # another run's secret
    signed = secret.sign("stop", "control")
    assert secret.verify(signed, "control") == b"stop"
    with pytest.raises(AuthenticationError):
        secret.verify(b"stop", "control")


def test_torchs_rendezvous_state_is_signed_and_a_forged_one_is_refused():
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    store = dist.HashStore()
    secret = RunSecret.new()
    backend = C10dRendezvousBackend(SigningStore(store, secret, "head:29400"), "run")
    assert backend.get_state() is None
    state, token, written = backend.set_state(b"state-1")
    assert (state, written) == (b"state-1", True)
    assert backend.set_state(b"state-2", token)[2] is True  # compare-and-set still works
    assert store.get("torch.rendezvous.run") != b"c3RhdGUtMg=="  # stored signed
    store.set("torch.rendezvous.run", "Zm9yZ2Vk")  # what another client could write
    with pytest.raises(AuthenticationError, match=r"rendezvous at head:29400 failed auth"):
        backend.get_state()


def test_the_secret_file_is_private_and_goes_away(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_SECRET_DIR", str(tmp_path / "secrets"))
    path = RunSecret.new().write_file("run1")
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


# --- attacks on a real two-node run --------------------------------------------------------------


def quiet_then_chatty():
    import time

    import nblaunch

    if nblaunch.rank() == 1:  # the joined node: its lines travel through the store
        for step in range(40):
            print(f"step {step}", flush=True)
            time.sleep(0.05)
    return len(SECRET_MARKER)


def test_a_third_process_reads_nothing_and_its_forgeries_are_dropped_and_said(nodes, tmp_path):
    attacker = Attacker(nodes, "during", tmp_path)
    view = Recorder()
    try:
        nodes.start_joiner()
        results = nodes.launch(quiet_then_chatty, view=view)
        assert wait_until(lambda: (tmp_path / "done").exists(), timeout=20)
    finally:
        attacker.close()
    assert results == [len(SECRET_MARKER)] * 2  # the run went on: the forged "stop" was ignored
    assert not attacker.pwned  # nothing forged was ever unpickled in this process
    payload = (tmp_path / "payload.bin").read_bytes()
    assert SECRET_MARKER.encode() not in payload and b"quiet_then_chatty" not in payload
    warnings = [d["title"] for d in view.of("diagnosis") if d["severity"] == "warning"]
    assert any("failed authentication and was dropped" in w for w in warnings), warnings
    assert any("ignored a forged control value" in w for w in warnings), warnings
    assert any("were removed from the run's store by another client" in w for w in warnings), (
        warnings
    )


def test_a_node_refuses_settings_it_cannot_authenticate(nodes, tmp_path):
    attacker = Attacker(nodes, "config", tmp_path)
    joiners = []

    def join_after_the_forgery() -> None:
        # The node reads the settings after the attacker replaced them: otherwise a quick node
        # reads the real ones first and the run (rightly) goes on.
        if wait_until(lambda: (tmp_path / "config-forged").exists(), 30):
            joiners.append(nodes.start_joiner())

    forging = threading.Thread(target=join_after_the_forgery)
    try:
        forging.start()
        # The node starts once the settings were forged and must read them before the launcher
        # gives up: 15 s leaves its start (a Python with torch) room on a loaded machine (8 s
        # did not once, with 4 test processes on 2 cores).
        with pytest.raises(RendezvousTimeoutError):
            nodes.launch(quiet_then_chatty, rdzv_timeout=15)
        forging.join(30)
        (joiner,) = joiners
        assert joiner.wait(30) == 2
    finally:
        forging.join(30)
        attacker.close()
    assert "failed authentication" in joiner.output()
    assert not attacker.pwned


def test_a_tampered_rendezvous_ends_with_a_clear_error_in_seconds(nodes, tmp_path):
    attacker = Attacker(nodes, "rendezvous", tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(AuthenticationError) as info:
            nodes.launch(quiet_then_chatty, rdzv_timeout=60)
    finally:
        attacker.close()
    assert time.monotonic() - started < 20
    assert f"the rendezvous at {nodes.endpoint} failed authentication" in str(info.value)
    assert not attacker.pwned


def test_the_printed_join_command_carries_the_secret_in_the_environment(nodes):
    view = Recorder()
    with pytest.raises(RendezvousTimeoutError):
        nodes.launch(quiet_then_chatty, view=view, rdzv_timeout=1)
    text = "\n".join(d["body"] for d in view.of("diagnosis"))
    assert "NBLAUNCH_RUN_SECRET=" in text
    command = next(line for line in text.splitlines() if "nblaunch join" in line).strip()
    assert command.startswith("NBLAUNCH_RUN_SECRET=")  # an environment variable, not argv
    assert f"join {nodes.endpoint} --run-id {nodes.run_id}" in command


# --- run directories ----------------------------------------------------------------------------


def test_run_directories_and_logs_are_private(tmp_path, monkeypatch):
    from nblaunch import notebook_launcher

    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path / "runs"))
    notebook_launcher(print, ("a token",), num_processes=2, device_type="cpu", display="none")
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.stat().st_mode & 0o777 == 0o700
    for rank in (0, 1):
        log = run_dir / f"rank{rank}.log"
        assert log.stat().st_mode & 0o777 == 0o600
        assert "a token" in log.read_text()


def test_old_run_directories_are_pruned_and_nothing_else(tmp_path, monkeypatch):
    from nblaunch.engine.plan.launch_plan import plan_launch
    from nblaunch.options import LaunchOptions

    base = tmp_path / "runs"
    old = [base / f"2026010{day}-120000-abcdef" for day in range(1, 6)]
    for directory in old:
        directory.mkdir(parents=True)
    (base / "my-notes").mkdir()  # not nblaunch's: never touched
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(base))
    monkeypatch.setenv("NBLAUNCH_KEEP_RUNS", "3")
    plan = plan_launch(print, 1, LaunchOptions(device_type="cpu"))
    left = sorted(p.name for p in base.iterdir())
    # the three newest finished runs stay, and the live one, which does not count
    assert left == sorted([old[2].name, old[3].name, old[4].name, plan.run_dir.name, "my-notes"])
