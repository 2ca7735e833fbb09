"""Multi-node runs: two "nodes" on one machine.

The notebook node is this test process, hosting the rendezvous on 127.0.0.2; the other node is a
``python -m nblaunch join`` subprocess. Ranks use CPU and gloo.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import cloudpickle
import psutil
import pytest
from conftest import assert_no_ranks_left, rank_children, wait_until

from nblaunch import (
    DistributedOperationException,
    LaunchError,
    RankFailedError,
    RendezvousTimeoutError,
    RunStoppedError,
    notebook_launcher,
)
from nblaunch.cluster import head as cluster_head
from nblaunch.cluster.network import Route, describe, route_to, socket_env
from nblaunch.cluster.plan import MultiNodePlan
from nblaunch.cluster.run import MultiNodeRun, launch_multinode
from nblaunch.cluster.store import (
    BoundedStore,
    node_rank_of,
    parse_endpoint,
    signal_handlers_kept,
)
from nblaunch.engine.detached import registry as detached
from nblaunch.engine.plan.launch_plan import loopback_interface
from nblaunch.events import NullView
from nblaunch.options import LaunchOptions, NodeOptions
from nblaunch.ranks.default_group import connect_hint

# The joined node cannot import this test module: send the functions defined here by value, as
# functions defined in a notebook are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LINES = 20_000  # printed by a rank on the other node: none may be lost or reordered
HEAD = "127.0.0.2"  # the notebook node's address; 127.0.0.1 must not answer on its port


def free_port(host: str = HEAD) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def port_answers(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


class Recorder:
    """A view that keeps every event (thread-safe enough for a reader polling a list)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def handle(self, event) -> None:
        self.events.append(dict(event))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e["kind"] == kind]


class Joiner:
    """A ``python -m nblaunch join`` process: the second node."""

    def __init__(self, endpoint: str, run_id: str, log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115
        command = [sys.executable, "-m", "nblaunch", "join", endpoint, "--run-id", run_id]
        self.process = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        """Stop the joiner and its ranks if a test left them running (by PID, ours only)."""
        for child in self.descendants():
            child.kill()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._out.close()


_run_ids = itertools.count()


class TwoNodes:
    """One run's endpoint, run id and run directory, and its joiners (stopped at the end)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.endpoint = f"{HEAD}:{self.port}"
        self.run_id = f"test{os.getpid()}-{next(_run_ids)}"
        self.run_dir = tmp_path / "runs" / self.run_id
        self.joiners: list[Joiner] = []

    def start_joiner(self) -> Joiner:
        joiner = Joiner(
            self.endpoint, self.run_id, self.tmp_path / f"joiner{len(self.joiners)}.log"
        )
        self.joiners.append(joiner)
        return joiner

    def launch(self, function, num_processes=1, *, rdzv_timeout=60, num_nodes=2, view=None):
        return launch_multinode(
            function,
            (),
            num_processes,
            LaunchOptions(device_type="cpu", run_dir=self.run_dir),
            NodeOptions(num_nodes, self.endpoint, rdzv_timeout),
            view_factory=lambda: NullView() if view is None else view,
        )

    def start_pool(self, **options):
        """A pool of 1 CPU rank per node across these nodes (``options``: start_pool's)."""
        from nblaunch.notebook.pool_start import start_pool

        options = {"num_nodes": 2, "rdzv_timeout": 60, "device_type": "cpu", **options}
        return start_pool(
            1,
            rdzv_endpoint=self.endpoint,
            rdzv_id=self.run_id,
            run_dir=self.run_dir,
            display="none",
            **options,
        )


@pytest.fixture
def nodes(tmp_path):
    two = TwoNodes(tmp_path)
    yield two
    for joiner in two.joiners:
        joiner.close()


# --- pieces --------------------------------------------------------------------------------------


def test_node_ranks_put_the_notebook_node_first_and_keep_the_others_in_order():
    for nodes in range(1, 6):
        for head in range(nodes):
            ranks = [node_rank_of(r, head) for r in range(nodes)]
            assert ranks[head] == 0
            assert sorted(ranks) == list(range(nodes))
            others = [ranks[r] for r in range(nodes) if r != head]
            assert others == sorted(others)


def test_endpoints_parse_and_bad_ones_are_refused():
    assert parse_endpoint("head-node:29401") == ("head-node", 29401)
    assert parse_endpoint("head-node") == ("head-node", 29400)
    assert parse_endpoint("[::1]:1234") == ("::1", 1234)
    for bad in ("", "host:notaport", None):
        with pytest.raises(LaunchError, match="rdzv_endpoint"):
            parse_endpoint(bad)


PLAN_FIELDS = dict(
    world_size=8,
    device_type="cpu",
    backend="gloo",
    start_method="spawn",
    master_addr="head",
    master_port=29400,
    debug=False,
    init_process_group=True,
    timeout=None,
    hang_timeout=None,
    log_level=None,
    run_dir=None,
    device_kind="CPU",
    num_nodes=2,
    nproc_per_node=4,
    node_rank=1,
    rdzv_run_id="run7",
)


def test_each_rank_gets_the_multi_node_torchrun_contract():
    plan = MultiNodePlan(**PLAN_FIELDS)
    assert plan.local_ranks == [4, 5, 6, 7]
    env = plan.rank_env(6)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
    }
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "29400")
    assert env["TORCHELASTIC_RUN_ID"] == "run7"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_ranks_get_the_interface_that_reaches_the_endpoint_unless_one_was_set(monkeypatch):
    route = route_to(HEAD, 29400)  # one of this machine's own addresses: its own interface
    assert route is not None and route.interface == loopback_interface()
    assert route.address == HEAD
    assert socket_env(route, {}) == {
        "GLOO_SOCKET_IFNAME": route.interface,
        "NCCL_SOCKET_IFNAME": route.interface,
    }
    assert socket_env(route, {"GLOO_SOCKET_IFNAME": "eth9"}) == {
        "NCCL_SOCKET_IFNAME": route.interface
    }
    assert f"gloo and NCCL use {route.interface} ({HEAD})" in describe(route, {})
    assert (
        describe(route, {"NCCL_SOCKET_IFNAME": "ib0"}) == "network: NCCL_SOCKET_IFNAME=ib0 (as set)"
    )
    assert "no interface found" in describe(None, {})
    assert route_to("no-such-host.invalid", 29400) is None

    fake = Route("10.0.0.1", "eth7", "10.0.0.2")
    plan = MultiNodePlan(**{**PLAN_FIELDS, "route": fake})
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = plan.rank_env(1)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("eth7", "ib0")


