"""A joined node's ranks: start them, forward what they send, stop them when the notebook says.

:class:`NodeRun` is the loop of ``python -m nblaunch join`` (:mod:`nblaunch.cluster.join`) once
the node is in the rendezvous: the ordinary supervisor and relay, with the relay's events going
up to the notebook (:class:`~nblaunch.cluster.channel.Uplink`), and the notebook's control value,
a pool's tasks and interrupts read from the store.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from nblaunch.cluster.channel import (
    CONTROL_INTERRUPT,
    CONTROL_OK,
    CONTROL_REJOIN,
    CONTROL_STOP,
    Keys,
    Terminated,
    Uplink,
    beat_store,
    first_line,
    read_reason,
)
from nblaunch.cluster.plan import MultiNodePlan
from nblaunch.cluster.ray_agent import RAY_AGENT_ENV
from nblaunch.cluster.trust import RunSecret
from nblaunch.engine.monitors.collective_checks import reader_for
from nblaunch.engine.output.relay import Relay
from nblaunch.engine.processes.stopper import STOP_GRACE_S
from nblaunch.engine.processes.supervisor import Supervisor, signal_pid
from nblaunch.errors import AuthenticationError
from nblaunch.events import STOP, task_message

# How often the node looks at the notebook's control key.
CONTROL_INTERVAL_S = 0.1
# How long a pool's node waits for the old rendezvous to close before joining the next one.
OLD_STORE_WAIT_S = 30.0


class Ending(enum.Enum):
    """How a node's run ended, for the join command's exit code."""

    FINISHED = "finished"  # every rank returned, or the pool was closed
    FAILED = "failed"  # failed, stopped, interrupted, or the notebook went away
    REJOIN = "rejoin"  # a pool restarts: this node joins its next start


class NodeRun:
    """This node's ranks: start them, forward what they send, stop them when told to."""

    def __init__(
        self,
        plan: MultiNodePlan,
        payload: bytes | None,
        store: Any,
        keys: Keys,
        name: str,
        say: Callable[[str], None],
        secret: RunSecret,
        handler: Any = None,
    ) -> None:
        self.plan = plan
        self.endpoint = f"{plan.master_addr}:{plan.master_port}"
        self.payload = payload
        self.store = store  # a BoundedStore: calls give up after NOTEBOOK_SILENCE_S
        self.keys = keys
        self.name = name
        self.say = say
        self.handler = handler  # the rendezvous, left once the ranks stopped
        self.secret = secret
        self.uplink = Uplink(store, keys.up, plan.node_rank, secret, beat_store=beat_store(store))
        self._forged_control = False
        self.finished: set[int] = set()
        self.returned: set[int] = set()
        self._last_control_check = 0.0
        self._control_value: str | None = None  # the last one the notebook set
        # A pool's tasks, numbered from 0 at each start: the next to take, the one running.
        self.next_task = 0
        self.task: int | None = None
        self.task_interrupted = False  # the notebook interrupted the running task here

    def run(self) -> Ending:
        """Run this node's ranks until the notebook says to stop them, or is lost."""
        plan = self.plan
        uplink = self.uplink
        supervisor = Supervisor(plan.world_size, plan.start_method)
        relay = None
        outcome = "stopped"
        # The collective checks: what this node's ranks send about each call goes to the
        # notebook, which compares every node's. Made before the set-up messages, which carry
        # its address.
        checks = reader_for(plan) if plan.checks else None
        uplink.news("started", host=self.name, ranks=plan.local_ranks, pid=os.getpid())
        uplink.push()
        try:
            supervisor.start(plan.local_ranks)
            relay = Relay(supervisor.ranks, uplink, None)
            for rank in supervisor.ranks:
                supervisor.send(rank, plan.setup_message(rank.rank))
                if self.payload is not None:  # a one-shot run's task: on every rank of the run
                    every = list(range(plan.world_size))
                    supervisor.send(rank, task_message(self.payload, 0, every, plan.world_size))
            interrupted = False
            while True:
                self._note(relay.poll(0.05))
                calls = checks.read() if checks is not None else []
                if calls:
                    uplink.handle({"kind": "collectives", "calls": calls})  # type: ignore[typeddict-item]
                for rank in supervisor.reap():
                    self._note(relay.drain_events(rank.rank))
                    # A pool's rank waits for tasks until told to stop: any exit is a death.
                    if plan.pool or rank.rank not in self.finished:
                        self.finished.add(rank.rank)
                        uplink.handle(
                            {"kind": "death", "rank": rank.rank, "exitcode": rank.exitcode}
                        )
                if uplink.lost is not None:
                    self.say(
                        f"lost the notebook at {self.endpoint} ({uplink.lost}); stopping this "
                        "node's ranks"
                    )
                    outcome = f"lost the notebook at {self.endpoint}"
                    break
                control = self._control()
                if control is None and plan.pool:
                    self._take_tasks(supervisor)
                if control == CONTROL_INTERRUPT and not interrupted:
                    interrupted = True
                    supervisor.interrupt()
                elif control == CONTROL_OK:
                    outcome = "finished"
                    for rank in supervisor.ranks:
                        supervisor.send(rank, {"kind": STOP})
                    deadline = time.monotonic() + 5.0
                    while supervisor.alive() and time.monotonic() < deadline:
                        relay.poll(0.02)
                        supervisor.reap()
                    break
                elif control == CONTROL_STOP:
                    outcome = "interrupted" if interrupted else "stopped by the notebook"
                    reason = self.reason()
                    if reason:
                        outcome += f": {reason}"
                    break
                elif control == CONTROL_REJOIN:
                    outcome = "stopped: the pool restarts"
                    break
        except Terminated:
            outcome = f"terminated on this node (SIGTERM: {sigterm_senders()})"
        except KeyboardInterrupt:
            outcome = "interrupted on this node"
        except Exception as exc:  # starting the ranks failed: the notebook must hear why
            outcome = f"failed on this node: {first_line(exc)}"
            raise
        finally:
            supervisor.stop(grace=STOP_GRACE_S)
            if relay is not None:
                relay.drain_output(timeout=1.0)
            # Before "done": the notebook closes the store then. A lost store would make it
            # wait out its timeout.
            if self.handler is not None and uplink.lost is None:
                with contextlib.suppress(Exception):
                    self.handler.shutdown()
            uplink.news("done", outcome=outcome)
            uplink.close()
            if relay is not None:
                relay.close()
            if checks is not None:
                checks.close()
            supervisor.close()
        self.say(f"run {plan.run_id}: {outcome}")
        if self._control_value == CONTROL_REJOIN:
            self._wait_for_old_store()
            self.say("joining the pool's next start")
            return Ending.REJOIN
        return Ending.FINISHED if outcome == "finished" else Ending.FAILED

    def _take_tasks(self, supervisor: Supervisor) -> None:
        """A pool's next task, and the notebook's interrupt of the running one (from the store)."""
        try:
            key = self.keys.task(self.next_task)
            if not self.store.check([key]):
                key = self._skip_to_newest_task(key)
            if self.store.check([key]):
                record = self.secret.open(self.store.get(key), key)
                ranks = record["ranks"]
                message = task_message(
                    record["payload"], record["task_id"], ranks, self.plan.world_size
                )
                for rank in supervisor.ranks:
                    if rank.rank in ranks:
                        supervisor.send(rank, message)
                self.task, self.next_task, self.task_interrupted = (
                    self.next_task,
                    self.next_task + 1,
                    False,
                )
            if self.task is not None and not self.task_interrupted:
                key = self.keys.interrupt(self.task)
                if self.store.check([key]):
                    ranks = self.secret.open(self.store.get(key), key)
                    self.task_interrupted = True
                    for rank in supervisor.ranks:
                        if rank.rank in ranks and not rank.ended:
                            signal_pid(rank.pid, signal.SIGINT)
        except AuthenticationError as exc:
            self.say(f"ignored a task record: {exc}")
            self.next_task += 1
        except Exception as exc:
            self.uplink.lost = first_line(exc)

    def _skip_to_newest_task(self, key: str) -> str:
        """The key of the next task to read, past those this node missed: tasks that had none
        of its ranks end without it and their keys go when the next one is published (one
        that had its ranks cannot: the notebook waits for them), so a node still waiting for
        such a key would never see the tasks after it."""
        newest_key = self.keys.newest_task
        if not self.store.check([newest_key]):
            return key
        newest = int(self.secret.verify(self.store.get(newest_key), newest_key).decode())
        if newest > self.next_task:
            self.next_task = newest
            return self.keys.task(newest)
        return key

    def _wait_for_old_store(self) -> None:
        """Until the notebook closed this start's rendezvous: joining again before would find
        the old one (bounded by ``OLD_STORE_WAIT_S``)."""
        deadline = time.monotonic() + OLD_STORE_WAIT_S
        while time.monotonic() < deadline:
            try:
                self.store.check([self.keys.control])
            except Exception:
                return
            time.sleep(0.1)

    def reason(self) -> str:
        """Why the notebook stopped the run ("" when it did not say, or cannot be read)."""
        try:
            return read_reason(self.store, self.keys, self.secret)
        except Exception:
            return ""

    def _note(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if event["kind"] == "finished":
                self.finished.add(event["rank"])
            elif event["kind"] == "result":
                self.returned.add(event["rank"])

    def _control(self) -> str | None:
        """What the notebook wants (checked every ``CONTROL_INTERVAL_S``); None: carry on."""
        now = time.monotonic()
        if now - self._last_control_check < CONTROL_INTERVAL_S:
            return None
        self._last_control_check = now
        try:
            if not self.store.check([self.keys.control]):
                return None
            value = self.store.get(self.keys.control)
        except Exception as exc:
            self.uplink.lost = first_line(exc)
            return None
        try:
            self._control_value = self.secret.verify(value, self.keys.control).decode()
            return self._control_value
        except AuthenticationError:
            if not self._forged_control:  # ignored, and said once
                self._forged_control = True
                self.say(
                    "ignored a control value that failed authentication: another client is "
                    "writing to the run's store"
                )
                self.uplink.news(
                    "forged_control", message="a forged control value was ignored on this node"
                )
            return None


def sigterm_senders() -> str:
    """Who sends a join SIGTERM, by what started it: its Ray agent, Slurm, or a person."""
    if os.environ.get(RAY_AGENT_ENV):
        return "its Ray agent ended or stopped it, or kill"
    if "SLURM_JOB_ID" in os.environ:
        return "Slurm ended its step or job (scancel, preemption, a time limit), or kill"
    return "kill"
