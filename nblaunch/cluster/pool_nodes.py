"""The other machines of a multi-node pool: the nodes' plan, their rendezvous, their joins.

A pool on one machine never imports this (nor :mod:`nblaunch.cluster`, ~10 ms).
"""

from __future__ import annotations

from typing import Any

from nblaunch.cluster.head import Head
from nblaunch.cluster.node_start import JoinStarter
from nblaunch.cluster.plan import plan_nodes
from nblaunch.cluster.run import MultiNodeRun
from nblaunch.cluster.store import signal_handlers_kept
from nblaunch.engine.run.run import Run
from nblaunch.events import NullView
from nblaunch.options import LaunchOptions, NodeOptions


class PoolNodes:
    """What a pool keeps about its other nodes across restarts.

    The run's secret and id stay the same across restarts, so the nodes' join commands stay
    valid and rejoin by themselves; join commands the pool started itself (``start_nodes``)
    are started again for a lost node, and end with the pool.
    """

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self._secret: Any = None
        self.starter: JoinStarter | None = None  # the joins this pool started (start_nodes)

    def plan(self, function: Any, num_processes: int | None, options: LaunchOptions) -> Any:
        """The plan of this node (node 0); later starts keep its run id."""
        plan = plan_nodes(function, num_processes, options, self.options, True)
        self.options = self.options.replace(rdzv_id=plan.rdzv_run_id)
        return plan

    def new_run(self, plan: Any) -> Run:
        """The engine once every other node joined (their joins started first, if ours)."""
        head = Head(plan, NullView(), secret=self._secret)
        self._secret = head.secret
        try:
            if self.options.start_nodes and self.starter is None:
                self.starter = head.start_joins(self.options)
            elif self.starter is not None:  # a lost node's join is started again
                self.starter.renew(self.options.num_nodes - 1)
            with signal_handlers_kept():
                head.rendezvous(None, self.options.rdzv_timeout, self.starter)
        except BaseException:
            head.close()
            self.end_joins()
            raise
        return MultiNodeRun(plan, NullView(), head, self.starter)

    def end_joins(self) -> None:
        """The join commands this pool started end with it (they are given a while)."""
        if self.starter is not None:
            self.starter.close()
            self.starter = None
