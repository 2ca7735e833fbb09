"""The run engine: start the ranks, relay what they say, find the root cause, stop, report.

:class:`Run` starts the ranks through its rank backend (:mod:`nblaunch.engine.processes.backend`:
real processes, or a scripted stand-in in the tests), sends each its setup and task, pumps the
relay, lets the monitors (hang watchdog, out-of-memory restarts) watch every event, settles on a
root cause (the first *primary* failure, never a rank that only saw its peer die) and asks
:mod:`nblaunch.engine.verdict` what the caller gets. Every judgement reads the run's clock
(:mod:`nblaunch.engine.clock`). The one-shot launch, the persistent pool and the multi-node head
all drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from nblaunch.engine import verdict
from nblaunch.engine.monitors.protocol import Monitor
from nblaunch.engine.output.relay import Relay
from nblaunch.engine.plan.launch_plan import choose_port
from nblaunch.engine.processes.stopper import KNOWN_CAUSE_GRACE_S, STOP_GRACE_S, Stopper
from nblaunch.engine.run.context import RunBase
from nblaunch.engine.run.restarts import restart_notice
from nblaunch.engine.run.starting import shown_while, starting_words
from nblaunch.engine.verdict import Cause, Outcome, RootCause
from nblaunch.errors import LaunchError
from nblaunch.events import OOM_CAUGHT, STOP, EventSink, NullView, RunState, task_message

# Causes after which the other ranks are most likely blocked in a collective they cannot finish:
# they get half a second to stop, and being killed is no news.
KNOWN_CAUSES = (Cause.FAILURE, Cause.DEATH, Cause.HANG, Cause.MISMATCH)

# --- running -------------------------------------------------------------------------------------


class Run(RunBase):
    """One launch through its life: start the ranks, watch them, restart them, stop them.

    What its monitors and its caller see of it, and the hooks a run on several machines changes,
    are :class:`~nblaunch.engine.run.context.RunBase`'s (its parameters too).
    """

    # Whether a monitor may have every rank stopped and started again (a batch-size restart):
    # only ranks this machine started can be; otherwise the request's own exception is raised.
    restarts_ranks = True

    def execute(self, payload: bytes, *, started: bool = False) -> list[Any]:
        """Run the payload on every rank and return the results, or raise the root cause.

        ``started``: :meth:`start` was called already (a background run starts its ranks in the
        cell, then goes on in a thread of its own).
        """
        __tracebackhide__ = True
        interrupted = False
        try:
            if not started:
                self.start()
            self.send_task(payload)
            self.watch()
            while self.restart_if_due(payload):
                self.watch()
        except KeyboardInterrupt:
            interrupted = True
            self.stop_on_interrupt()
        finally:
            self.finish()
        if interrupted:
            raise KeyboardInterrupt
        return self.conclude()

    def start(self) -> None:
        """Start this machine's ranks (each gets its set-up as it starts), open the relay and
        announce the run (unless a front end did already)."""
        if not self.announced:
            self.announce()
        for rank in range(self.plan.world_size):
            self.set_state(rank, RunState.STARTING, starting_words(self.plan.start_method))
        shown_while(self.view, self.start_processes)  # the first one waits for torch's import
        self.relay = Relay(self.backend.ranks, self.view, self.plan.run_dir, self.clock)
        for source in self.event_sources(self.relay):
            self.relay.add_source(source)

    def start_processes(self) -> None:
        # GPU ranks wait for an earlier run's ranks to be gone: their device memory comes first.
        wait = self.plan.device_type != "cpu"
        self.backend.start(setup=self.plan.setup_message, wait_for_previous=wait)

    def announce(self, warnings: list[str] | None = None, notes: list[str] | None = None) -> None:
        """Publish the run's header (``RunInfo``); a pool sends one per task, to each new view."""
        self.announced = True
        self.publish(self.plan.run_info(self.started_at, warnings, notes))

    def await_started(self, limit_s: float) -> None:
        """Pump until every rank joined the process group and said ``started``.

        Raises
        ------
        Exception
            The rank's own exception when one could not start (the root cause).
        LaunchError
            Not every rank started within ``limit_s`` seconds.
        """
        deadline = self.now() + limit_s
        ranks = range(self.plan.world_size)
        while not all(self.states.get(r) is RunState.RUNNING for r in ranks):
            self.pump(self.plan.monitor_interval)
            root = verdict.settle(self.outcome, self.task_ranks, self.now())
            if root is not None:
                raise self.exception_for(root)
            if self.now() > deadline:
                started = [r for r in ranks if self.states.get(r) is RunState.RUNNING]
                raise LaunchError(
                    f"the ranks did not start within {limit_s:g} s (started: "
                    f"{started or 'none'}); see the logs in {self.plan.run_dir}"
                )

    def begin_task(
        self,
        view: EventSink,
        ranks: list[int],
        *,
        timeout: float | None,
        hang_timeout: float | None,
        monitors: list[Monitor],
    ) -> None:
        """Make the run ready for another task on its ranks (a persistent pool's next cell): a
        new view, outcome, states and fresh monitors (``monitors`` first, then the features').

        What the ranks wrote since the last task (a background thread) belongs to no task: it
        goes to their log files only, never under the wrong cell.
        """
        assert self.relay is not None
        self.relay.sink = NullView()
        self.relay.drain_ready()
        self.relay.in_order.start_task(ranks)  # in-order records wait for these ranks only
        self.view = self.relay.sink = view
        self.plan = dataclasses.replace(self.plan, timeout=timeout, hang_timeout=hang_timeout)
        self.outcome = Outcome()
        self.states = {}
        self.started_at = time.time()
        self.monitors = [*monitors, *self.new_monitors()]
        self.pauses.reset()

    def hang_up(self, limit_s: float) -> None:
        """Ask every rank to stop after its task and read what they say until each closed its
        pipes or exited (at most ``limit_s``); those still exiting are left to finish alone."""
        for rank in self.backend.ranks:
            self.backend.send(rank, {"kind": STOP})
        assert self.relay is not None
        self.stopper().hang_up(self.relay.hung_up, limit_s)

    def send_task(self, payload: bytes, task_id: int = 0, ranks: list[int] | None = None) -> None:
        """Send one task to ``ranks`` (default: all); the run then waits for those ranks only."""
        self.task_ranks = list(range(self.plan.world_size)) if ranks is None else list(ranks)
        message = task_message(payload, task_id, self.task_ranks, self.plan.world_size)
        for rank in self.backend.ranks:  # this machine's (a multi-node run has others)
            if rank.rank in self.task_ranks:
                self.backend.send(rank, message)
        self.task_sent(task_id, payload)

    def request_stop(self) -> None:
        """Stop this run as an interrupt would, from any thread: the run's own thread raises
        ``KeyboardInterrupt`` at its next turn (:meth:`pump`) and stops every rank."""
        self._stop.set()

    def interrupt(self, ranks: list[int]) -> None:
        """A KeyboardInterrupt in the task of each of ``ranks`` (SIGINT)."""
        here = {rank.rank for rank in self.backend.ranks}
        self.backend.interrupt([r for r in ranks if r in here])
        elsewhere = [r for r in ranks if r not in here]
        if elsewhere:
            self.interrupt_elsewhere(elsewhere)

    # --- watching --------------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """One turn of the engine: wait up to ``timeout`` s for output or events, act on every
        event, and record a rank whose process ended without saying so as a death."""
        assert self.relay is not None
        if self._stop.is_set():  # once, as one press of the interrupt button
            self._stop.clear()
            raise KeyboardInterrupt
        for event in self.relay.poll(timeout):
            self.on_event(event)
        for rank in self.backend.reap():
            for event in self.relay.drain_events(rank.rank):
                self.on_event(event)
            if rank.rank not in self.outcome.finished:
                self.on_death(rank.rank, rank.exitcode)
            elif rank.rank in self.outcome.results and not self._all_returned():
                # A rank waits for STOP after its value: an exit now is a crash its peers,
                # still running, may wait for in a collective that can never complete.
                self.on_death(rank.rank, rank.exitcode, after_return=True)

    def _all_returned(self) -> bool:
        return len(self.outcome.results) == len(self.task_ranks)

    def watch(self) -> None:
        """Pump until every rank returned, a root cause is known, or the timeout runs out."""
        outcome = self.outcome
        deadline = None if self.plan.timeout is None else self.now() + self.plan.timeout
        while True:
            self.pump(self.plan.monitor_interval)  # output and events wake it at once
            # Monitors first: what the ranks sent before their values may show that the run
            # went wrong although every rank returned (collectives that disagreed).
            for monitor in self.monitors if self.pauses.judging() else []:
                root = monitor.check(self)
                if root is not None:
                    outcome.root = root
                    return
            if self._all_returned():
                return
            root = verdict.settle(outcome, self.task_ranks, self.now())
            if root is not None:
                outcome.root = root
                return
            if deadline is not None and self.now() - self.pauses.paused_s() > deadline:
                outcome.root = verdict.timed_out(outcome, self.plan.world_size, self.plan.timeout)
                return

    def on_event(self, event: dict[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.on_event(self, event)
        kind = event["kind"]
        rank = event.get("rank")
        if kind == "death":  # another node's rank ended without saying so
            self.on_death(rank, event["exitcode"])
            self.outcome.failures[-1].message += f" (on node {event['node']}, {event['host']})"
        elif kind == "started":
            self.set_state(rank, RunState.RUNNING)
        elif kind == "result":
            self.outcome.results[rank] = event["value_bytes"]
        elif kind == "failure":
            failure = RootCause.from_failure(event, received_at=self.now())
            self.outcome.failures.append(failure)
            self.set_state(rank, RunState.FAILED, failure.outcome_words()[:200])
        elif kind == "progress" and event["what"] == OOM_CAUGHT:
            self.outcome.caught_oom[rank] = event  # each tells the sizes so far
        elif kind == "finished":
            self.outcome.finished.add(rank)
            if rank in self.outcome.results:
                self.set_state(rank, RunState.DONE)

    def on_death(self, rank: int, exitcode: int | None, after_return: bool = False) -> None:
        death = RootCause.death(rank, exitcode, after_return)
        self.outcome.finished.add(rank)
        self.outcome.failures.append(death)
        self.set_state(rank, RunState.FAILED, death.message)

    # --- restarting and stopping ---------------------------------------------------------------

    def restart_if_due(self, payload: bytes) -> bool:
        """Start every rank again when the attempt that ended asks for it: a monitor's request
        with new set-up options (a rank ran out of memory while its peers were blocked in a
        collective of the same step: only fresh processes, all at the smaller batch size, can go
        on), or a failure, death or hang with restarts left (``max_restarts=``)."""
        root = self.outcome.root
        if root is None or not self.restarts_ranks:
            return False
        if root.cause is Cause.RESTART:
            if root.progress:
                self.publish(root.progress)
            self.plan.options.update(root.options)
            self.restart(payload, root.message)
        elif self.attempts.due(root):
            message, notice = restart_notice(self.attempts, root)
            self.publish(notice)
            self.plan.restart_count = self.attempts.restarts  # TORCHELASTIC_RESTART_COUNT
            self.restart(payload, message)
        else:
            return False
        return True

    def restart(self, payload: bytes, detail: str) -> None:
        """Stop every rank, start fresh processes on a new port and send them the task again
        (their states say ``detail``); output and log files carry on."""
        assert self.relay is not None
        self.stop_ranks(STOP_GRACE_S)
        self.relay.drain_output(timeout=1.0)
        for rank in self.backend.ranks:
            self.relay.remove(rank)
        self.backend.close()
        self.plan.master_port = choose_port(self.plan.master_addr, None)
        self.outcome = Outcome()
        self.monitors = self.new_monitors()  # fresh processes, fresh observations
        self.backend = self.make_backend(self.plan.world_size, self.plan.start_method)
        self.start_processes()
        for rank in self.backend.ranks:
            self.relay.add(rank)
            self.set_state(rank.rank, RunState.STARTING, detail)
        self.send_task(payload)

    def stop_on_interrupt(self) -> None:
        """The notebook was interrupted: SIGINT every rank, then escalate; within ~5 s in all."""
        self.stopping(None)
        finished = self.outcome.finished
        ranks = self.backend.ranks
        self.stopper().interrupt(lambda: all(r.rank in finished or r.ended for r in ranks))
        for rank in range(self.plan.world_size):
            if self.states.get(rank) not in (RunState.DONE, RunState.FAILED):
                self.set_state(rank, RunState.STOPPED, "interrupted")

    def finish(self) -> None:
        """Stop every rank (asking nicely first when the run went well) and close everything."""
        root = self.outcome.root
        ok = len(self.outcome.results) == self.plan.world_size
        self.stopping(ok and root is None)
        try:
            if ok:
                # The watch loop ends at the last Result; that rank's Finished may not be read.
                for rank in sorted(self.outcome.results):
                    self.set_state(rank, RunState.DONE)
                self.hang_up(limit_s=5.0)
            else:
                for ended in self.backend.reap():  # ended on their own since the last turn
                    if ended.rank not in self.outcome.finished:
                        self.on_death(ended.rank, ended.exitcode)
                reason = verdict.stop_reason(root, self.plan.timeout)
                for rank in range(self.plan.world_size):
                    if rank not in self.outcome.finished and self.states.get(rank) in (
                        RunState.STARTING,
                        RunState.RUNNING,
                        RunState.STALLED,
                    ):
                        self.set_state(rank, RunState.STOPPED, reason)
            known = root is not None and root.cause in KNOWN_CAUSES
            self.stop_ranks(KNOWN_CAUSE_GRACE_S if known else STOP_GRACE_S, quiet=known)
        except KeyboardInterrupt:
            self.stop_ranks(grace=0.0)
            raise
        finally:
            if self.relay is not None:
                self.relay.drain_output(timeout=1.0)
                if not ok:
                    self._note_crashes()
                self.publish(self.run_ended(ok))
            self.close()
            self.view.close()

    def _note_crashes(self) -> None:
        """Ranks being stopped that crashed on their own are shown as they ended."""
        ended = (RunState.FAILED, RunState.DONE)
        settled = self.outcome.finished | {r for r, s in self.states.items() if s in ended}
        exits = {process.rank: process.exitcode for process in self.backend.ranks}
        assert self.relay is not None
        for death in verdict.crashed_while_stopped(exits, settled, self.relay.tails):
            self.outcome.finished.add(death.rank)
            self.outcome.failures.append(death)
            self.set_state(death.rank, RunState.FAILED, death.message)

    def stop_ranks(self, grace: float, quiet: bool = False) -> None:
        """Stop this machine's ranks (SIGTERM, SIGKILL after ``grace``; ``quiet``: being killed
        is no news); the monitors hear that the ranks are gone."""
        try:
            self.stopper().stop(grace, quiet)
        finally:
            for monitor in self.monitors:
                monitor.ranks_ended()

    def close(self, rejoin: bool | None = None) -> None:
        """Close the ranks' pipes and the relay, and release the run directory (it may be pruned
        from now on); ``rejoin``: let go of the other nodes too, which then join the next start
        (True) or end (False)."""
        for monitor in self.monitors:  # the ranks are gone, whichever way the run ended
            monitor.ranks_ended()
        if rejoin is not None:
            with contextlib.suppress(Exception):
                self.release_nodes(rejoin)
        with contextlib.suppress(Exception):
            if self.relay is not None:
                self.relay.close()
        if self.plan.run_lease is not None:
            self.plan.run_lease.release()
        self.backend.close()

    def stopper(self) -> Stopper:
        """What stops this machine's ranks, reading their output meanwhile."""
        return Stopper(self.backend, self.now, self._read_output)

    def _read_output(self, timeout: float) -> None:
        if self.relay is not None:
            self.relay.poll(timeout)