def test_a_peer_connection_that_fails_says_the_address_the_node_and_what_to_set(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    message = (
        "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
        "Connection refused, remote=[127.0.0.1]:46477"
    )
    hint = connect_hint(message, 3)
    assert hint is not None
    assert "rank 3 on node 1" in hint and "interface eth0" in hint
    assert "127.0.0.1:46477" in hint and "loopback" in hint
    assert "GLOO_SOCKET_IFNAME" in hint and "NCCL_SOCKET_IFNAME" in hint
    assert connect_hint("some other error", 3) is None


def test_a_bounded_store_gives_up_on_a_call_that_gets_no_answer():
    answered = threading.Event()

    class Silent:
        def check(self, keys):
            return True

        def get(self, key):
            answered.wait(10)  # a partition: no answer
            return b"late"

    store = BoundedStore(Silent(), timeout=0.3)
    assert store.check(["k"]) is True
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer for 0.3 s"):
        store.get("k")
    assert time.monotonic() - began < 2
    with pytest.raises(TimeoutError):  # at once from then on
        store.check(["k"])
    answered.set()


def test_num_nodes_without_an_endpoint_is_refused_before_anything_starts():
    with pytest.raises(LaunchError, match="rdzv_endpoint"):
        notebook_launcher(print, (), 1, num_nodes=2, device_type="cpu", display="none")


def test_an_endpoint_that_is_not_this_machine_is_refused():
    with pytest.raises(LaunchError, match="cannot listen on rdzv_endpoint 192.0.2.1"):
        notebook_launcher(
            print, (), 1, num_nodes=2, rdzv_endpoint="192.0.2.1:29400", display="none"
        )


def test_a_node_is_named_with_its_host_once_it_said_it():
    run = MultiNodeRun.__new__(MultiNodeRun)  # only its head's host names are read
    run.head = types.SimpleNamespace(hosts={1: "vm-a"})
    assert run.node_named(1) == "node 1 (vm-a)"
    assert run.node_named(2) == "node 2"  # not "node 2 (node 2)" or "node 2 (?)"


def test_signal_handlers_are_put_back():
    def mine(signum, frame):
        pass

    before = signal.getsignal(signal.SIGINT)
    with signal_handlers_kept():
        signal.signal(signal.SIGINT, mine)  # what torch.distributed.elastic's agent does
    assert signal.getsignal(signal.SIGINT) is before


# --- two nodes -----------------------------------------------------------------------------------


def _contract(port):
    import os
    import socket

    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says hello from node {os.environ['GROUP_RANK']}", flush=True)
    if dist.get_rank() == 3:
        for i in range(LINES):
            print(f"line {i}")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
    with socket.socket() as probe:  # the rendezvous must not listen on other addresses
        probe.settimeout(1.0)
        other_address_answers = probe.connect_ex(("127.0.0.1", port)) == 0
    return {k: os.environ[k] for k in keys}, total.item(), other_address_answers


# Not marked slow: it took over the display="none" checks that `make test-fast` runs.
def test_two_nodes_run_and_return_every_ranks_value(nodes, capfd):
    handler_before = signal.getsignal(signal.SIGINT)
    joiner = nodes.start_joiner()  # before the notebook: it waits for the endpoint to answer
    results = notebook_launcher(
        _contract,
        (nodes.port,),
        2,
        num_nodes=2,
        rdzv_endpoint=nodes.endpoint,
        rdzv_timeout=60,
        device_type="cpu",
        run_dir=nodes.run_dir,
        display="none",
    )
    assert [r[0]["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert [r[0]["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r[0]["GROUP_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert {r[0]["WORLD_SIZE"] for r in results} == {"4"}
    assert {r[0]["LOCAL_WORLD_SIZE"] for r in results} == {"2"}
    assert {r[0]["MASTER_ADDR"] for r in results} == {HEAD}
    assert [r[1] for r in results] == [10.0] * 4
    assert not any(r[2] for r in results), "the rendezvous answered on 127.0.0.1"
    assert joiner.wait(15) == 0, joiner.output()
    # The remote ranks' output reached the notebook node's logs.
    log = (nodes.run_dir / "rank3.log").read_text().splitlines()
    assert "rank 3 says hello from node 1" in log
    numbered = [line for line in log if line.startswith("line ")]
    assert numbered == [f"line {i}" for i in range(LINES)]
    assert signal.getsignal(signal.SIGINT) is handler_before
    # With display="none" the join command goes to stderr and the nodes' log.
    err = capfd.readouterr().err
    assert "nblaunch: waiting for 1 more node(s)" in err
    assert f"python -m nblaunch join {nodes.endpoint} --run-id {nodes.run_id}" in err
    assert "NBLAUNCH_RUN_SECRET=" in err  # what the other node needs, where it can be read
    log = (nodes.run_dir / "nodes.log").read_text()
    assert f"--run-id {nodes.run_id}" in log and "node 1 started" in log
    assert "NBLAUNCH_RUN_SECRET=<the run's secret>" in log  # the secret stays out of files
    assert not port_answers(HEAD, nodes.port), "the rendezvous port is still open"
    assert_no_ranks_left(5)


def _fail_on_the_remote_node():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("about to fail", flush=True)
        time.sleep(0.5)
        raise ValueError("boom on the other node")
    dist.barrier()  # rank 0 waits for a peer that will never come
    time.sleep(60)


@pytest.mark.slow
def test_a_failure_on_the_other_node_fails_the_run_with_its_exception(nodes):
    joiner = nodes.start_joiner()
    view = Recorder()
    with pytest.raises(ValueError, match="boom on the other node") as caught:
        nodes.launch(_fail_on_the_remote_node, view=view)
    assert "raised on rank 1 of 2" in "\n".join(getattr(caught.value, "__notes__", []))
    assert joiner.wait(15) == 1, joiner.output()  # the other node stopped its ranks
    assert not joiner.descendants()
    assert_no_ranks_left(5)
    failures = [e for e in view.of("failure") if e["rank"] == 1]
    assert failures and failures[0]["host"] and failures[0]["node"] == 1  # tagged with its node
    assert "about to fail" in (nodes.run_dir / "rank1.log").read_text()


def _shapes_differ_across_nodes():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2 if dist.get_rank() == 1 else 1))


def test_a_collective_mismatch_across_nodes_is_proven_not_a_hang(nodes):
    # The joined node's ranks send their calls' records to its join, which passes them on to
    # the notebook: before, no join read them and a mismatch across nodes waited out
    # hang_timeout.
    joiner = nodes.start_joiner()
    began = time.monotonic()
    with pytest.raises(DistributedOperationException, match=r"all_reduce"):
        nodes.launch(_shapes_differ_across_nodes)
    assert time.monotonic() - began < 20
    assert joiner.wait(15) == 1, joiner.output()


def _remote_rank_dies():
    import os
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("last words", flush=True)
        os._exit(7)
    time.sleep(60)


@pytest.mark.slow
def test_a_remote_rank_that_dies_without_an_exception_is_named(nodes):
    joiner = nodes.start_joiner()
    with pytest.raises(RankFailedError, match="rank 1 of 2 exited with code 7") as caught:
        nodes.launch(_remote_rank_dies)
    assert caught.value.rank == 1 and caught.value.exitcode == 7
    assert "last words" in str(caught.value)  # its last output travelled with it
    assert joiner.wait(15) == 1, joiner.output()
    assert_no_ranks_left(5)


@pytest.mark.slow
def test_a_node_that_never_joins_is_named_after_the_timeout(nodes):
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as caught:
        nodes.launch(print, rdzv_timeout=2)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert nodes.endpoint in message and "only 1 of 2 nodes" in message
    assert f"--run-id {nodes.run_id}" in message  # says what to run on the missing node
    assert (caught.value.joined, caught.value.expected) == (1, 2)
    assert 2 <= elapsed < 15
    assert not rank_children()
    assert not port_answers(HEAD, nodes.port)


def _sleep_forever():
    import time

    while True:
        time.sleep(0.1)


@pytest.mark.slow
def test_interrupt_stops_every_node_and_keeps_the_notebooks_handler(nodes):
    joiner = nodes.start_joiner()
    view = Recorder()
    handler_before = signal.getsignal(signal.SIGINT)

    def interrupt_once_both_ranks_run():
        if wait_until(lambda: len(view.of("started")) == 2, 60):
            signal.raise_signal(signal.SIGINT)

    thread = threading.Thread(target=interrupt_once_both_ranks_run, daemon=True)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        nodes.launch(_sleep_forever, view=view)
    thread.join(5)
    assert len(view.of("started")) == 2, "the interrupt came before both ranks ran"
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert joiner.wait(15) == 1, joiner.output()
    assert not joiner.descendants()
    assert_no_ranks_left(5)
    # The remote rank saw the interrupt as a KeyboardInterrupt in its task.
    remote = [e for e in view.of("failure") if e["rank"] == 1]
    assert remote and remote[0]["exc_type"] == "builtins.KeyboardInterrupt"


@pytest.mark.slow
def test_a_node_that_goes_silent_fails_the_run(nodes, monkeypatch):
    monkeypatch.setattr(cluster_head, "NODE_SILENCE_S", 3.0)
    joiner = nodes.start_joiner()
    view = Recorder()

    def kill_the_other_node():
        if wait_until(lambda: len(view.of("started")) == 2, 60):
            for child in joiner.descendants():
                child.kill()  # the machine is gone: its ranks with it
            joiner.process.kill()

    thread = threading.Thread(target=kill_the_other_node, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="node 1 .* sent nothing for 3 s"):
        nodes.launch(_sleep_forever, view=view)
    thread.join(5)
    assert time.monotonic() - started < 60
    assert_no_ranks_left(5)


@pytest.mark.slow
def test_interrupt_while_nodes_gather_closes_the_rendezvous(nodes):
    joiner = nodes.start_joiner()
    view = Recorder()
    handler_before = signal.getsignal(signal.SIGINT)

    def interrupt_once_a_node_joined():
        if wait_until(lambda: any("joined" in e["title"] for e in view.of("diagnosis")), 60):
            signal.raise_signal(signal.SIGINT)

    thread = threading.Thread(target=interrupt_once_a_node_joined, daemon=True)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        nodes.launch(print, num_nodes=3, view=view)  # a third node never comes
    thread.join(5)
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert joiner.wait(20) == 1, joiner.output()  # told the run was closed, not left waiting
    assert "before it started: interrupted in the notebook" in joiner.output()
    assert not port_answers(HEAD, nodes.port)


@pytest.mark.slow
def test_join_says_when_it_cannot_reach_the_notebook():
    endpoint = f"{HEAD}:{free_port()}"
    command = ["join", endpoint, "--run-id", "x", "--connect-timeout", "0.5"]
    done = subprocess.run(
        [sys.executable, "-m", "nblaunch", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"cannot reach {endpoint}" in done.stderr


@pytest.mark.slow
def test_a_node_stopped_on_its_own_fails_the_run(nodes):
    joiner = nodes.start_joiner()
    view = Recorder()

    def cancel_the_other_node():  # as Slurm's scancel does
        if wait_until(lambda: len(view.of("started")) == 2, 60):
            joiner.process.send_signal(signal.SIGTERM)

    thread = threading.Thread(target=cancel_the_other_node, daemon=True)
    thread.start()
    stopped = r"node 1 .* stopped its ranks on its own: terminated on this node \(SIGTERM: kill\)"
    with pytest.raises(RankFailedError, match=stopped):
        nodes.launch(_sleep_forever, view=view)
    thread.join(5)
    assert joiner.wait(15) == 1, joiner.output()
    assert not joiner.descendants()
    assert_no_ranks_left(5)


# --- pinned run ids, and the join command told whatever the display ---------------------------


def _rank_and_run_id():
    return os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"]


def test_a_pinned_run_id_lets_join_start_before_the_cell(nodes, tmp_path):
    pinned = f"pinned-{os.getpid()}"
    joiner = Joiner(nodes.endpoint, pinned, tmp_path / "early-joiner.log")
    nodes.joiners.append(joiner)
    time.sleep(1.0)  # the join command is waiting before the cell runs
    results = notebook_launcher(
        _rank_and_run_id,
        (),
        1,
        num_nodes=2,
        rdzv_endpoint=nodes.endpoint,
        rdzv_id=pinned,
        rdzv_timeout=60,
        device_type="cpu",
        run_dir=tmp_path / "runs" / "named-otherwise",
        display="none",
    )
    assert results == [("0", pinned), ("1", pinned)]
    assert joiner.wait(15) == 0, joiner.output()
    assert f"joining run {pinned}" in joiner.output()


@pytest.mark.parametrize("bad", ["", "has space", "../up", "x" * 65, 7])
def test_a_run_id_that_cannot_name_a_run_is_refused(bad):
    with pytest.raises(LaunchError, match=r"rdzv_id=.*a run id is 1 to 64 letters"):
        notebook_launcher(
            print, num_processes=1, num_nodes=2, rdzv_endpoint=f"{HEAD}:{free_port()}", rdzv_id=bad
        )


@pytest.mark.slow
def test_a_run_on_two_nodes_goes_on_detached_and_in_the_background(nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(tmp_path / "detached"))
    options = dict(num_nodes=2, rdzv_endpoint=nodes.endpoint, rdzv_timeout=60, device_type="cpu")
    handle = notebook_launcher(
        _rank_and_run_id, (), 1, rdzv_id=nodes.run_id, detach=True, display="none", **options
    )
    assert handle.detached and handle.state == "running"  # its host waits for the other node
    nodes.start_joiner()
    assert handle.result(60) == [("0", nodes.run_id), ("1", nodes.run_id)]
    assert "all 2 nodes joined" in (handle.run_dir / "nodes.log").read_text()
    host = detached.find(handle.id).pid  # the run host ends with its run, leaving nothing
    assert wait_until(lambda: not detached.host_alive(host), 15)

    # In the background, stopped while the nodes gather: the rendezvous closes, nothing is left.
    waiting = notebook_launcher(print, (), 1, block=False, display="none", **options)
    assert wait_until(lambda: port_answers(HEAD, nodes.port), 20)
    waiting.stop()
    with pytest.raises(RunStoppedError):
        waiting.result(10)
    assert waiting.state == "stopped"
    assert not port_answers(HEAD, nodes.port)
