"""The stand-in's ``xla`` backend and ``xla://`` rendezvous, as torch_xla registers them.

The rendezvous follows torch_xla's: rank and world size from the runtime, the store on
``MASTER_ADDR:MASTER_PORT``, joined as a client under ``/worker/attempt_<n>`` when an agent
hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``). The backend is gloo underneath; it is
registered for CPU tensors too, since the stand-in has no XLA tensors to reduce.
"""

from __future__ import annotations

import os

import torch.distributed as dist

import torch_xla
from torch_xla import runtime as xr


def _rendezvous(url, timeout=None, **kwargs):
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(
            f"/worker/attempt_{attempt}",
            dist.TCPStore(address, port, xr.process_count(), is_master=False),
        )
    else:
        store = dist.TCPStore(address, port, xr.process_count(), is_master=xr.process_index() == 0)
    rank, size = xr.global_ordinal(), xr.world_size()
    torch_xla.RECORD["rendezvous"].append(
        {"url": url, "agent_store": agent, "rank": rank, "world_size": size}
    )
    yield store, rank, size


def _make_group(store, rank, size, timeout):
    torch_xla.RECORD["groups"].append({"rank": rank, "size": size})
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("xla", _make_group, devices=["xla", "cpu"])
dist.register_rendezvous_handler("xla", _rendezvous)
