"""Debug mode's report: what every rank reads when the ranks' collective calls disagree.

Each rank's record (built by :func:`nblaunch.ranks.checks.debug_mode.verify`) is a JSON-safe dict:
``op``, ``rank``, ``site``, ``rule``, ``n`` (how many tensors), ``shapes``/``dtypes``/``devices``
(the first few), ``key`` (digests of all of them, compared), ``out``, ``args`` and ``problem``.
:func:`mismatch_message` turns every rank's record into the same message on every rank. It
imports nothing of the project: records in, text out.

A record is made of a call's *facts* (:data:`FACTS`), a plain tuple of strings and numbers:
cheap to build and to pickle, which is what the out-of-band checks send for every collective;
the launcher compares the facts of each call (:func:`same_facts`) and makes records of them
(:func:`record_of`) only when they differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

# The operation named in the report when DDP's backward all-reduce is the call that disagrees.
DDP_ALL_REDUCE = "DDP's backward all-reduce"
# A collective torch issued itself (from C++: DDP's broadcasts, FSDP's all-gathers), as the
# flight recorder names it (``all_reduce``, ``_allgather_base``), when nothing checked it in Python.
RECORDED = "{} issued by torch"
# Tensors listed per rank in a record (the rest are summarised; the digests cover them all).
MAX_LISTED = 16
# What a call's facts tuple holds, in order: shapes, dtypes and devices of every input tensor
# (tuples), the output tensors' shapes (or None), args as (name, value) pairs.
FACTS = ("op", "site", "rule", "dim", "shapes", "dtypes", "devices", "out", "args", "problem")
# Between a call site's name and the user's frame it names (file, line, function), in the site
# ranks send (``debug_mode.site_of``); a record holds them apart (``site``, ``frame``).
FRAME_MARK = "\x1f"
# Rules under which equal facts on every rank may still disagree (outputs sized for others).
_WHOLE_GROUP_RULES = ("all_gather", "all_gather_even")


def digest(value: Any) -> str:
    """A short digest of a JSON-safe value: records compare these, not the full lists.

    Of its ``repr`` (the same in every process for lists of numbers and strings): a quarter
    of the cost of hashing its JSON, and every collective pays it.
    """
    return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()


def record_of(facts: tuple[Any, ...], rank: int) -> dict[str, Any]:
    """Debug mode's record (see the module) of one rank's call, from its facts (:data:`FACTS`)."""
    op, site, rule, dim, shapes, dtypes, devices, out, args, problem = facts
    site, frame = split_site(site)
    shapes = [list(shape) for shape in shapes]
    dtypes, devices = list(dtypes), list(devices)
    if rule == "same_except_dim":
        compared = [
            [("*" if i == dim % max(len(s), 1) else n) for i, n in enumerate(s)] for s in shapes
        ]
    elif rule in ("same", *_WHOLE_GROUP_RULES):
        compared = shapes
    else:
        compared = []
    return {
        "op": op,
        "rank": rank,
        "site": site,
        "frame": frame,
        "rule": rule,
        "n": len(shapes),
        "shapes": shapes[:MAX_LISTED],
        "dtypes": dtypes[:MAX_LISTED],
        "devices": devices[:MAX_LISTED],
        "key": {"shape": digest(compared), "dtype": digest(dtypes), "device": digest(devices)},
        "out": digest([list(shape) for shape in out]) if out is not None else None,
        "args": dict(args),
        "problem": problem,
    }


def split_site(site: str) -> tuple[str, list[Any] | None]:
    """A call site as ranks send it: its name in the report, and the user's frame it names as
    ``[file, line, function]`` (None when no frame of the user's code was found)."""
    name, *frame = site.split(FRAME_MARK)
    if len(frame) != 3 or not frame[1].isdigit():
        return name, None
    return name, [frame[0], int(frame[1]), frame[2]]


def user_frame(records: dict[int, Any]) -> list[tuple[str, int, str]]:
    """The user's frame ``(file, line, function)`` that the call of the lowest rank names, of
    one collective's facts or records by rank; [] when none names one."""
    for rank in sorted(records):
        record = records[rank]
        frame = (record_of(record, rank) if type(record) is tuple else record).get("frame")
        if frame:
            return [(frame[0], frame[1], frame[2])]
    return []


def same_facts(facts: list[tuple[Any, ...]]) -> bool:
    """True when calls with these facts (one per rank) are consistent without a closer look:
    the same in everything but the call site, with no problem found and no output sized for
    other ranks' inputs. False says nothing: :func:`mismatch_message` of their records decides.
    """
    first = facts[0]
    if first[2] in _WHOLE_GROUP_RULES or first[9] is not None:
        return False
    return all(f[0] == first[0] and f[2:] == first[2:] for f in facts[1:])


def mismatch_message(records: list[dict[str, Any]]) -> str | None:
    """The report for records that disagree, or ``None`` when the call is consistent."""
    first = records[0]
    if len({r["op"] for r in records}) > 1:
        said = (" while " if len(records) == 2 else ", ").join(
            f"rank {r['rank']} {_entered(r['op'])} at {r['site']}" for r in records
        )
        return (
            "Cannot apply desired operation: processes called different collectives at the same "
            f"step ({said}).\n\nOperations:\n"
            + "".join(
                f"  - Process {r['rank']}: `{r['op']}` at {r['site']}, input shapes "
                f"{_listing(r, 'shapes')}\n"
                for r in records
            )
            + "\nEvery rank must call the same collectives in the same order; look for a branch "
            "on the rank or a loop that runs a different number of times on some ranks."
        )
    operation = first["op"]
    for name in sorted({k for r in records for k in r["args"]}):
        values = [r["args"].get(name) for r in records]
        if any(v != values[0] for v in values):
            return _table(
                f"Cannot apply desired operation due to argument mismatches. Every process must "
                f"pass the same {name}.",
                operation,
                "Arguments",
                records,
                lambda r, name=name: f"{name}={r['args'].get(name)}",
            )
    if any(r.get("problem") for r in records):
        return _table(
            "Cannot apply desired operation due to invalid arguments.",
            operation,
            "Problems",
            records,
            lambda r: r.get("problem") or "ok",
        )
    rule = first.get("rule", "same")
    if rule in ("all_gather", "all_gather_even"):
        inputs = [r["shapes"][0] if r["shapes"] else [] for r in records]
        if any(r["out"] != digest(inputs) for r in records):
            return _shape_table(operation, records)
        if rule == "all_gather_even" and _differs(records, "shape"):
            return _shape_table(operation, records)
    elif rule != "none" and _differs(records, "shape"):
        return _shape_table(operation, records)
    if _differs(records, "dtype"):
        return _table(
            "Cannot apply desired operation due to dtype mismatches. All dtypes across devices "
            "must be the same.",
            operation,
            "Input dtypes",
            records,
            lambda r: _listing(r, "dtypes"),
        )
    if _differs(records, "device"):
        return _table(
            "Cannot apply desired operation due to device mismatches. All tensors must be on "
            "the same type of device on every process.",
            operation,
            "Input devices",
            records,
            lambda r: _listing(r, "devices"),
        )
    return None


def _differs(records: list[dict[str, Any]], field: str) -> bool:
    values = [(r.get("n"), r["key"].get(field)) for r in records]
    return any(v != values[0] for v in values)


def _shape_table(operation: str, records: list[dict[str, Any]]) -> str:
    return _table(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices "
        "must be valid.",
        operation,
        "Input shapes",
        records,
        lambda r: _listing(r, "shapes"),
    )


def _table(
    headline: str,
    operation: str,
    what: str,
    records: list[dict[str, Any]],
    cell: Callable[[dict[str, Any]], str],
) -> str:
    lines = [headline, "", f"Operation: `{operation}`", f"{what}:"]
    lines += [f"  - Process {r['rank']}: {cell(r)}" for r in records]
    lines += ["", "Called at:"]
    lines += [f"  - Process {r['rank']}: {r['site']}" for r in records]
    return "\n".join(lines)


def _listing(record: dict[str, Any], field: str) -> str:
    items = record.get(field) or []
    n = record.get("n", len(items))
    if n == 0:
        return "(no tensors)"
    text = ", ".join(format_shape(item) for item in items)
    if n > len(items):
        text += f", ... ({n} tensors)"
    return text


def format_shape(item: Any) -> str:
    """``[2, 3]`` for a shape; anything else as ``str`` does."""
    if isinstance(item, list):
        return "[" + ", ".join(str(n) for n in item) + "]"
    return str(item)


def _short(operation: str) -> str:
    return operation.rsplit(".", 1)[-1]


def _entered(operation: str) -> str:
    """``called all_reduce``; a collective a library issues itself is ``entered``."""
    if operation == DDP_ALL_REDUCE or is_recorded(operation):
        return f"entered {operation}"
    return f"called {_short(operation)}"


def is_recorded(operation: str) -> bool:
    """True for a collective torch issued itself, as the flight recorder's reader names it."""
    return operation.endswith(RECORDED.format(""))


def base_operation(operation: str) -> str:
    """The collective under a name: ``all_reduce`` for ``torch.distributed.all_reduce``, for
    ``nblaunch.ranks.ops.all_reduce`` and for ``all_reduce issued by torch``."""
    if operation == DDP_ALL_REDUCE:
        return "all_reduce"
    if is_recorded(operation):
        operation = operation[: -len(RECORDED.format(""))]
    name = operation.rsplit(".", 1)[-1]
    return {"allreduce": "all_reduce", "allgather": "all_gather"}.get(name, name)
