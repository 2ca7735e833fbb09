"""``notebook_launcher`` and ``debug_launcher``: the one-shot front end.

A launch goes through four steps:

1. **Validate and plan** (:func:`nblaunch.engine.plan.launch_plan.plan_launch`): check every
argument,
   pick devices, backend and port, and serialise the function with its arguments. Anything
   wrong is a ``LaunchError`` before a process starts.
2. **Start** the ranks and send each its setup and task (:class:`nblaunch.engine.run.run.Run`).
3. **Watch**: relay output and events to the view, collect results, and spot the root cause when
   something fails: the first *primary* failure, never a rank that only saw its peer die.
4. **Finish**: stop every rank (politely, then by force), then return the results by rank or
   raise what :mod:`nblaunch.engine.verdict` says: the failing rank's own exception.

``LaunchPlan``, ``plan_launch``, ``serialize_payload`` and ``Run`` stay importable from here.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

from nblaunch.engine.plan.launch_plan import (  # noqa: F401  (kept importable from here)
    LaunchPlan,
    find_unpicklable,
    plan_launch,
    serialize_payload,
)
from nblaunch.engine.processes import spares
from nblaunch.engine.run.run import Run
from nblaunch.errors import LaunchError
from nblaunch.notebook import accelerate_keywords
from nblaunch.notebook.pool import refuse_if_running
from nblaunch.options import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_MONITOR_INTERVAL_S,
    LaunchOptions,
    NodeOptions,
    format_line_prefix,
)

if TYPE_CHECKING:
    from nblaunch.notebook.handle import RunHandle


def notebook_launcher(
    function: Any,
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int | None = None,
    *accelerate_args: Any,
    kwargs: dict[str, Any] | None = None,
    start_method: str = "forkserver",
    debug: bool | None = None,
    log_level: str | None = None,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
    timeout: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    setup_process_group: bool = True,
    device_type: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    display: str = "auto",
    debug_on_error: bool = False,
    num_nodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_timeout: float | None = None,
    rdzv_id: str | None = None,
    start_nodes: str | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    cluster: Any = None,
    mixed_precision: str | None = None,
    use_port: str | int | None = None,
    node_rank: int = 0,
    rdzv_backend: str = "static",
    rdzv_conf: dict[str, Any] | None = None,
    max_restarts: int = 0,
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL_S,
    log_line_prefix_template: str | None = None,
    block: bool = True,
    detach: bool = False,
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` ranks and return what each returned.

    Parameters
    ----------
    function
        Any callable: defined in the notebook, a lambda or a closure. It travels by value.
    args, kwargs
        Its arguments; everything must pickle (checked before anything starts).
    num_processes
        Number of ranks (per node, with ``num_nodes``). Default: one per visible GPU, else 1
        (pass a number for more CPU ranks).
    accelerate_args
        Accelerate's parameters after ``num_processes``, by position in Accelerate's order
        (``mixed_precision``, ``use_port``, ``master_addr``, ``node_rank``, ``num_nodes``, ...,
        ``log_line_prefix_template``), so an Accelerate call runs unchanged. nblaunch's own
        options are keyword-only.
    start_method
        ``"forkserver"`` (default, fast after the first launch), ``"spawn"`` or ``"fork"``.
    debug
        ``None`` (default): every rank sends a record of each collective to the launcher,
        which compares them and raises ``DistributedOperationException`` when ranks disagree
        (``NBLAUNCH_CHECKS=0`` turns this off; ``NBLAUNCH_DEBUG=1`` means ``True``). ``True``:
        debug mode, every collective is checked before it runs. ``False``: no checks.
    log_level
        Level of ``nblaunch.get_logger`` loggers in the ranks (default: ``NBLAUNCH_LOG_LEVEL``).
    hang_timeout
        Seconds nothing may move while ranks wait in collectives before the run is stopped
        with ``DistributedHangError`` (default 300); ``None`` turns this check off. A rank
        that returned while others wait in a collective it never called is reported at once,
        whatever this is.
    timeout
        Stop the run after this many seconds (``LaunchTimeoutError``); ``None`` for no limit.
    master_addr, master_port
        Where rank 0 listens; the port defaults to a free one. Loopback only by default.
    setup_process_group
        Initialise the default process group before ``function`` runs (and destroy it after).
    device_type
        ``"cuda"``, ``"cpu"``, ``"xla"`` (TPUs, or XLA's CPU runtime with ``PJRT_DEVICE=CPU``),
        or any device type torch knows (``"xpu"``, ``"npu"``, ``"hpu"``, a plug-in's, imported
        in every rank from ``NBLAUNCH_DEVICE_MODULES``); default: what this machine has. Each
        rank owns the device of its local rank (see docs/devices.md).
    run_dir
        Where per-rank logs go (default ``.nblaunch/runs/<time>-<id>``).
    display
        ``"auto"`` (widget in a notebook, text elsewhere), ``"widget"``, ``"text"``, ``"none"``.
    debug_on_error
        A rank whose function raises opens the debugger at the failing frame (post-mortem,
        prompts in the notebook) before the failure is reported and the others are stopped.
    num_nodes, rdzv_endpoint, rdzv_timeout, rdzv_id
        Run on ``num_nodes`` machines, ``num_processes`` ranks on each: this machine hosts the
        rendezvous on ``rdzv_endpoint`` (``"host:port"``, one of its own addresses) and prints
        the ``python -m nblaunch join`` command for the other nodes, which must join within
        ``rdzv_timeout`` seconds (default 600). ``rdzv_id`` pins the run id, so the join
        commands can be started before the cell. See :mod:`nblaunch.cluster.run`.
    start_nodes, hostfile
        Start the other nodes' join from here: ``"ssh"`` on the hosts of ``hostfile`` (after
        checking passwordless ssh), or ``"srun"`` inside a Slurm allocation. See
        :mod:`nblaunch.cluster.node_start`.
    cluster
        ``"ray"`` or :class:`nblaunch.RayCluster`: a Ray cluster places the other
        ``num_nodes - 1`` nodes (one agent actor per node runs their join; this node hosts the
        rendezvous on the address Ray reports for it). Uses the Ray this process initialised,
        else ``ray.init(address="auto")``. See :mod:`nblaunch.cluster.ray_nodes` and docs/ray.md.
        ``"slurm"``: Slurm places them, as a step of this allocation inside one (``srun``), else
        as a batch job of their own; :class:`nblaunch.SlurmCluster` says what the job asks for
        (partition, time, GPUs, account) and ``nodes`` stands for ``num_nodes - 1``. The
        rendezvous defaults to this machine's address toward slurmctld. See
        :mod:`nblaunch.cluster.slurm_nodes` and docs/multinode.md.
    mixed_precision
        Accelerate's ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``: the ranks get
        ``ACCELERATE_MIXED_PRECISION``, so ``Accelerator()`` in ``function`` trains in it.
        Default: the variable is left as the notebook has it.
    use_port
        Accelerate's name for ``master_port`` (a string there).
    node_rank, rdzv_backend, rdzv_conf
        Accelerate's rendezvous keywords: the notebook is node 0 (``node_rank=0``); either
        ``rdzv_backend`` (``"static"``, ``"c10d"``) means nblaunch's rendezvous; ``rdzv_conf``
        may hold ``join_timeout`` (``rdzv_timeout``). Other values raise ``LaunchError``.
        Accelerate's ``rdzv_endpoint=""`` and ``rdzv_id="none"`` mean "not given".
    max_restarts
        After a rank fails, dies or hangs, stop every rank and start the whole run again, up
        to this many times, as torchrun's elastic agent does: the ranks read the attempt in
        ``TORCHELASTIC_RESTART_COUNT``, so code that checkpoints can resume. The exception
        comes only when the restarts are spent, with a note for every attempt. One machine.
    monitor_interval
        How long the launcher waits for the ranks before it looks at quiet ones again (exits,
        the hang watchdog, ``timeout``); output and events are handled as they come.
    log_line_prefix_template
        The text view's line prefix, torchrun's fields: ``"[${rank}]: "`` (or ``"[{rank}] "``;
        ``${local_rank}``, ``${role_name}`` too). Default ``"[rank N] "``.
    block
        ``False``: start the ranks, show the live view and return a ``RunHandle`` at once; the
        run goes on in the background while other cells run (see docs/background.md). With
        ``num_nodes``, the call returns before the other nodes gather.
    detach
        Like ``block=False``, but the ranks run under a run host of their own that outlives
        this kernel (a restart, a crash); ``nblaunch.attach()`` in a new kernel gets it back.
        With ``num_nodes``, the run host is the notebook node (it hosts the rendezvous).

    Returns
    -------
    list or RunHandle
        ``function``'s return value on each rank, indexed by rank; a ``RunHandle`` with
        ``block=False`` or ``detach=True`` (its ``result()`` returns that list).

    Raises
    ------
    LaunchError
        Bad arguments, an unpicklable function or argument, a busy port: nothing was started.
    RendezvousTimeoutError
        Multi-node: not every node joined within ``rdzv_timeout`` (a ``LaunchError``).
    Exception
        The failing rank's own exception, re-created here with its traceback and a note
        naming the rank.
    RankFailedError
        A rank died without a Python exception (signal, exit code).
    LaunchTimeoutError
        ``timeout`` ran out.
    KeyboardInterrupt
        The launch was interrupted; every rank has been stopped.
    """
    __tracebackhide__ = True  # the rank's traceback matters, not the launcher's frames

    if accelerate_args:  # Accelerate's call, by position: each value under its keyword
        (
            mixed_precision,
            use_port,
            master_addr,
            node_rank,
            num_nodes,
            rdzv_backend,
            rdzv_endpoint,
            rdzv_conf,
            rdzv_id,
            max_restarts,
            monitor_interval,
            log_line_prefix_template,
        ) = accelerate_keywords.positional(
            accelerate_args,
            {
                "mixed_precision": mixed_precision,
                "use_port": use_port,
                "master_addr": master_addr,
                "node_rank": node_rank,
                "num_nodes": num_nodes,
                "rdzv_backend": rdzv_backend,
                "rdzv_endpoint": rdzv_endpoint,
                "rdzv_conf": rdzv_conf,
                "rdzv_id": rdzv_id,
                "max_restarts": max_restarts,
                "monitor_interval": monitor_interval,
                "log_line_prefix_template": log_line_prefix_template,
            },
            _keyword_defaults(),
        )
    refuse_if_running("notebook_launcher")  # a persistent pool holds the devices
    meeting = accelerate_keywords.translate(
        use_port=use_port,
        master_port=master_port,
        node_rank=node_rank,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        rdzv_timeout=rdzv_timeout,
    )
    master_port, rdzv_endpoint = meeting.master_port, meeting.rdzv_endpoint
    rdzv_id, rdzv_timeout = meeting.rdzv_id, meeting.rdzv_timeout
    if log_line_prefix_template is not None:
        format_line_prefix(log_line_prefix_template, 0)  # named before anything starts
    background = detach or not block
    if background and debug_on_error:
        raise LaunchError(
            f"debug_on_error=True needs the cell: its prompts wait in it. Leave "
            f"{'detach=True' if detach else 'block=False'} out to debug, or use "
            "nblaunch.breakpoint() in a blocking launch"
        )
    if cluster is not None:
        from nblaunch.cluster.placement import placed_by  # not at import: ~10 ms, rarely used

        endpoint, start_nodes, placed, cluster = placed_by(
            cluster, num_nodes, start_nodes, rdzv_endpoint
        )
        rdzv_endpoint, num_nodes = endpoint, placed or num_nodes
    options = LaunchOptions(
        start_method=start_method,
        debug=debug,
        log_level=log_level,
        hang_timeout=hang_timeout,
        timeout=timeout,
        master_addr=master_addr,
        master_port=master_port,
        setup_process_group=setup_process_group,
        device_type=device_type,
        run_dir=run_dir,
        debug_on_error=debug_on_error,
        mixed_precision=mixed_precision,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
    )
    views = {"line_prefix": log_line_prefix_template, "ranks_per_node": num_processes}
    if num_nodes != 1 or rdzv_endpoint is not None or rdzv_id is not None or start_nodes:
        if debug_on_error:
            raise LaunchError(
                "debug_on_error=True works on one machine only: its prompts cannot reach "
                "another node's ranks; debug on one node, then scale out"
            )
        if max_restarts:
            raise LaunchError(
                f"max_restarts={max_restarts} works on one machine for now: a restart would "
                "need every node to join again; use num_nodes=1, or restart the cell"
            )
        nodes = NodeOptions(
            num_nodes, rdzv_endpoint, rdzv_timeout, rdzv_id, start_nodes, hostfile, cluster
        )
        from nblaunch.cluster.run import launch_multinode, plan_multinode  # not at import
        from nblaunch.notebook.views import choose_view

        if background:
            plan, payload = plan_multinode(function, args, num_processes, options, nodes, kwargs)
            return _in_background(function, plan, payload, display, detach, views, nodes)
        return launch_multinode(
            function,
            args,
            num_processes,
            options,
            nodes,
            view_factory=lambda: choose_view(display, defer="never", **views),
            kwargs=kwargs,
        )
    plan = plan_launch(function, num_processes, options)
    payload = serialize_payload(function, args, kwargs)
    from nblaunch.notebook.views import choose_view  # not at import: ~12 ms

    if background:
        return _in_background(function, plan, payload, display, detach, views)
    # A live widget is deferred: a quick launch shows its summary.
    view = choose_view(display, **views)
    try:
        return Run(plan, view).execute(payload)
    finally:
        # The notebook will likely run this again: have its ranks' processes ready by then.
        spares.fork_ahead(plan.world_size, plan.start_method, plan.device_type)


def _keyword_defaults() -> dict[str, Any]:
    """``notebook_launcher``'s keyword-only parameters and their defaults."""
    parameters = inspect.signature(notebook_launcher).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}


def _in_background(
    function: Any,
    plan: LaunchPlan,
    payload: bytes,
    display: str,
    detach: bool,
    views: dict[str, Any],
    nodes: NodeOptions | None = None,
) -> RunHandle:
    """The handle of a run that does not hold its cell (``block=False`` or ``detach=True``)."""
    from nblaunch.notebook.handle import launch_in_background

    name = getattr(function, "__qualname__", type(function).__name__)
    return launch_in_background(
        plan, payload, display, detach=detach, function=name, views=views, nodes=nodes
    )


def debug_launcher(function: Any, args: tuple[Any, ...] = (), num_processes: int = 2) -> list[Any]:
    """Run ``function`` on ``num_processes`` CPU ranks with gloo and debug mode on.

    For testing distributed code on a laptop; otherwise the same as :func:`notebook_launcher`.
    """
    return notebook_launcher(
        function, args, num_processes, device_type="cpu", debug=True, display="auto"
    )
