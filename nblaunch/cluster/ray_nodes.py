"""The other nodes of a run, placed by a Ray cluster: a placement group, an agent actor per node.

``notebook_launcher(fn, num_processes=P, num_nodes=N, cluster="ray")`` runs node 0 here, as any
multi-node run does, and asks Ray where the other ``N - 1`` go: a placement group of one bundle
per node (``STRICT_SPREAD``, with the CPUs or GPUs each node's ranks need), and on each bundle
that is not this node's an agent actor (:class:`~nblaunch.cluster.ray_agent.JoinAgent`) that
runs what ``nblaunch join`` runs (it forks that node's ranks, relays their output and events
through the rendezvous store, supervises and contains them). Placement is Ray's; everything
else (the store, the view, the root cause, hang proofs, the checks) is nblaunch's, as on any
network.

- The rendezvous address is what Ray reports for this node (``ray.util.get_node_ip_address``).
- A placement Ray cannot meet fails within ``placement_timeout`` seconds and says what is
  missing, never a silent wait.
- A node whose Ray, Python, torch or nblaunch version differs from this one is named before
  anything starts.
- The join's output goes to a file on its node, never to Ray's log forwarding: the ranks' lines
  reach the notebook once, through nblaunch's relay, without Ray's prefixes.
- The join dies with its agent (``PR_SET_PDEATHSIG``): a node whose raylet is lost takes its
  join down, which stops that node's ranks (they watch their launcher), and the notebook names
  the node: as soon as Ray reports the agent dead (each agent has a call pending that returns
  when its join ends), or when the node has been silent for the heartbeat's limit, whichever
  comes first.

Ray is imported only here and in the agent's module, and only when a run asks for it
(``pip install 'nblaunch[ray]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from nblaunch.cluster.node_start import JoinStarter
from nblaunch.cluster.ray_agent import JoinAgent, versions
from nblaunch.engine.plan.launch_plan import choose_port
from nblaunch.errors import LaunchError

# How long the agents' joins get to end with their run before they are stopped.
END_WAIT_S = 15.0
# How often a run looks whether Ray reported an agent dead (a look costs ~0.1 ms).
LOOK_S = 0.25


@dataclass(frozen=True)
class RayCluster:
    """Run the other nodes of a multi-node launch on a Ray cluster (``cluster=`` of
    :func:`~nblaunch.notebook_launcher`, ``%%distributed --cluster ray``, pools).

    Parameters
    ----------
    address
        Where the cluster is (``ray.init(address=...)``). Default: the Ray this process
        initialised, else ``"auto"`` (``RAY_ADDRESS``, or the cluster of this node).
    resources_per_node
        Resources each node's bundle reserves besides the ranks' CPUs or GPUs (e.g.
        ``{"memory": 8e9}`` or a custom resource that marks training nodes).
    runtime_env
        Ray's runtime environment for the agents and so the ranks they fork (``working_dir``,
        ``py_modules``, ``env_vars``): ships local modules to nodes without a shared checkout.
    placement_timeout
        Seconds to wait for Ray to place every node before the launch fails, naming what is
        missing.
    """

    address: str | None = None
    resources_per_node: dict[str, float] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    placement_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not (isinstance(self.placement_timeout, (int, float)) and self.placement_timeout > 0):
            raise LaunchError(
                f"placement_timeout={self.placement_timeout!r}: give seconds, a positive number"
            )


def as_ray_cluster(cluster: Any) -> RayCluster:
    """``"ray"`` or a :class:`RayCluster`, as ``cluster=`` takes them.

    Raises
    ------
    LaunchError
        Anything else, naming what ``cluster=`` takes.
    """
    if isinstance(cluster, RayCluster):
        return cluster
    if cluster == "ray":
        return RayCluster()
    raise LaunchError(
        f"cluster={cluster!r}: give 'ray' or nblaunch.RayCluster(...) (the engine that places "
        "the nodes), or leave it out"
    )


def placed_by(
    cluster: Any, num_nodes: int | None, start_nodes: str | None, rdzv_endpoint: str | None
) -> tuple[str, str, RayCluster]:
    """The rendezvous endpoint, ``start_nodes`` and cluster of a run whose other nodes
    ``cluster`` (as ``cluster=`` takes it) places: the cluster's address is the one this
    process is connected to, so that a run host (``detach=True``) reaches the same cluster.

    Raises
    ------
    LaunchError
        Ray is missing or unreachable, or the other options contradict ``cluster``.
    """
    ray_cluster = as_ray_cluster(cluster)
    if start_nodes is not None:
        raise LaunchError(f"cluster= places the other nodes; leave start_nodes={start_nodes!r} out")
    if num_nodes is None or num_nodes < 2:
        raise LaunchError(
            f"cluster={cluster!r} places the other nodes of a run on several machines: pass "
            "num_nodes=N (2 or more), this node included"
        )
    ray_module = sys.modules.get("ray")
    connected = ray_module is not None and ray_module.is_initialized()
    ray = connect(ray_cluster)  # with the cluster's runtime_env, unless connected before
    context = ray.get_runtime_context()
    runtime_env = {**context.runtime_env, **_per_actor(ray_cluster.runtime_env, connected)}
    endpoint = rendezvous_endpoint(ray, rdzv_endpoint)
    # The job's runtime_env has Ray's URIs for the folders it shipped: the agents, and a run
    # host's own connection, get the same files.
    resolved = dataclasses.replace(
        ray_cluster, address=context.gcs_address, runtime_env=runtime_env or None
    )
    return endpoint, "ray", resolved


def _per_actor(runtime_env: dict[str, Any] | None, connected: bool) -> dict[str, Any]:
    """What of ``runtime_env`` the agents must get themselves: nothing when this process
    connected to Ray with it (the job has it), all of it when Ray was connected before.

    Raises
    ------
    LaunchError
        Ray was connected before and ``runtime_env`` names local folders, which Ray ships only
        for a whole job (``ray.init``).
    """
    if not connected or not runtime_env:
        return {}
    folders = runtime_env.get("py_modules") or []
    folders = [runtime_env.get("working_dir"), *folders]
    local = [str(f) for f in folders if f is not None and "://" not in str(f)]
    if local:
        raise LaunchError(
            f"RayCluster(runtime_env=...) names local folders ({', '.join(local)}), which Ray "
            "ships only for a whole job, and this process connected to Ray before: pass the "
            "runtime_env to ray.init(runtime_env=...) instead (every node then gets it), or "
            "leave ray.init to nblaunch"
        )
    return dict(runtime_env)


def connect(cluster: RayCluster) -> Any:
    """The ``ray`` module, connected to the cluster (the one this process initialised, else
    ``cluster.address`` or ``"auto"``).

    Raises
    ------
    LaunchError
        Ray is not installed, or no cluster answers.
    """
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "cluster='ray' needs Ray in this environment: pip install 'nblaunch[ray]' (or "
            "pip install ray), matching the cluster's version"
        ) from None
    from ray.util.client import ray as client

    asked = cluster.address or os.environ.get("RAY_ADDRESS", "")
    if client.is_connected() or asked.startswith("ray://"):
        # The rendezvous and the relay would be outside the cluster, behind Ray's proxy.
        raise LaunchError(
            "cluster='ray' needs the notebook on a node of the Ray cluster; a Ray Client "
            "connection (ray://...) is not supported: run the notebook on the cluster's head "
            "or one of its nodes (docs/ray.md says why)"
        )
    if not ray.is_initialized():
        address = cluster.address or "auto"
        try:
            ray.init(address=address, runtime_env=cluster.runtime_env)
        except (ConnectionError, RuntimeError) as exc:
            raise LaunchError(
                f"cannot reach a Ray cluster at {address!r}: {exc}. Start one (ray start "
                "--head), set RAY_ADDRESS, or pass RayCluster(address=...)"
            ) from None
    return ray


def rendezvous_endpoint(ray: Any, given: str | None) -> str:
    """``host:port`` for the rendezvous: ``given``, else this node's address as Ray reports it
    and a free port there."""
    if given:
        return given
    host = ray.util.get_node_ip_address()
    return f"{host}:{choose_port(host, None)}"


def bundle_for(device_type: str, nproc_per_node: int, extra: dict[str, float]) -> dict[str, float]:
    """What one node's bundle reserves: its ranks' GPUs (and a CPU each), or their CPUs."""
    if device_type == "cuda":
        return {"CPU": float(nproc_per_node), "GPU": float(nproc_per_node), **extra}
    return {"CPU": float(nproc_per_node), **extra}


@dataclass
class RayJoin:
    """One node's agent, as the notebook holds it (like node_start's ``StartedJoin``)."""

    host: str
    agent: Any
    bundle: int
    node: dict[str, Any]
    fresh: bool = True
    pid: int | None = None  # the join's, once started
    ended: Any = None  # the pending ``JoinAgent.ended`` call, once started

    def ended_with(self, ray: Any) -> tuple[bool, int | None]:
        """Whether the join ended, and its exit code (None when its agent itself is gone), read
        from the pending ``ended`` call without asking the agent anything."""
        if self.ended is None or not ray.wait([self.ended], timeout=0)[0]:
            return False, None
        try:
            return True, ray.get(self.ended, timeout=0)
        except ray.exceptions.RayError:
            return True, None

    def exit_code(self, ray: Any) -> int | None:
        """The join's exit code; None while it runs; -1 when the agent itself is gone."""
        ended, code = self.ended_with(ray)
        return (-1 if code is None else code) if ended else None


