"""A Ray cluster whose nodes have addresses of their own: network namespaces, not loopback.

Two hosts (tests/netns.py): the Ray head, with the notebook, in the first namespace and a Ray
worker node in the second, each started by ``ray start --block`` with its namespace's address
(``--node-ip-address``). The notebook's process runs ``cluster="ray"`` there: the rendezvous is on
the address Ray reports for the notebook's node, and each node's ranks use the interface that
reaches it (the bridge on the notebook's host, the veth on the other), never loopback.

Needs root and ``ip`` (as the other multi-node network tests) and Ray; skipped, saying why,
without them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from netns import Network, Side, alive, skip_reason

pytest.importorskip("ray", reason="Ray is not installed: pip install 'nblaunch[ray]'")
pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

RAY = str(Path(sys.executable).parent / "ray")
START_LIMIT_S = 90.0

NOTEBOOK = """
import json, sys, ray, nblaunch

def where():
    import os
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "total": float(total), "master": os.environ["MASTER_ADDR"],
            "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}

ray.init(address=sys.argv[1])
values = nblaunch.notebook_launcher(where, num_processes=1, num_nodes=2, cluster="ray",
                                    display="none")
print(json.dumps({"values": values}), flush=True)
"""


def started(side: Side, what: str) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline and side.process.poll() is None:
        if side.line_with("Ray runtime started"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not start:\n{side.output()[-3000:]}")


def test_each_node_s_ranks_use_the_interface_that_reaches_the_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_RUN_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Set by test_ray.py in this process to keep its cluster on 127.0.0.1; these nodes have
    # addresses of their own (with it, a worker node refuses to join).
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    # Ray 2.60 turns token authentication on for `ray start --head` when ~/.ray/auth_token
    # exists (a local ray.init() writes one), but not for a node joining it: say it for both.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Ray's sockets live under its temp dir: a short path (a Unix socket's holds 107 bytes).
    ray_dir = tempfile.mkdtemp(prefix="nbray")
    net = Network(2)
    sides: list[Side] = []
    try:
        gcs = f"{net.addresses[0]}:{6300 + os.getpid() % 500}"
        common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
        head = Side(
            net.command(
                0,
                RAY,
                "start",
                "--head",
                f"--port={gcs.split(':')[1]}",
                f"--node-ip-address={net.addresses[0]}",
                "--include-dashboard=false",
                f"--temp-dir={ray_dir}",
                *common,
            ),
            tmp_path / "head.log",
        )
        sides.append(head)
        started(head, "the Ray head")
        worker = Side(
            net.command(
                1,
                RAY,
                "start",
                f"--address={gcs}",
                f"--node-ip-address={net.addresses[1]}",
                *common,
            ),
            tmp_path / "worker.log",
        )
        sides.append(worker)
        started(worker, "the Ray worker node")
        notebook = Side(
            net.command(0, sys.executable, "-c", NOTEBOOK, gcs), tmp_path / "notebook.log"
        )
        sides.append(notebook)
        assert notebook.wait(120) == 0, notebook.output()[-3000:]
        (record,) = notebook.records()
        bridge, veth = net.links
        assert record["values"] == [
            {"rank": 0, "total": 2.0, "master": net.addresses[0], "gloo": bridge},
            {"rank": 1, "total": 2.0, "master": net.addresses[0], "gloo": veth},
        ], notebook.output()[-3000:]
    finally:
        trees = set()
        for side in sides:
            trees |= side.tree()
            side.process.terminate()  # ray start --block stops its node's daemons with it
        for side in sides:
            if side.wait(30) is None:
                side.kill()
        deadline = time.monotonic() + 15
        while alive(trees) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(trees)
        net.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, left
