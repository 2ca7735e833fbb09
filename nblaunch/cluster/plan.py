"""The plan of a multi-node run: global ranks per node, the torchrun contract, the settings sent.

Node 0 (the notebook's) is planned from the launch's options (:func:`plan_nodes`); a joined node
from the settings it reads in the store and its own devices (:func:`plan_for_joined_node`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from typing import Any

from nblaunch.cluster.channel import CONFIG_VERSION
from nblaunch.cluster.network import Route, describe, route_to, socket_env
from nblaunch.cluster.store import listen_on, parse_endpoint
from nblaunch.engine.plan.devices import detect_devices
from nblaunch.engine.plan.launch_plan import LaunchPlan, plan_launch
from nblaunch.errors import LaunchError
from nblaunch.options import LaunchOptions, NodeOptions


@dataclasses.dataclass
class MultiNodePlan(LaunchPlan):
    """A launch plan for one node of a multi-node run.

    ``world_size`` counts every rank of every node; this node runs global ranks
    ``node_rank * nproc_per_node`` to ``(node_rank + 1) * nproc_per_node - 1``.
    """

    num_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_run_id: str = "nblaunch"
    pool: bool = False  # ranks stay up between tasks, which come through the store
    # How this node reaches the rendezvous endpoint: its ranks' gloo/NCCL interface.
    route: Route | None = None

    @property
    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    @property
    def run_id(self) -> str:
        return self.rdzv_run_id

    @property
    def threads_per_rank(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.nproc_per_node)

    def rank_env(self, rank: int) -> dict[str, str]:
        """The torchrun contract for ``rank`` of a multi-node run, as ``torchrun`` sets it."""
        env = super().rank_env(rank)
        env.update(
            LOCAL_RANK=str(rank - self.node_rank * self.nproc_per_node),
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            NODE_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.num_nodes),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self.world_size),
            ROLE_NAME="default",
            TORCHELASTIC_RUN_ID=self.rdzv_run_id,
            # Every rank is a client of the store the notebook node hosts on MASTER_ADDR:PORT
            # (torch's env:// init honours this too, for code that sets up its own group).
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        # Never the address the hostname resolves to (often loopback): the endpoint's interface.
        env.update(socket_env(self.route))
        return env

    def node_config(self) -> dict[str, Any]:
        """What a joining node needs from this plan to start its ranks (sent through the store)."""
        return {
            "version": CONFIG_VERSION,
            "num_nodes": self.num_nodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "device_type": self.device_type,
            "backend": self.backend,
            "debug": self.debug,
            "checks": self.checks,
            "init_process_group": self.init_process_group,
            "hang_timeout": self.hang_timeout,
            "log_level": self.log_level,
            "master_port": self.master_port,
            "pool": self.pool,
            "mixed_precision": self.mixed_precision,
        }


def plan_for_joined_node(
    config: dict[str, Any],
    *,
    node_rank: int,
    run_id: str,
    master_addr: str,
    start_method: str,
) -> MultiNodePlan:
    """The plan of a joined node, from the notebook's config and this node's own devices.

    Raises
    ------
    LaunchError
        When this node lacks the devices the run needs.
    """

    devices = detect_devices(config["device_type"])
    device_type, count, device_kind = devices.type, devices.count, devices.kind
    if device_type != "cpu" and config["nproc_per_node"] > count:
        raise LaunchError(
            f"the run needs {config['nproc_per_node']} {device_type.upper()} device(s) per node "
            f"but {socket.gethostname()} has {count}"
        )
    return MultiNodePlan(
        world_size=config["world_size"],
        device_type=device_type,
        backend=config["backend"],
        start_method=start_method,
        master_addr=master_addr,
        master_port=config["master_port"],
        debug=config["debug"],
        checks=bool(config.get("checks")),
        init_process_group=config["init_process_group"],
        timeout=None,
        hang_timeout=config["hang_timeout"],
        log_level=config["log_level"],
        run_dir=None,
        device_kind=device_kind,
        num_nodes=config["num_nodes"],
        nproc_per_node=config["nproc_per_node"],
        node_rank=node_rank,
        rdzv_run_id=run_id,
        pool=bool(config.get("pool")),
        mixed_precision=config.get("mixed_precision"),  # absent from an older notebook's
        route=route_to(master_addr, config["master_port"]),
    )


def plan_nodes(
    function: Any,
    num_processes: int | None,
    options: LaunchOptions,
    nodes: NodeOptions,
    pool: bool = False,
) -> MultiNodePlan:
    """Plan node 0 (this one) of a run on ``nodes``.

    Raises
    ------
    LaunchError
        Bad arguments, or an address this machine cannot listen on.
    """
    assert nodes.rdzv_endpoint is not None  # NodeOptions checked it
    host, port = parse_endpoint(nodes.rdzv_endpoint)
    listen_on(host, port).close()  # say now, in its own words, when we cannot listen there
    base = plan_launch(function, num_processes, options.replace(master_addr=host, master_port=None))
    if base.device_type == "xla":
        raise LaunchError("multi-node runs support CUDA and CPU ranks, not XLA devices")
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values.update(world_size=base.world_size * nodes.num_nodes, master_port=port)
    route = route_to(host, port)
    values["notes"] = [*base.notes, describe(route)]
    if route is not None and ipaddress.ip_address(route.target).is_loopback:
        values["warnings"] = [
            *base.warnings,
            f"rdzv_endpoint {host} is a loopback address ({route.target}): other machines "
            "cannot reach it; give this machine's address on the network they share",
        ]
    return MultiNodePlan(
        **values,
        num_nodes=nodes.num_nodes,
        nproc_per_node=base.world_size,
        node_rank=0,
        rdzv_run_id=nodes.rdzv_id or base.run_id,
        pool=pool,
        route=route,
    )
