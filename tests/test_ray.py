"""Runs whose other nodes a real Ray cluster places (``cluster="ray"``).

One Ray cluster for the file (``ray.cluster_utils.Cluster``): a head and two worker nodes, each
its own raylet with one CPU, on this machine; ``remove_node`` is a real node loss (its raylet and
its workers end). Run alone with ``pytest -m ray``. Without Ray installed the file is skipped,
saying so.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest
from conftest import wait_until

# Read by Ray as it is imported: every daemon of the test cluster, and the address Ray reports
# for this node (the rendezvous), stays on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'nblaunch[ray]'")

import nblaunch  # noqa: E402
from nblaunch import DistributedOperationException, LaunchError, RankFailedError  # noqa: E402

# The other nodes have no checkout of the tests: this module's functions travel by value, as a
# notebook's do (a module of the user's goes with RayCluster(runtime_env=...)).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        started.add_node(num_cpus=1)
    started.wait_for_nodes()
    ray.init(address=started.address, log_to_driver=True)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    yield started
    ray.shutdown()
    started.shutdown()


def where_am_i():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # A DDP step: each rank's own batch, the gradients averaged across the nodes in backward().
    torch.manual_seed(dist.get_rank())
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    grads = [torch.zeros(1, 4) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, model.module.weight.grad)
    assert all(torch.equal(grad, grads[0]) for grad in grads), grads
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    shipped = os.environ.get("NBLAUNCH_TEST_SHIPPED")  # a runtime_env's variable, if any
    print(f"hello from rank {dist.get_rank()} ({shipped})", flush=True)
    return dist.get_rank(), dist.get_world_size(), os.getpid(), float(total)


def test_three_nodes_return_every_rank_s_value_and_print_each_line_once(cluster, capfd):
    # What Ray can give an actor (variables, packages, URIs) goes to each agent, and from it to
    # its node's ranks; this node's ranks are the notebook's own and get none of it.
    marked = nblaunch.RayCluster(runtime_env={"env_vars": {"NBLAUNCH_TEST_SHIPPED": "yes"}})
    values = nblaunch.notebook_launcher(
        where_am_i, num_processes=1, num_nodes=3, cluster=marked, display="text"
    )
    assert [(rank, size, total) for rank, size, _, total in values] == [
        (0, 3, 6.0),
        (1, 3, 6.0),
        (2, 3, 6.0),
    ]
    assert len({pid for _, _, pid, _ in values}) == 3
    time.sleep(1.0)  # what Ray's log forwarding would print comes within its flush interval
    out, err = capfd.readouterr()
    for rank, shipped in enumerate(["None", "yes", "yes"]):
        assert out.count(f"hello from rank {rank} ({shipped})") == 1, out
    # Ray's log forwarding prints worker output as "(JoinAgent pid=...) ..."; none may come.
    assert "JoinAgent" not in out + err and "pid=" not in out + err, out + err
    # The view says what was asked of Ray while it places, then where the nodes run.
    assert "asking Ray to place 3 nodes" in out + err
    assert "Ray placed the other node(s)" in out + err


def fails_on_rank_2():
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise ValueError("boom on rank 2")
    dist.barrier()


def test_a_rank_s_error_on_another_node_is_that_rank_s_own(cluster):
    began = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 2") as info:
        nblaunch.notebook_launcher(
            fails_on_rank_2, num_processes=1, num_nodes=3, cluster="ray", display="none"
        )
    assert "rank 2" in "\n".join(getattr(info.value, "__notes__", [])) or "rank 2" in str(
        info.value
    )
    assert time.monotonic() - began < 60


def mismatched_all_reduce():
    import torch
    import torch.distributed as dist

    size = 2 if dist.get_rank() == 1 else 1
    dist.all_reduce(torch.ones(size))


def test_a_collective_mismatch_across_nodes_is_proven(cluster):
    with pytest.raises(DistributedOperationException, match=r"all_reduce"):
        nblaunch.notebook_launcher(
            mismatched_all_reduce,
            num_processes=1,
            num_nodes=3,
            cluster="ray",
            display="none",
            hang_timeout=30,
        )


def test_a_placement_ray_cannot_meet_fails_at_once_saying_what_is_missing(cluster):
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"could not place 5 nodes with 1 CPU each") as info:
        nblaunch.notebook_launcher(
            where_am_i,
            num_processes=1,
            num_nodes=5,
            cluster=nblaunch.RayCluster(placement_timeout=2),
            display="none",
        )
    assert "this cluster has 3 alive node(s)" in str(info.value)
    assert time.monotonic() - began < 15
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
    )


def test_cluster_options_are_checked_before_anything_starts(cluster):
    with pytest.raises(LaunchError, match="num_nodes=N"):
        nblaunch.notebook_launcher(where_am_i, num_processes=1, cluster="ray")
    with pytest.raises(LaunchError, match="leave start_nodes='ssh' out"):
        nblaunch.notebook_launcher(
            where_am_i, num_processes=1, num_nodes=2, cluster="ray", start_nodes="ssh"
        )
    with pytest.raises(LaunchError, match="give 'ray' or nblaunch.RayCluster"):
        nblaunch.notebook_launcher(where_am_i, num_processes=1, num_nodes=2, cluster="k8s")
    with pytest.raises(LaunchError, match=r"a Ray Client connection \(ray://...\) is not"):
        nblaunch.notebook_launcher(
            where_am_i,
            num_processes=1,
            num_nodes=2,
            cluster=nblaunch.RayCluster(address="ray://head:10001"),
        )


def test_without_ray_the_error_names_the_install(monkeypatch):
    from nblaunch.cluster import ray_nodes

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(LaunchError, match=r"pip install 'nblaunch\[ray\]'"):
        ray_nodes.connect(ray_nodes.RayCluster())


def waits_forever(folder):
    import pathlib

    import torch.distributed as dist

    pathlib.Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def test_a_lost_node_ends_the_run_naming_it_and_leaves_no_rank(cluster, tmp_path):
    workers = [node for node in cluster.worker_nodes]
    removed: list[float] = []

    def lose_a_node():
        if wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 3, 60):
            removed.append(time.monotonic())
            cluster.remove_node(workers[-1])

    threading.Thread(target=lose_a_node, daemon=True).start()
    try:
        with pytest.raises((RankFailedError, LaunchError)) as info:
            nblaunch.notebook_launcher(
                waits_forever,
                (str(tmp_path),),
                num_processes=1,
                num_nodes=3,
                cluster="ray",
                display="none",
            )
        named_after = time.monotonic() - removed[0]
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 3
        # Ray reports the agent dead, or the join says it was ended (SIGTERM when its agent
        # died): well before the node's silence (8 s) would tell.
        named = r"node \d .*(its Ray agent died|its Ray agent ended|its join was killed)"
        assert re.search(named, str(info.value)), str(info.value)
        print(f"lost node named {named_after:.1f} s after its removal: {info.value}")
        assert named_after < 4, named_after
        assert wait_until(lambda: not any(_alive(pid) for pid in pids), 15), pids
    finally:
        cluster.add_node(num_cpus=1)  # the next test's cluster has three nodes again
        cluster.wait_for_nodes()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_node_whose_versions_differ_is_named_before_anything_starts(cluster, monkeypatch):
    from nblaunch.cluster import ray_nodes

    # The agents report their node's real versions; this notebook says it has another torch.
    real = ray_nodes.versions()
    monkeypatch.setattr(ray_nodes, "versions", lambda: {**real, "torch": "0.0.1"})
    with pytest.raises(LaunchError, match="differ from this one; nothing was started") as info:
        nblaunch.notebook_launcher(
            where_am_i, num_processes=1, num_nodes=3, cluster="ray", display="none"
        )
    nodes = str(info.value).splitlines()[1:3]  # each node, with only what differs
    assert [re.sub(r"node \w+", "node ID", line.strip()) for line in nodes] == [
        f"{socket.gethostname()} at 127.0.0.1 (Ray node ID): torch {real['torch']} (here 0.0.1)"
    ] * 2, str(info.value)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_a_pool_keeps_its_agents_across_cells_and_restarts_after_a_lost_node(cluster, tmp_path):
    worker = next(iter(cluster.worker_nodes))
    with nblaunch.Pool(1, num_nodes=3, cluster="ray", display="none") as pool:
        first = pool.run(where_am_i)
        second = pool.run(where_am_i)
        assert [pid for _, _, pid, _ in first] == [pid for _, _, pid, _ in second]
        assert [total for *_, total in second] == [6.0, 6.0, 6.0]
        assert len(pool.nodes.starter.started) == 2
        try:
            threading.Timer(1.0, cluster.remove_node, (worker,)).start()
            began = time.monotonic()
            with pytest.raises(RankFailedError, match=r"node \d .*") as failure:
                pool.run(waits_forever, str(tmp_path))
            print(f"lost node named after {time.monotonic() - began:.1f} s")
            assert "The pool lost node" in "\n".join(getattr(failure.value, "__notes__", []))
        finally:
            cluster.add_node(num_cpus=1)  # where Ray places the lost node's bundle again
            cluster.wait_for_nodes()
        pool.restart()
        again = pool.run(where_am_i)
        assert [total for *_, total in again] == [6.0, 6.0, 6.0]
        assert again[0][2] != first[0][2]  # fresh ranks, on three nodes again


def test_a_background_run_on_three_nodes_frees_the_cell_and_stops_everywhere(cluster, tmp_path):
    # (A background run's values: the kernel test's --bg cell.)
    handle = nblaunch.notebook_launcher(
        waits_forever,
        (str(tmp_path),),
        num_processes=1,
        num_nodes=3,
        cluster="ray",
        block=False,
        display="none",
    )
    assert handle.state == "running"  # the cell is free while the nodes gather and run
    assert wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 3, 60)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    handle.stop()
    with pytest.raises(nblaunch.RunStoppedError):
        handle.result(30)
    assert handle.state == "stopped"
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), 15), pids


# A notebook with a module of its own in its folder (argv[2]), shipped to the other nodes by
# the runtime_env nblaunch connects to Ray with.
DETACHING = """
import sys, nblaunch
sys.path.insert(0, sys.argv[2])

