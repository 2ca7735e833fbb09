"""What differs between the torch versions nblaunch supports (see docs/versions.md).

The whole suite is what proves a version works (``make test-matrix``); these tests pin the
places where nblaunch does something different per version, on whichever torch runs them.
"""

from __future__ import annotations

import datetime
import io
import re
import socket

import pytest
import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from nblaunch import LaunchError, notebook_launcher
from nblaunch.cluster.join import EXIT_USAGE, join
from nblaunch.cluster.store import host_store, require_store_queues
from nblaunch.ranks.default_group import rendezvous_store


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_0_store(port: int):
    return rendezvous_store(0, 1)


def notebook_store(port: int):
    return host_store("127.0.0.1", port)


@pytest.mark.parametrize("serve", [rank_0_store, notebook_store])
@pytest.mark.parametrize("version", ["this torch", "2.7.1"])
def test_the_stores_nblaunch_serves_take_the_socket_it_bound(monkeypatch, serve, version):
    # nblaunch binds the store's socket itself (to listen on one address only) and hands it to
    # TCPStore. torch < 2.8's default (libuv) store refuses one ("does not support
    # initialization with an listen fd"), so those versions get the legacy store; "2.7.1" runs
    # that path on this torch, and the real old torch runs it in the version matrix.
    if version != "this torch":
        monkeypatch.setattr(torch, "__version__", version)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    server = serve(port)
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    client.set("from the rank", "hello")
    assert server.get("from the rank") == b"hello"
    assert server.libuvBackend == (TorchVersion(torch.__version__) >= (2, 8))


def test_the_store_has_queues_from_torch_2_8():
    # nblaunch's multi-node channel is the store's queues: the version nblaunch checks for
    # (require_store_queues) must be the one that has them, on whichever torch runs this.
    has_queues = all(hasattr(dist.Store, m) for m in ("queue_push", "queue_pop", "queue_len"))
    assert has_queues == (TorchVersion(torch.__version__) >= (2, 8))
    assert hasattr(dist, "QueueEmptyError") == has_queues


@pytest.mark.parametrize("version", ["2.7.1", "2.5.1+cu124"])
def test_a_multinode_run_on_torch_before_2_8_says_to_upgrade(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    endpoint = "127.0.0.2:29400"  # never listened on: the version is refused first
    said = rf"need torch 2.8 or newer.*this is torch {re.escape(version)}\."
    with pytest.raises(LaunchError, match=said):
        notebook_launcher(print, (), 1, num_nodes=2, rdzv_endpoint=endpoint, display="none")
    out = io.StringIO()
    assert join(endpoint, "a-run", connect_timeout=1, out=out) == EXIT_USAGE
    assert f"this is torch {version}. Upgrade torch on every node" in out.getvalue()


def test_torch_2_8_and_newer_run_multinode(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    require_store_queues()  # no error