@dataclass
class RayStarter(JoinStarter):
    """The agents this notebook started on the other nodes, and their placement group."""

    ray: Any
    cluster: RayCluster
    group: Any
    command: list[str]
    secret: str
    run_id: str
    started: list[RayJoin] = field(default_factory=list)
    _next_look: float = 0.0

    def describe(self) -> str:
        nodes = ", ".join(f"{join.host} ({join.node['node_id'][:8]})" for join in self.started)
        return (
            f"Ray placed the other node(s) on {nodes}; each runs join in an agent actor, its "
            f"output in {self.started[0].node['log'] if self.started else 'its node'}"
        )

    def problem(self, nodes: int) -> str | None:
        """An agent whose join ended badly before every node joined (None: all well)."""
        for join in self.started:
            code = join.exit_code(self.ray)
            if join.fresh and code not in (None, 0):
                return (
                    f"join on {join.host} (Ray node {join.node['node_id'][:8]}) ended with exit "
                    f"code {code}: {self._tail(join)} (its output: {join.node['log']} there)"
                )
        return None

    def start(self, joins: list[RayJoin]) -> None:
        """Start the join of each of ``joins``' agents, and watch each join's end."""
        pids = self.ray.get([join.agent.start.remote(self.command, self.secret) for join in joins])
        for join, pid in zip(joins, pids, strict=True):
            join.pid, join.ended = pid, join.agent.ended.remote()

    def lost(self) -> dict[int, str]:
        """The joins lost, by pid (looked at every :data:`LOOK_S` at most): those whose agent
        Ray reports dead (its node or raylet was lost), or that were killed. A join that ended
        by itself is not here: it says so through the store."""
        now = time.monotonic()
        if now < self._next_look:
            return {}
        self._next_look = now + LOOK_S
        lost = {}
        for join in self.started:
            ended, code = join.ended_with(self.ray)
            if ended and code is None:
                lost[join.pid] = "its Ray agent died: the Ray node or its raylet was lost"
            elif ended and code < 0:
                lost[join.pid] = f"its join was killed by signal {-code} on its Ray node"
        return lost

    def renew(self, nodes: int) -> None:
        """Before a pool's next start: the joins still running join it by themselves; an agent
        whose join ended (or that was lost with its node) is started again on its bundle."""
        for index, join in enumerate(self.started):
            join.fresh = False
            if join.exit_code(self.ray) is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(join.agent)
                (self.started[index],) = _place_agents(self, [join.bundle])
                self.start([self.started[index]])

    def close(self, wait_s: float = END_WAIT_S) -> None:
        """Wait (bounded) for the joins to end with their run, stop those that do not, and give
        the placement back."""
        ray = self.ray
        waits = [join.agent.stop.remote(wait_s) for join in self.started]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(waits, timeout=wait_s + 15)
        for join in self.started:
            with contextlib.suppress(Exception):
                ray.kill(join.agent)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)

    def _tail(self, join: RayJoin) -> str:
        try:
            return self.ray.get(join.agent.tail.remote(), timeout=5)
        except self.ray.exceptions.RayError:
            return "its agent is gone (its node was lost?)"


