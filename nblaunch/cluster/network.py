"""Which network interface a node's ranks use for their collectives, and what the header says.

gloo and NCCL advertise to the other ranks the address of one interface; left alone, gloo takes
the address the machine's hostname resolves to, which on a fresh Debian or Ubuntu machine is
loopback (``/etc/hosts`` maps the hostname to 127.0.1.1), so a rank on another host is told to
connect to 127.0.0.1 and fails. Every node (the notebook's and each ``join``) therefore gives its
ranks the interface that routes to the rendezvous endpoint, the one the nodes are known to reach
each other on: :func:`route_to` asks the kernel's routing table (a UDP ``connect`` sends
nothing), :func:`socket_env` turns it into ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` unless
the person set them, and :func:`describe` is the line the view's header and the join's log show.
"""

from __future__ import annotations

import dataclasses
import os
import socket

# The variables that pick the interface of gloo's and NCCL's sockets.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclasses.dataclass(frozen=True)
class Route:
    """This machine's way to ``target``: the ``interface`` (None when no interface holds the
    source address) and this machine's ``address`` on it."""

    target: str
    interface: str | None
    address: str


def route_to(host: str, port: int) -> Route | None:
    """The interface and source address this machine uses to reach ``host:port``.

    On the notebook's node ``host`` is one of its own addresses: the route is that address's
    own interface (loopback's for 127.0.0.x). None when ``host`` does not resolve or no route
    leads there.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # UDP: picks the route and source address, sends nothing
            address = probe.getsockname()[0]
    except OSError:
        return None
    target = str(sockaddr[0])
    # On the notebook's node the endpoint is this machine's own address (127.0.0.2 included,
    # which no interface lists): the route's interface is that address's own.
    return Route(target, interface_of(address), target if _is_own(family, target) else address)


def _is_own(family: int, address: str) -> bool:
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
            return True
    except OSError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` on this machine."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def socket_env(route: Route | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for ``route``'s interface, leaving out
    each one the person set in ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    if route is None or route.interface is None:
        return {}
    return {name: route.interface for name in SOCKET_IFNAME_VARS if name not in environ}


def describe(route: Route | None, environ: dict[str, str] | None = None) -> str:
    """One line on the interface this node's ranks use, for the header and the join's log."""
    environ = os.environ if environ is None else environ
    chosen = {name: environ[name] for name in SOCKET_IFNAME_VARS if name in environ}
    if chosen:
        return "network: " + ", ".join(f"{k}={v}" for k, v in chosen.items()) + " (as set)"
    if route is None or route.interface is None:
        target = route.target if route else "the rendezvous endpoint"
        return (
            f"network: no interface found that routes to {target}; gloo and NCCL pick their "
            "own (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if ranks cannot connect)"
        )
    return (
        f"network: gloo and NCCL use {route.interface} ({route.address}), the interface that "
        f"reaches {route.target}; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose another"
    )
