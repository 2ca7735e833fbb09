"""Starting the other nodes' ``join`` from the notebook (``start_nodes``): over ssh with a
hostfile, and with srun inside a Slurm allocation.

Stand-in ``ssh`` and ``srun`` commands run what they are given on this machine, as the real ones
would on another node; the second "node" is a real ``python -m nblaunch join`` process either
way, and the notebook's node listens on 127.0.0.2.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time

import cloudpickle
import pytest
from conftest import Kernel
from test_multinode import TwoNodes

from nblaunch import notebook_launcher
from nblaunch.errors import LaunchError, RankFailedError
from nblaunch.notebook.pool import current_pool

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow

# Answers `hostname` with the host's name (the doctor's check), runs any other command here.
# "locked" refuses keys; "broken" has no nblaunch installed. Logs its arguments and stdin's size.
FAKE_SSH = """#!/bin/sh
echo "ssh $*" >> "$SSH_LOG"
host=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) shift 2 ;;
    *) if [ -z "$host" ]; then host="$1"; shift; else break; fi ;;
  esac
done
command="$*"
if [ "$host" = locked ]; then
  echo "alice@locked: Permission denied (publickey,password)." >&2; exit 255
fi
if [ "$command" = hostname ]; then echo "$host"; exit 0; fi
if [ "$host" = broken ]; then
  echo "/usr/bin/python3: No module named nblaunch" >&2; exit 1
fi
exec sh -c "$command"
"""

# Runs the command once per node of --nodes=N, in the background, and waits for them all.
FAKE_SRUN = """#!/bin/sh
echo "srun $*" >> "$SSH_LOG"
nodes=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) nodes="${1#--nodes=}"; shift ;;
    --*) shift ;;
    *) break ;;
  esac