def start_ray_joins(
    cluster: RayCluster,
    *,
    count: int,
    endpoint: str,
    run_id: str,
    secret: str,
    bundle: dict[str, float],
) -> RayStarter:
    """Place ``count`` other nodes on the Ray cluster and start an agent (and its join) on each.

    Raises
    ------
    LaunchError
        Ray cannot place them within ``cluster.placement_timeout`` (naming what is missing), or
        a node's versions differ from this one's.
    """
    ray = connect(cluster)
    here = ray.get_runtime_context().get_node_id()
    group = _place(ray, cluster, count + 1, bundle)
    command = ["-m", "nblaunch", "join", endpoint, "--run-id", run_id]
    starter = RayStarter(ray, cluster, group, command, secret, run_id)
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    others = [index for index, node in sorted(table.items()) if node != here][:count]
    try:
        starter.started = _place_agents(starter, others)
        _check_versions(starter)
        starter.start(starter.started)
    except BaseException:
        starter.close(wait_s=0.0)
        raise
    return starter


def _place(ray: Any, cluster: RayCluster, nodes: int, bundle: dict[str, float]) -> Any:
    """A placement group of one ``bundle`` per node, ready; or the error that says why not."""
    from ray.util.placement_group import placement_group

    alive = [node for node in ray.nodes() if node.get("Alive")]
    group = placement_group([dict(bundle)] * nodes, strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=cluster.placement_timeout)
    except (ray.exceptions.GetTimeoutError, TimeoutError):
        ray.util.remove_placement_group(group)
        asked = ", ".join(f"{value:g} {name}" for name, value in bundle.items())
        fits = sum(
            all(node["Resources"].get(name, 0) >= value for name, value in bundle.items())
            for node in alive
        )
        raise LaunchError(
            f"Ray could not place {nodes} nodes with {asked} each within "
            f"{cluster.placement_timeout:g} s: this cluster has {len(alive)} alive node(s), "
            f"{fits} of them with that much in all (some may be in use). Lower num_nodes or "
            "num_processes, free the cluster, or add nodes"
        ) from None
    return group


