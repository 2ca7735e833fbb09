"""Which engine places a run's other nodes (``cluster=``): Ray or Slurm.

The front ends pass ``cluster=`` here; it answers the rendezvous endpoint, the ``start_nodes``
that :meth:`nblaunch.cluster.head.Head.start_joins` follows, and the number of nodes. Ray is
imported only when a run asks for it; Slurm needs no library (its commands are on PATH).
"""

from __future__ import annotations

from typing import Any

from nblaunch.cluster import ray_nodes, slurm_nodes
from nblaunch.errors import LaunchError

# What ``--cluster`` of the magics takes.
CLUSTERS = ("ray", "slurm")


def placed_by(
    cluster: Any, num_nodes: int | None, start_nodes: str | None, rdzv_endpoint: str | None
) -> tuple[str, str, int | None, Any]:
    """The rendezvous endpoint, ``start_nodes``, ``num_nodes`` and cluster of a run whose other
    nodes ``cluster`` places (a Ray cluster as this process is connected to it: its address and
    the job's runtime_env, for a run host to connect the same way).

    Raises
    ------
    LaunchError
        ``cluster`` is none of those this takes, or the engine refuses the other options.
    """
    if slurm_nodes.is_slurm(cluster):
        return (*slurm_nodes.placed_by(cluster, num_nodes, start_nodes, rdzv_endpoint), cluster)
    if cluster == "ray" or isinstance(cluster, ray_nodes.RayCluster):
        endpoint, how, resolved = ray_nodes.placed_by(
            cluster, num_nodes, start_nodes, rdzv_endpoint
        )
        return endpoint, how, num_nodes, resolved
    raise LaunchError(
        f"cluster={cluster!r}: give 'ray' or nblaunch.RayCluster(...), 'slurm' or "
        "nblaunch.SlurmCluster(...) (the engine that places the other nodes), or leave it out"
    )