done
i=0
while [ "$i" -lt "$nodes" ]; do "$@" & i=$((i + 1)); done
wait
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """``ssh`` and ``srun`` stand-ins first on PATH; returns the log of their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "ssh", FAKE_SSH)
    _executable(bin_dir / "srun", FAKE_SRUN)
    log = tmp_path / "ssh.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(log))
    # The joins must not find the secret in a shared home: it has to travel with the command.
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return log


@pytest.fixture
def nodes(tmp_path):
    two = TwoNodes(tmp_path)
    yield two
    pool = current_pool()
    if pool is not None:
        pool.close()


def _hostfile(tmp_path, *hosts: str):
    path = tmp_path / "hosts"
    path.write_text("".join(f"{host} slots=1\n" for host in ("localhost", *hosts)))
    return path


def _rank_and_node() -> tuple[str, str]:
    return os.environ["RANK"], os.environ["GROUP_RANK"]


def _launch(nodes: TwoNodes, **kwargs):
    return notebook_launcher(
        _rank_and_node,
        num_processes=1,
        num_nodes=2,
        rdzv_endpoint=nodes.endpoint,
        rdzv_timeout=60,
        device_type="cpu",
        run_dir=nodes.run_dir,
        display="none",
        **kwargs,
    )


def test_ssh_starts_join_on_the_hostfiles_other_host(nodes, stand_ins, tmp_path):
    hosts = _hostfile(tmp_path, "alpha")
    assert _launch(nodes, start_nodes="ssh", hostfile=hosts) == [("0", "0"), ("1", "1")]
    calls = stand_ins.read_text()
    assert "alpha hostname" in calls.splitlines()[0]  # the doctor's check came first
    assert "nblaunch join 127.0.0.2" in calls and "--secret-file -" in calls
    assert "localhost" not in calls  # this machine is node 0, not started again
    assert "NBLAUNCH_RUN_SECRET" not in calls  # the secret went down stdin, not in arguments
    assert "node 1 of 2: rank 1" in (nodes.run_dir / "join-alpha.log").read_text()


def test_a_host_ssh_cannot_reach_stops_the_launch_before_anything_starts(
    nodes, stand_ins, tmp_path
):
    began = time.monotonic()
    with pytest.raises(LaunchError) as refused:
        _launch(nodes, start_nodes="ssh", hostfile=_hostfile(tmp_path, "locked"))
    message = str(refused.value)
    assert "locked: SSH asks for a password" in message and "ssh-copy-id locked" in message
    assert "nothing was started" in message
    assert time.monotonic() - began < 10
    assert "nblaunch join" not in stand_ins.read_text()


def test_a_join_that_cannot_start_fails_the_launch_at_once(nodes, stand_ins, tmp_path):
    began = time.monotonic()
    with pytest.raises(LaunchError, match="join on broken .*No module named nblaunch"):
        _launch(nodes, start_nodes="ssh", hostfile=_hostfile(tmp_path, "broken"))
    assert time.monotonic() - began < 10  # not rdzv_timeout's 60 s


def test_bad_start_nodes_arguments_are_refused(nodes, stand_ins, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError, match="inside a Slurm allocation"):
        _launch(nodes, start_nodes="srun")
    with pytest.raises(LaunchError, match="needs hostfile="):
        _launch(nodes, start_nodes="ssh")
    with pytest.raises(LaunchError, match="is not one of ssh, srun"):
        _launch(nodes, start_nodes="mpirun")
    with pytest.raises(LaunchError, match="names 0 machine"):
        _launch(nodes, start_nodes="ssh", hostfile=_hostfile(tmp_path))


def _remember() -> int:
    import nblaunch.ranks.namespace

    namespace = nblaunch.ranks.namespace.rank_namespace()
    namespace["calls"] = namespace.get("calls", 0) + 1
    return namespace["calls"]


def test_srun_starts_a_pools_other_node_which_stays_across_restarts(nodes, stand_ins, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    pool = nodes.start_pool(start_nodes="srun")
    assert pool.run(_remember) == [1, 1]
    assert pool.run(_remember) == [2, 2]
    calls = stand_ins.read_text()
    assert "--nodes=1" in calls and "--exclude=" in calls and "nblaunch join" in calls
    starter = pool.nodes.starter
    pool.restart()  # the node joins the new start: no second srun
    assert pool.run(_remember) == [1, 1]
    assert stand_ins.read_text().count("srun ") == 1
    pool.close()
    assert starter.started[0].process.poll() == 0  # closing the pool ended the join


def _sleep() -> None:
    time.sleep(60)


def test_a_pool_starts_a_lost_nodes_join_again_at_its_restart(nodes, stand_ins, tmp_path):
    pool = nodes.start_pool(start_nodes="ssh", hostfile=_hostfile(tmp_path, "alpha"))
    assert pool.run(_remember) == [1, 1]
    lost = pool.nodes.starter.started[0].process
    threading.Timer(1.0, lost.terminate).start()  # the node's join is stopped
    with pytest.raises(RankFailedError, match="node 1"):
        pool.run(_sleep)
    pool.restart()  # the pool starts alpha's join again: two nodes once more
    assert pool.run(_remember) == [1, 1]
    assert stand_ins.read_text().count("nblaunch join") == 2
    new = pool.nodes.starter.started[0].process
    assert new.pid != lost.pid
    pool.close()
    assert new.poll() == 0


def test_the_magic_starts_the_other_node_over_ssh(nodes, stand_ins, tmp_path):
    hosts = _hostfile(tmp_path, "alpha")
    kernel = Kernel(tmp_path)
    try:
        assert kernel.run("%load_ext nblaunch")["error"] is None
        cell = kernel.run(
            f"%%distributed -n 1 --nodes 2 --rdzv-endpoint {nodes.endpoint} --start-nodes ssh "
            f"--hostfile {hosts}\nimport os\nprint('node', os.environ['GROUP_RANK'])",
            timeout=120,
        )
        assert cell["error"] is None, cell
        assert "BatchMode=yes alpha" in stand_ins.read_text()
        (log,) = (tmp_path / "runs").glob("*/join-alpha.log")
        assert "node 1 of 2: rank 1" in log.read_text()
    finally:
        kernel.close()