def _place_agents(starter: RayStarter, bundles: list[int]) -> list[RayJoin]:
    """An agent on each of ``bundles``, all started at once; each says where it runs."""
    ray = starter.ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    agents = []
    for bundle in bundles:
        actor = ray.remote(JoinAgent).options(
            num_cpus=0,  # the bundle's resources are the ranks'; the agent only waits
            max_concurrency=4,  # its other calls are answered while ``ended`` waits
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                starter.group, placement_group_bundle_index=bundle
            ),
            runtime_env=starter.cluster.runtime_env,
        )
        agents.append(actor.remote(f"join-{starter.run_id}-{bundle}.log"))
    try:
        nodes = ray.get([agent.where.remote() for agent in agents], timeout=120)
    except ray.exceptions.RayError as exc:
        raise LaunchError(f"an agent did not start on its Ray node: {exc}") from None
    return [
        RayJoin(f"{node['host']} at {node['address']}", agent, bundle, node)
        for agent, bundle, node in zip(agents, bundles, nodes, strict=True)
    ]


def _check_versions(starter: RayStarter) -> None:
    """Name every node whose Python, Ray, torch or nblaunch differs from this one's."""
    mine = versions()
    problems = []
    for join in starter.started:
        theirs = join.node["versions"]
        differ = [f"{k} {theirs.get(k)} (here {v})" for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            problems.append(
                f"{join.host} (Ray node {join.node['node_id'][:8]}): {', '.join(differ)}"
            )
    if problems:
        raise LaunchError(
            "the Ray nodes placed for this run differ from this one; nothing was started:\n  "
            + "\n  ".join(problems)
            + "\nInstall the same versions there (a runtime_env, or the cluster's image)"
        )
