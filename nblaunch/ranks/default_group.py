"""The default process group inside a rank, shared with code that makes and destroys its own.

nblaunch makes the default process group before a task runs, so code that never calls
``torch.distributed.init_process_group`` finds a ready group. Code written for torchrun, and the
PyTorch DDP tutorial, calls it itself (often after setting ``MASTER_ADDR``/``MASTER_PORT``) and
ends with ``destroy_process_group()``; plain torch would answer the first call with "trying to
initialize the default process group twice!". Inside a rank, ``init_process_group`` is therefore
replaced by :func:`init_process_group`, which

- returns at once while nblaunch's group is the default group and already is what the call asks
  for (same backend for this rank's device, no other timeout, no ``pg_options``). The ranks have
  met already, so ``init_method``, ``store``, ``MASTER_ADDR`` and ``MASTER_PORT`` do not matter;
- replaces the group with one made as asked (gloo on GPU ranks, ``"cpu:gloo,cuda:nccl"``, a
  shorter timeout) when the call asks for something else, on nblaunch's store;
- makes a new group on nblaunch's store after the user destroyed the default group; the next task
  that runs on every rank does the same when it starts and finds no group;
- raises ``ValueError`` naming the problem and the fix for a ``rank`` or ``world_size`` that is
  not this rank's, NCCL on CPU ranks, a ``device_id`` that is not this rank's device, or a
  backend this torch does not have.

Every group after the first meets under a fresh prefix of the store (one per generation), so keys
an earlier group left in the store cannot be mistaken for the new group's. As with plain
torch.distributed, every rank must make (and destroy) groups the same number of times.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from nblaunch.errors import add_note
from nblaunch.ranks.checks import process_groups

# Keys of the rendezvous store under which the second, third, ... group meet.
GENERATION_PREFIX = "nblaunch/generation"


@dataclass
class _Shared:
    """What this rank needs to make the default group again: its store, place and backend."""

    store: Any  # the rendezvous TCPStore; holding it keeps rank 0's server up after a destroy
    rank: int
    world_size: int
    device: Any  # torch.device of this rank
    backend: str  # nblaunch's choice: "gloo" on CPU ranks, "nccl" on CUDA ranks, "xla" on TPUs
    init_method: str | None = None  # "xla://": torch_xla's rendezvous (on this store) decides
    generation: int = 0  # groups made so far
    group: Any = None  # the last default group made here
    timeout: datetime.timedelta | None = None  # the timeout it was asked for, if any


_shared: _Shared | None = None
_original_init: Any = None


def set_up(
    store: Any,
    rank: int,
    world_size: int,
    device: Any,
    backend: str,
    init_method: str | None = None,
) -> None:
    """Make nblaunch's default group on ``store`` (through ``init_method`` when given) and
    take over ``init_process_group``."""
    global _shared
    _install()
    _shared = _Shared(store, rank, world_size, device, backend, init_method)
    _make(backend, device_id=_default_device_id())


def ensure_ready() -> None:
    """Make the default group again if the previous task destroyed it (all ranks call this)."""
    import torch.distributed as dist

    if _shared is not None and not dist.is_initialized():
        _make(_shared.backend, device_id=_default_device_id())


def tear_down() -> None:
    """Destroy the default group if one is left (the user may have destroyed it already).

    The rank is about to exit: its rendezvous store is left to the exit, because freeing it
    here waits ~20 ms for the store's server thread, and every launch waited for that.
    """
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(
    backend: Any = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    _ranks: list[int] | None = None,
) -> None:
    """``torch.distributed.init_process_group`` inside an nblaunch rank (see the module).

    Raises
    ------
    ValueError
        ``rank``/``world_size`` are not this rank's, NCCL on CPU ranks, a ``device_id`` that is
        not this rank's device, or a backend this torch does not have.
    """
    from torch.distributed.distributed_c10d import GroupMember

    shared = _shared
    world = GroupMember.WORLD
    if shared is None or (world is not None and world is not shared.group):
        # Not in a rank nblaunch set up, or a group made around this function: torch decides.
        return _original_init(
            backend,
            init_method,
            timeout,
            world_size,
            rank,
            store,
            group_name,
            pg_options,
            device_id,
            _ranks,
        )
    _check_place(shared, rank, world_size)
    device_id = _check_device_id(shared, device_id)
    wanted = _wanted_backend(shared, backend, device_id)
    if world is not None:
        if _satisfies(shared, wanted, timeout, pg_options):
            return
        import torch.distributed as dist

        dist.destroy_process_group()
    _make(
        wanted or shared.backend,
        timeout=timeout,
        pg_options=pg_options,
        device_id=device_id if device_id is not None else _default_device_id(),
    )


# --- internals -----------------------------------------------------------------------------------


def _install() -> None:
    """Put :func:`init_process_group` where user code looks it up (both names torch exports)."""
    global _original_init
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _original_init is None:
        _original_init = c10d.init_process_group
        # help() and inspect.signature() show torch's documentation and signature.
        init_process_group.__wrapped__ = _original_init  # type: ignore[attr-defined]
        init_process_group.__nblaunch_original__ = _original_init  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group
    if not hasattr(c10d.destroy_process_group, "__nblaunch_original__"):
        dist.destroy_process_group = c10d.destroy_process_group = _counting_destroy(
            c10d.destroy_process_group
        )


def _counting_destroy(original: Any) -> Any:
    """``destroy_process_group`` that keeps the groups' collective counts first
    (:func:`nblaunch.ranks.checks.process_groups.before_destroy`): a rank that destroyed its group
    and returned is then said to have issued what it issued, not 0."""

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        process_groups.before_destroy()
        return original(*args, **kwargs)

    destroy_process_group.__nblaunch_original__ = original  # type: ignore[attr-defined]
    return destroy_process_group


def _make(
    backend: str,
    *,
    timeout: datetime.timedelta | None = None,
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Make the default group on this rank's store, under a fresh prefix after the first."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import GroupMember

    shared = _shared
    assert shared is not None
    generation = shared.generation
    shared.generation += 1  # a failed attempt's keys must not meet the next attempt either
    store = shared.store
    if generation:
        store = dist.PrefixStore(f"{GENERATION_PREFIX}/{generation}", store)
    options: dict[str, Any] = {}
    if timeout is not None:
        options["timeout"] = timeout
    if pg_options is not None:
        options["pg_options"] = pg_options
    if shared.init_method is not None:  # it names rank and world size itself
        meeting = {"init_method": shared.init_method}
    else:
        meeting = {"store": store, "rank": shared.rank, "world_size": shared.world_size}
    try:
        _original_init(backend=backend, device_id=device_id, **meeting, **options)
    except RuntimeError as exc:
        hint = connect_hint(str(exc), shared.rank)
        if hint:
            add_note(exc, hint)
        raise
    if (dist.get_rank(), dist.get_world_size()) != (shared.rank, shared.world_size):
        raise RuntimeError(
            f"{_where(shared)}: init_method={shared.init_method!r} made this process rank "
            f"{dist.get_rank()} of {dist.get_world_size()}; the runtime's layout does not match "
            "nblaunch's ranks (TPU_VISIBLE_CHIPS, CLOUD_TPU_TASK_ID): unset the TPU_* "
            "variables in the notebook and launch again"
        )
    shared.group = GroupMember.WORLD
    shared.timeout = timeout


def connect_hint(message: str, rank: int) -> str | None:
    """What to set when a rank could not connect to a peer (gloo's ``remote=[ADDR]:PORT``):
    which address was tried, from which node and interface. None for other errors."""
    tried = re.search(r"remote=\[([^\]]+)\]:(\d+)", message)
    if tried is None:
        return None
    address = tried.group(1)
    interface = os.environ.get("GLOO_SOCKET_IFNAME") or "gloo's own choice"
    hint = (
        f"nblaunch: rank {rank} on node {os.environ.get('NODE_RANK', '0')} "
        f"({socket.gethostname()}, interface {interface}) could not connect to a peer at "
        f"{address}:{tried.group(2)}. "
    )
    if address.startswith("127.") or address == "::1":
        hint += "That peer advertised a loopback address: its hostname resolves to loopback. "
    return hint + (
        "Set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for NCCL) in the environment of the "
        "notebook and of every join to the interface of the network the nodes share "
        "(`ip route get <other node's address>` names it), and let the nodes connect to each "
        "other on any TCP port."
    )


def _default_device_id() -> Any:
    # Only NCCL uses device_id (to make its communicator at once), as nblaunch always did.
    assert _shared is not None
    return _shared.device if _shared.device.type == "cuda" else None


def _where(shared: _Shared) -> str:
    return f"rank {shared.rank} of {shared.world_size}"


def _check_place(shared: _Shared, rank: Any, world_size: Any) -> None:
    if world_size not in (None, -1) and world_size != shared.world_size:
        raise ValueError(
            f"{_where(shared)}: init_process_group(world_size={world_size!r}) but nblaunch "
            f"started {shared.world_size} ranks. Leave world_size and rank out (RANK and "
            "WORLD_SIZE are set), pass world_size=nblaunch.world_size(), or launch "
            f"{world_size!r} ranks (num_processes={world_size!r})."
        )
    if rank not in (None, -1) and rank != shared.rank:
        raise ValueError(
            f"{_where(shared)}: init_process_group(rank={rank!r}) but this process is rank "
            f"{shared.rank}. Leave rank out, or pass rank=nblaunch.rank(); a function written "
            "for mp.spawn, like the DDP tutorial's demo_basic(rank, world_size), gets its rank "
            "from its caller: launch lambda: demo_basic(nblaunch.rank(), nblaunch.world_size())."
        )


def _check_device_id(shared: _Shared, device_id: Any) -> Any:
    """The ``torch.device`` that ``device_id`` names, if it is this rank's device."""
    import torch

    if device_id is None:
        return None
    ours = shared.device
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        if ours.type == "cpu":
            raise ValueError(
                f"{_where(shared)}: init_process_group(device_id={device_id}) names an "
                "accelerator, but nblaunch started CPU ranks. Leave device_id out, or launch "
                "on GPUs (device_type='cuda')."
            )
        device_id = torch.device(ours.type, device_id)
    device = torch.device(device_id)
    same_index = device.index is None or ours.index is None or device.index == ours.index
    if device.type != ours.type or not same_index:
        raise ValueError(
            f"{_where(shared)}: init_process_group(device_id={str(device)!r}) but this rank "
            f"runs on {ours} (nblaunch gives each rank the device of its LOCAL_RANK). Leave "
            "device_id out, or pass device_id=nblaunch.device()."
        )
    return ours  # "cuda" alone means the current device, which nblaunch set to this rank's


def _backend_map(backend: str) -> dict[str, str]:
    """Which backend ``backend`` uses for each device type, as torch reads it."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    return dict(BackendConfig(Backend(backend)).get_device_backend_map())


def _wanted_backend(shared: _Shared, backend: Any, device_id: Any) -> str | None:
    """The backend a call asks for (``None``: whatever nblaunch chose), checked for this rank.

    Raises
    ------
    ValueError
        The backend has nothing for this rank's device (NCCL on CPU ranks), or torch lacks it.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend

    if backend is None:
        if device_id is None:
            return None
        backend = Backend.default_device_backend_map.get(device_id.type, shared.backend)
    wanted = str(Backend(str(backend)))
    per_device = _backend_map(wanted)
    kind = shared.device.type
    if kind not in per_device:
        if kind == "cpu" and "nccl" in per_device.values():
            raise ValueError(
                f"{_where(shared)}: init_process_group(backend={wanted!r}) on a CPU rank: "
                "NCCL runs only on CUDA devices, and nblaunch started these ranks on CPU with "
                "gloo. Use backend='gloo' (or leave backend out, which picks the right one), or "
                "launch on GPUs (device_type='cuda')."
            )
        raise ValueError(
            f"{_where(shared)}: init_process_group(backend={wanted!r}) has no backend for "
            f"{kind} tensors, which this rank uses. Leave backend out, or name one for {kind} "
            f"(e.g. '{kind}:{shared.backend}')."
        )
    relevant = _relevant(shared, per_device)
    for name in sorted({per_device[kind] for kind in relevant}):
        if not dist.is_backend_available(name):
            raise ValueError(
                f"{_where(shared)}: init_process_group(backend={wanted!r}): this torch has no "
                f"{name!r} backend. Leave backend out to use {shared.backend!r}."
            )
    if not all(_usable(kind, name) for kind, name in per_device.items()):
        # "cpu:gloo,cuda:nccl" on CPU ranks of a CPU-only torch, or of the CUDA build on a
        # machine without GPUs (NCCL is there, no GPU is): make only what this rank uses.
        wanted = ",".join(f"{kind}:{per_device[kind]}" for kind in sorted(relevant))
    return wanted


def _usable(kind: str, name: str) -> bool:
    """Whether backend ``name`` can be made here for ``kind`` tensors: torch has it and, for
    CUDA, sees a GPU (``pip install torch`` on Linux is the CUDA build, GPUs or not)."""
    import torch
    import torch.distributed as dist

    return dist.is_backend_available(name) and (kind != "cuda" or torch.cuda.is_available())


def _relevant(shared: _Shared, per_device: dict[str, str]) -> set[str]:
    # This rank's device type, and CPU tensors when the backend names one for them.
    return {shared.device.type, "cpu"} & per_device.keys()


def _satisfies(
    shared: _Shared, wanted: str | None, timeout: datetime.timedelta | None, pg_options: Any
) -> bool:
    """Whether the current default group already is what the call asks for."""
    import torch.distributed as dist

    if pg_options is not None or (timeout is not None and timeout != shared.timeout):
        return False
    if wanted is None:
        return True
    current = _backend_map(str(dist.get_backend_config()))
    asked = _backend_map(wanted)
    return all(current.get(kind) == asked[kind] for kind in _relevant(shared, asked))


def rendezvous_store(rank: int, world_size: int) -> Any:
    """The TCPStore the process group meets in, listening on ``MASTER_ADDR`` only.

    ``init_method="env://"`` would make rank 0 listen on every interface; binding the socket
    ourselves keeps a single-node run on loopback.
    """
    import torch.distributed as dist

    address = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(minutes=30)
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Multi-node runs: the notebook node hosts the store (nblaunch.cluster.store), as
        # torchrun's agent does; every rank, rank 0 included, is a client.
        return dist.TCPStore(address, port, world_size, False, timeout)
    listener = socket.create_server((address, port), reuse_port=False)
    store = dist.TCPStore(
        address,
        port,
        world_size,
        True,
        timeout,
        master_listen_fd=listener.detach(),
        **listen_fd_options(),
    )
    return store


def listen_fd_options() -> dict[str, Any]:
    """``TCPStore`` keywords for a server handed a socket nblaunch bound (``master_listen_fd``).

    The libuv store, torch's default since 2.4, takes such a socket only from torch 2.8 on;
    before that it raises "The libuv TCPStore backend does not support initialization with an
    listen fd", so those versions get the older store (which takes it, and which the ranks'
    clients talk to the same way).
    """
    import torch

    if torch.torch_version.TorchVersion(torch.__version__) < (2, 8):
        return {"use_libuv": False}
    return {}
