"""Point-to-point waits: what a rank posted to each peer, and which request its task waits on.

The heartbeat reads collectives' progress from the process groups (:mod:`nblaunch.ranks.\
process_groups`), but torch counts no point-to-point operation, and ``work.wait()`` on an
``irecv`` (or on a ``batch_isend_irecv`` request) leaves no ``torch.distributed`` frame on the
stack: a rank waiting there looked like a rank computing. While a task runs, this module wraps
``ProcessGroup.send``, ``recv`` and ``recv_anysource`` (every ``dist.send``/``recv``/``isend``/
``irecv`` and ``batch_isend_irecv`` goes through them) and ``Work.wait``: it counts the
operations posted per direction, process group, peer and tag, and remembers which one each
thread waits on. Each heartbeat carries both (:func:`heartbeat_fields`), and the notebook's hang
watchdog proves deadlocks from them (:mod:`nblaunch.engine.monitors.deadlock`).

The k-th receive a rank posts from a peer (same group and tag) is matched by the k-th send that
peer posts to it: a receive waits until the peer's count of sends reaches its number. Gloo
matches by tag; other backends ignore tags, so their counts leave the tag out.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from nblaunch.events import PointToPoint
from nblaunch.ranks import this_rank

# Requests remembered for a later wait(); a task that never waits on its requests drops the
# oldest past this.
MAX_REQUESTS = 4096

_lock = threading.Lock()
# (direction, group, peer, tag) -> operations posted; peer -1 is a receive from any source.
_posted: dict[tuple[str, str, int, int | None], int] = {}
_requests: dict[int, tuple[Any, PointToPoint]] = {}  # id(work) -> (work, what it is)
_waiting: dict[int, PointToPoint] = {}  # thread ident -> the request it waits on
_groups: dict[int, tuple[Any, str, list[int], bool]] = {}  # id(pg) -> (pg, name, ranks, tags)
_total = 0  # operations posted in this task, all kinds
# group name -> (a weak reference to the group, operations posted on it in this process in every
# task, whether its backend is gloo): gloo counts them in the group's sequence number, its flight
# recorder does not (ranks/checks/recorder.py). A group made again under the name (the default
# group, destroyed and made again) counts from 0, as its sequence number does.
_posted_by_group: dict[str, tuple[Any, int, bool]] = {}
# Work.wait while a request is outstanding (see _watch_waits); None outside a task.
_work_class: Any = None
_original_wait: Any = None


def _group(pg: Any) -> tuple[str, list[int], bool]:
    """A process group's name, its global ranks in group order, and whether tags match."""
    known = _groups.get(id(pg))
    if known is not None and known[0] is pg:
        return known[1], known[2], known[3]
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(pg)
    tags = "gloo" in str(dist.get_backend(pg)).lower()
    _groups[id(pg)] = (pg, pg.group_name, ranks, tags)
    return pg.group_name, ranks, tags


def _post(pg: Any, direction: str, group_peer: int, tag: int, work: Any) -> None:
    global _total
    try:
        name, ranks, tags = _group(pg)
    except Exception:
        return  # not a group torch can describe: leave it out
    peer = ranks[group_peer] if 0 <= group_peer < len(ranks) else -1
    key = (direction, name, peer, tag if tags else None)
    with _lock:
        count = _posted[key] = _posted.get(key, 0) + 1
        counted = _posted_by_group.get(name)
        if counted is None or counted[0]() is not pg:
            counted = (weakref.ref(pg), 0, tags)  # (tags: gloo, the only backend matching them)
        _posted_by_group[name] = (counted[0], counted[1] + 1, tags)
        _total += 1
        if work is not None:
            if len(_requests) >= MAX_REQUESTS:
                del _requests[next(iter(_requests))]
            _requests[id(work)] = (
                work,
                {"op": direction, "group": name, "peer": peer, "tag": key[3], "n": count},
            )
            _watch_waits(True)


