"""Accelerate's ``notebook_launcher`` rendezvous keywords, in nblaunch's terms.

Accelerate hands ``use_port``, ``node_rank``, ``rdzv_backend``, ``rdzv_endpoint``,
``rdzv_conf`` and ``rdzv_id`` to torch's elastic launch, run on every node. nblaunch's notebook
is always node 0: it hosts the rendezvous (torch's c10d rendezvous on ``rdzv_endpoint``) and the
other nodes join with ``python -m nblaunch join``. :func:`translate` maps each value onto that,
and names the nblaunch way where a value has no meaning here. ``docs/compat.md`` lists them side
by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nblaunch.errors import LaunchError

# Both mean "the nodes meet at one endpoint": nblaunch's rendezvous does that for either.
RDZV_BACKENDS = ("static", "c10d")
# Accelerate's defaults for "not given".
NO_RDZV_ID = "none"
# rdzv_conf keys with a meaning here: Accelerate's own "rank" (it sets node_rank there for the
# static rendezvous) and the c10d rendezvous's join timeout.
RDZV_CONF_KEYS = ("rank", "join_timeout")
# Accelerate's parameters after ``num_processes``, in its order (accelerate 1.x): a call may
# pass them by position there, so it may here; nblaunch's own options are keyword-only.
POSITIONAL = (
    "mixed_precision",
    "use_port",
    "master_addr",
    "node_rank",
    "num_nodes",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "rdzv_id",
    "max_restarts",
    "monitor_interval",
    "log_line_prefix_template",
)


@dataclass(frozen=True)
class Rendezvous:
    """nblaunch's own arguments for what Accelerate's keywords asked."""

    master_port: int | None
    rdzv_endpoint: str | None
    rdzv_id: str | None
    rdzv_timeout: float | None


def translate(
    *,
    use_port: str | int | None,
    master_port: int | None,
    node_rank: int,
    num_nodes: int,
    rdzv_backend: str,
    rdzv_endpoint: str | None,
    rdzv_conf: dict[str, Any] | None,
    rdzv_id: str | None,
    rdzv_timeout: float | None,
) -> Rendezvous:
    """nblaunch's port and rendezvous arguments for Accelerate's keywords and its own.

    Raises
    ------
    LaunchError
        A value nblaunch cannot honour, naming the nblaunch way to get what it asks.
    """
    port = _port(use_port, master_port)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int):
        raise LaunchError(f"node_rank must be a whole number, got {node_rank!r}")
    conf = dict(rdzv_conf or {})
    unknown = sorted(set(conf) - set(RDZV_CONF_KEYS))
    if unknown:
        raise LaunchError(
            f"rdzv_conf keys {unknown} have no meaning in nblaunch: it takes "
            f"{', '.join(RDZV_CONF_KEYS)} ('join_timeout' is rdzv_timeout=)"
        )
    node_rank = conf.get("rank", node_rank)
    if node_rank != 0:
        raise LaunchError(
            f"node_rank={node_rank}: with nblaunch the notebook's machine is always node 0 and "
            "hosts the rendezvous; launch here with num_nodes= and rdzv_endpoint=, and start "
            "the other nodes with the 'python -m nblaunch join ...' command it prints (or "
            "start_nodes='ssh' or 'srun')"
        )
    if rdzv_backend not in RDZV_BACKENDS:
        raise LaunchError(
            f"rdzv_backend={rdzv_backend!r}: nblaunch's notebook hosts the rendezvous itself "
            "(torch's c10d rendezvous on rdzv_endpoint='host:port'); pass "
            f"{' or '.join(repr(b) for b in RDZV_BACKENDS)}, or leave it out"
        )
    if "join_timeout" in conf:
        if rdzv_timeout is not None and rdzv_timeout != conf["join_timeout"]:
            raise LaunchError(
                f"rdzv_conf join_timeout={conf['join_timeout']!r} and "
                f"rdzv_timeout={rdzv_timeout!r} disagree: pass one of them"
            )
        rdzv_timeout = conf["join_timeout"]
    return Rendezvous(
        master_port=port,
        rdzv_endpoint=rdzv_endpoint or None,  # Accelerate's "" is "not given"
        rdzv_id=None if rdzv_id == NO_RDZV_ID else rdzv_id,
        rdzv_timeout=rdzv_timeout,
    )


def positional(
    values: tuple[Any, ...], given: dict[str, Any], defaults: dict[str, Any]
) -> tuple[Any, ...]:
    """The values of :data:`POSITIONAL`, in its order, with Accelerate's positional arguments
    after ``num_processes`` (``values``) in place of the keywords' (``given``).

    Raises
    ------
    TypeError
        More positional arguments than Accelerate takes, or one also given by keyword (with
        another value than its default), as Python says for a call that does not fit.
    """
    if len(values) > len(POSITIONAL):
        raise TypeError(
            f"notebook_launcher() takes at most {3 + len(POSITIONAL)} positional arguments, "
            f"as Accelerate's does (function, args, num_processes, {', '.join(POSITIONAL)}), "
            f"but {3 + len(values)} were given; nblaunch's own options (kwargs=, block=, "
            "detach=, timeout=, ...) are keyword-only"
        )
    chosen = dict(given)
    for name, value in zip(POSITIONAL, values, strict=False):  # fewer values: the rest keep theirs
        if given[name] != defaults[name]:
            raise TypeError(
                f"notebook_launcher() got multiple values for argument {name!r} (by position, "
                "in Accelerate's order, and by keyword): pass it once"
            )
        chosen[name] = value
    return tuple(chosen[name] for name in POSITIONAL)


def _port(use_port: str | int | None, master_port: int | None) -> int | None:
    """The master port from Accelerate's ``use_port`` (a string there) or ``master_port``."""
    if use_port is None:
        return master_port
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise LaunchError(f"use_port must be a port number, got {use_port!r}") from None
    if master_port is not None and master_port != port:
        raise LaunchError(
            f"use_port={use_port!r} and master_port={master_port!r} disagree: they are the "
            "same setting (Accelerate's name and nblaunch's); pass one"
        )
    return port
