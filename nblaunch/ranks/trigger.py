"""A synchronised early stop: one rank asks, and every rank stops at the same step.

:func:`set_trigger` / :func:`check_trigger` let one rank stop every rank at the same step (the
one whose validation loss stopped improving, say), without the others waiting forever in the
next collective. The trigger is reset at the start of every task (a task hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from nblaunch.ranks import this_rank
from nblaunch.ranks.checks.debug_mode import (
    checks_enabled,
    collective_device,
    in_group,
    unpatched,
    verified_region,
    verify,
)

_trigger = False


@contextlib.contextmanager
def _reset_trigger(context: this_rank.RankContext) -> Iterator[None]:
    global _trigger
    _trigger = False  # a trigger set in a previous cell must not stop this one
    yield


this_rank.add_task_hook(_reset_trigger)


def set_trigger() -> None:
    """Ask every rank to stop: the next :func:`check_trigger` returns True on all of them.

    Any rank may call it, e.g. the one whose validation loss stopped improving.
    """
    global _trigger
    _trigger = True


def check_trigger() -> bool:
    """True on every rank, at the same step, once any rank called :func:`set_trigger`.

    One small ``all_reduce``; every rank must call it at the same step. The trigger is reset
    when it fires (and at the start of every task).

    Raises
    ------
    DistributedOperationException
        In debug mode, when other ranks make a different collective call at this step.
    """
    global _trigger
    import torch
    import torch.distributed as dist

    if not in_group() or dist.get_world_size() < 2:
        fired = _trigger
    else:
        if checks_enabled():
            verify("nblaunch.ranks.trigger.check_trigger", rule="none")
        flag = torch.tensor([1 if _trigger else 0], dtype=torch.int32, device=collective_device())
        with verified_region():  # the check's claim on the recorder's entry ends with it
            unpatched("all_reduce")(flag)
        fired = bool(flag.item())
    if fired:
        _trigger = False
    return fired