def where():
    import os
    import shipped_by_ray
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size(), os.getpid(), shipped_by_ray.VALUE

cluster = nblaunch.RayCluster(
    address=sys.argv[1], runtime_env={"py_modules": [sys.argv[2] + "/shipped_by_ray"]}
)
handle = nblaunch.notebook_launcher(
    where, num_processes=1, num_nodes=3, cluster=cluster, detach=True, display="none"
)
print(handle.id, flush=True)
"""


def test_a_detached_run_on_three_nodes_outlives_its_process_and_is_attached_again(
    cluster, tmp_path, monkeypatch
):
    monkeypatch.setenv("NBLAUNCH_DETACHED_DIR", str(tmp_path / "detached"))
    notebook = tmp_path / "notebook"
    (notebook / "shipped_by_ray").mkdir(parents=True)
    (notebook / "shipped_by_ray" / "__init__.py").write_text("VALUE = 42\n")
    started = subprocess.run(
        [sys.executable, "-c", DETACHING, cluster.address, str(notebook)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NBLAUNCH_SPARE_RANKS": "0"},
    )
    assert started.returncode == 0, started.stderr[-3000:]
    run_id = started.stdout.split()[-1]  # the process that started it has ended
    handle = nblaunch.attach(run_id)
    values = handle.result(90)
    assert [(rank, size, value) for rank, size, _, value in values] == [
        (0, 3, 42),
        (1, 3, 42),
        (2, 3, 42),
    ]
    assert len({pid for _, _, pid, _ in values}) == 3
    assert handle.state == "done"
    log = (handle.run_dir / "nodes.log").read_text()
    assert "Ray placed the other node(s)" in log, log


def test_in_a_kernel_the_magics_run_a_cell_on_three_ray_nodes(cluster, tmp_path):
    from conftest import Kernel

    kernel = Kernel(tmp_path)
    try:
        setup = kernel.run(
            f"import os, ray\nos.environ['NBLAUNCH_RUN_DIR'] = {str(tmp_path / 'runs')!r}\n"
            f"ray.init(address={cluster.address!r})\n%load_ext nblaunch"
        )
        assert setup["error"] is None, setup
        cell = kernel.run(
            "%%distributed -n 1 --nodes 3 --cluster ray\n"
            "import socket\n"
            "print(f'rank {rank} says hi', flush=True)\n"
            "x = rank * 10\n"
            "x",
            timeout=120,
        )
        assert cell["error"] is None, cell
        assert cell["result"] == "0", cell  # rank 0's value, as on one machine
        # The lines went to the cell's widget; every rank's log is on the notebook's node too.
        (run_dir,) = (tmp_path / "runs").iterdir()
        for rank in range(3):
            log = (run_dir / f"rank{rank}.log").read_text()
            assert log.count(f"rank {rank} says hi") == 1, log
        assert "JoinAgent" not in cell["out"] and "pid=" not in cell["out"], cell["out"]
        background = kernel.run(
            "%%distributed -n 1 --nodes 3 --cluster ray --bg\nrank + 100", timeout=60
        )
        assert background["error"] is None, background
        done = kernel.run("_.result(90)", timeout=120)
        assert done["error"] is None and done["result"] == "100", done
    finally:
        kernel.close()


def test_local_folders_for_the_runtime_env_of_a_connected_kernel_are_refused(cluster, tmp_path):
    # This process connected to Ray before (the fixture's ray.init); Ray ships local folders for
    # a whole job only: said before anything starts, with the fix.
    folders = nblaunch.RayCluster(runtime_env={"py_modules": [str(tmp_path)]})
    with pytest.raises(LaunchError, match=r"local folders .* pass the runtime_env to ray.init"):
        nblaunch.notebook_launcher(
            where_am_i, num_processes=1, num_nodes=3, cluster=folders, display="none"
        )