def _wrap_post(original: Any, direction: str) -> Any:
    def post(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        # (tensors, peer, tag) as torch.distributed passes them; anything else is not counted
        if len(args) >= 2 and isinstance(args[1], int):
            tag = args[2] if len(args) >= 3 else kwargs.get("tag", 0)
            _post(self, direction, args[1], tag, work)
        return work

    post.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return post


def _wrap_anysource(original: Any) -> Any:
    def recv_anysource(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        _post(self, "recv", -1, args[1] if len(args) >= 2 else kwargs.get("tag", 0), work)
        return work

    recv_anysource.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return recv_anysource


def _wrap_wait(original: Any) -> Any:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _requests.get(id(self))
        if entry is None or entry[0] is not self:
            return original(self, *args, **kwargs)
        ident = threading.get_ident()
        _waiting[ident] = entry[1]
        try:
            return original(self, *args, **kwargs)
        finally:
            _waiting.pop(ident, None)
            with _lock:
                _requests.pop(id(self), None)
                _watch_waits(bool(_requests))

    wait.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return wait


def _watch_waits(on: bool) -> None:
    """Wrap ``Work.wait`` only while a point-to-point request is outstanding (under ``_lock``).

    Every collective's ``work.wait()`` goes through ``Work.wait`` too: code without
    point-to-point requests never runs the wrapper.
    """
    if _work_class is None:
        return
    wrapped = hasattr(_work_class.__dict__.get("wait"), "__nblaunch_original__")
    with contextlib.suppress(AttributeError, TypeError):  # a class that takes no attributes
        if on and not wrapped:
            _work_class.wait = _wrap_wait(_original_wait)
        elif not on and wrapped:
            _work_class.wait = _original_wait


@contextlib.contextmanager
def watched_requests() -> Iterator[None]:
    """Count point-to-point operations and watch their waits inside this block."""
    global _total, _work_class, _original_wait
    try:
        from torch._C._distributed_c10d import ProcessGroup, Work
    except ImportError:  # torch without distributed support: nothing to watch
        yield
        return

    patches = [
        (ProcessGroup, "send", lambda f: _wrap_post(f, "send")),
        (ProcessGroup, "recv", lambda f: _wrap_post(f, "recv")),
        (ProcessGroup, "recv_anysource", _wrap_anysource),
    ]
    saved = []
    for owner, name, wrap in patches:
        original = owner.__dict__.get(name)
        if original is None or hasattr(original, "__nblaunch_original__"):
            continue
        try:
            setattr(owner, name, wrap(original))
        except (AttributeError, TypeError):
            continue  # a torch whose classes cannot take attributes: no point-to-point waits
        saved.append((owner, name, original))
    wait = Work.__dict__.get("wait")
    if wait is not None and not hasattr(wait, "__nblaunch_original__"):
        _work_class, _original_wait = Work, wait
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        with _lock:
            _watch_waits(False)
            _work_class = _original_wait = None
            _posted.clear()
            _requests.clear()
            _waiting.clear()
            _groups.clear()
            _total = 0


def waiting(ident: int) -> PointToPoint | None:
    """The point-to-point request thread ``ident`` waits on, if any."""
    return _waiting.get(ident)


def label(wait: PointToPoint, called: str | None) -> str:
    """How a point-to-point wait reads: the call on the stack (``recv``), or the request's."""
    if called is not None:
        return called
    return "isend().wait()" if wait["op"] == "send" else "irecv().wait()"


def posted_in_sequence(group: str) -> int:
    """The point-to-point operations posted on ``group`` (by this process, in every task) that
    its sequence numbers count: gloo numbers its sends and receives with its collectives (its
    ``pg_status`` counts and its entries' ``op_id``; not their ``collective_seq_id``), so these
    are subtracted where a rank says how many collectives it issued: a pipeline's middle stage
    posts twice as many. 0 on other backends, and once the group of that name was destroyed (a
    new one counts again)."""
    counted = _posted_by_group.get(group)
    if counted is None or not counted[2]:
        return 0
    pg = counted[0]()
    try:
        import torch.distributed as dist

        alive = pg is not None and pg in dist.distributed_c10d._world.pg_names
    except Exception:  # a torch without the registry: trust the reference
        alive = pg is not None
    return counted[1] if alive else 0


def posted_total() -> int:
    """Point-to-point operations posted in this task so far (a progress counter)."""
    return _total


def group_members() -> dict[str, list[int]]:
    """Every process group this rank knows: its name and global ranks in group order."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {}
    world = dist.distributed_c10d._world
    members: dict[str, list[int]] = {}
    with contextlib.suppress(Exception):
        for pg, ranks in list(world.pg_group_ranks.items()):
            name = world.pg_names.get(pg)
            if name is not None:
                members[str(name)] = sorted(ranks, key=ranks.get)
    return members


def heartbeat_fields(ident: int) -> dict[str, Any]:
    """What a heartbeat carries for the proofs: thread ``ident``'s wait, the counts, the groups.

    Also forgets requests that completed without a wait (polled with ``is_completed()``, or
    dropped): each holds its tensors.
    """
    with _lock:
        posted = [[*key, count] for key, count in _posted.items()]
        for key, (work, _) in list(_requests.items()):
            with contextlib.suppress(Exception):
                if work.is_completed():
                    del _requests[key]
        _watch_waits(bool(_requests))
    return {"p2p_wait": _waiting.get(ident), "p2p_posted": posted, "members": group_members()}


def _task_hook(context: this_rank.RankContext) -> contextlib.AbstractContextManager[Any]:
    return watched_requests()


this_rank.add_task_hook(_task_hook)
