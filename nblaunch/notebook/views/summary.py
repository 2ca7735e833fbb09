"""The static summary of a run: what a saved notebook keeps of it, as text and HTML.

Rendered from a :class:`~nblaunch.notebook.views.model.RunModel` when the run ends, and
displayed as a plain ``text/plain`` + ``text/html`` bundle, so a notebook opened without widget
state (GitHub, nbviewer, another Lab) still shows each rank's outcome and last lines.
"""

from __future__ import annotations

from nblaunch.events import RunState, after_restarts
from nblaunch.notebook.charts import render_svg
from nblaunch.notebook.views.ansi import esc, printable, to_html
from nblaunch.notebook.views.fold import fold_lines, rank_ranges
from nblaunch.notebook.views.model import FD, SUMMARY_VALUE_BYTES, TEXT, Line, RunModel
from nblaunch.notebook.views.render import GRID_AFTER, HOT_STATES, SEVERITY_COLORS, STATE_COLORS

# The summary keeps each rank's last lines, within a total, each cut to a length.
SUMMARY_LINES = 20
SUMMARY_TOTAL_LINES = 200
SUMMARY_LINE_CHARS = 300
# Past GRID_AFTER ranks: the "All ranks" lines kept, folded; failed ranks named one by one.
SUMMARY_FOLDS = 40
NAMED_RANKS = 5


def summary_bundle(model: RunModel) -> dict[str, str]:
    """The end-of-run summary as ``text/plain`` and ``text/html``, for saved notebooks.

    Per rank: its state and outcome (what it returned, or its error), then its last lines
    (``SUMMARY_LINES`` each, ``SUMMARY_TOTAL_LINES`` in all, with a note of how many earlier
    lines its log file holds), and the error that ended the run.
    """
    ended = model.ended or {"ok": False, "elapsed_s": 0.0, "ranks": {}}
    ranks = sorted(set(model.states) | set(ended["ranks"]))
    outcomes = {r: _outcome(model, r, ended["ranks"].get(r, "")) for r in ranks}
    header = f"nblaunch: {model.outcome_word()} in {ended['elapsed_s']:.2f} s"
    header += after_restarts(ended)
    run_dir = (model.info or {}).get("run_dir", "")
    errors = [d["title"] for d in model.diagnoses if d["severity"] == "error"][:1]
    notes = [d["title"] for d in model.diagnoses if d["severity"] != "error"][:5]
    many = len(ranks) > GRID_AFTER
    tails = _tails(model, [r for r in ranks if model.state(r) in HOT_STATES] if many else ranks)
    groups = _groups(model, ranks, outcomes) if many else []

    plain_lines = [header]
    if many:
        plain_lines += [
            f"  {what} {state.value}{': ' + outcome if outcome else ''}"
            for what, state, outcome in groups
        ]
    else:
        plain_lines += [f"  rank {r}: {model.state(r).value} · {outcomes[r]}" for r in ranks]
    stories = _stories(model)
    plain_lines += [f"  {story}" for story in stories]
    plain_lines += [f"  logs: {run_dir}"] if run_dir else []
    plain_lines += [f"error: {title}" for title in errors] + [f"note: {title}" for title in notes]
    for r, lines, earlier in tails:
        plain_lines.append(f"--- rank {r}, last {_plural(len(lines), 'line')}")
        if earlier:
            plain_lines.append(f"  {_earlier_note(model, r, earlier)}")
        plain_lines += [f"  {_cut(line[TEXT])}" for line in lines]

    folds = fold_lines(model.all_lines, len(ranks))[-SUMMARY_FOLDS:] if many else []
    if folds:
        plain_lines.append(f"--- all ranks, last {_plural(len(folds), 'line')}, alike folded")
        plain_lines += [f"  [{rank_ranges(f.ranks)}] {_cut(f.text())}" for f in folds]

    cell = "padding:2px 10px;text-align:left;border-bottom:1px solid #e5e7eb;white-space:nowrap"
    rows = []
    for what, state, outcome in groups:
        bg, fg = STATE_COLORS[state]
        rows.append(
            f"<tr><td style='{cell};white-space:normal'>{esc(what)}</td><td style='{cell}'>"
            f"<span style='background:{bg};color:{fg};padding:1px 8px;border-radius:9px;"
            f"font-weight:600'>{state.value}</span></td><td style='{cell};white-space:normal'>"
            f"{esc(outcome)}</td></tr>"
        )
    for r in [] if many else ranks:
        bg, fg = STATE_COLORS[model.state(r)]
        rows.append(
            f"<tr><td style='{cell}'>rank {r}</td><td style='{cell}'><span style='"
            f"background:{bg};color:{fg};padding:1px 8px;border-radius:9px;font-weight:600'>"
            f"{model.state(r).value}</span></td><td style='{cell};white-space:normal'>"
            f"{esc(outcomes[r])}</td>"
            + (f"<td style='{cell}'><code>rank{r}.log</code></td>" if run_dir else "")
            + "</tr>"
        )
    title = esc(header.removeprefix("nblaunch: "))
    where = f"<div style='color:#64748b'>logs in <code>{esc(run_dir)}</code></div>"
    told = "".join(f"<div style='margin:2px 0'>{esc(story)}</div>" for story in stories)
    found = "".join(
        f"<div style='color:{SEVERITY_COLORS[kind][1]};margin:4px 0'><b>{label}:</b> "
        f"{esc(text)}</div>"
        for kind, label, texts in (("error", "error", errors), ("warning", "note", notes))
        for text in texts
    )
    pre = (
        "margin:2px 0 6px;padding:4px 8px;font-size:12px;line-height:1.4;white-space:pre-wrap;"
        "overflow-wrap:anywhere;background:#fcfcfd;border:1px solid #e2e8f0;border-radius:4px"
    )
    blocks = []
    for r, lines, earlier in tails:
        body = "".join(
            (
                f"<span style='color:#9a3412'>{to_html(_cut(line[TEXT]))}</span>"
                if line[FD] == 2
                else to_html(_cut(line[TEXT]))
            )
            + "\n"
            for line in lines
        )
        note = (
            f"<span style='color:#64748b'>{esc(_earlier_note(model, r, earlier))}</span>\n"
            if earlier
            else ""
        )
        blocks.append(
            f"<div style='color:#475569;margin-top:4px'>rank {r}, last "
            f"{_plural(len(lines), 'line')}</div><pre style='{pre}'>{note}{body}</pre>"
        )
    if folds:
        body = "".join(
            f"<b>[{rank_ranges(f.ranks)}]</b> "
            + (
                f"<span style='color:#9a3412'>{to_html(_cut(f.text()))}</span>"
                if f.fd == 2
                else to_html(_cut(f.text()))
            )
            + "\n"
            for f in folds
        )
        blocks.insert(
            0,
            f"<div style='color:#475569;margin-top:4px'>all ranks, last "
            f"{_plural(len(folds), 'line')}, alike folded</div><pre style='{pre}'>{body}</pre>",
        )
    charts = render_svg(model.metrics) if model.metrics else ""  # kept in the saved file
    if model.metrics:
        names = ", ".join(sorted(model.metrics.series))
        plain_lines.append(f"metrics: {names} (in {run_dir or 'the run'}/metrics.jsonl)")
        if model.metrics.left_out:
            plain_lines.append(f"  {model.metrics.left_out_note()}")
    html_out = (
        f"<div><b>nblaunch</b> {title}<table style='border-collapse:collapse;"
        f"margin:4px 0'>{''.join(rows)}</table>{told}{where if run_dir else ''}{found}"
        f"{charts}{''.join(blocks)}</div>"
    )
    return {"text/plain": printable("\n".join(plain_lines)), "text/html": html_out}


def _stories(model: RunModel) -> list[str]:
    """The progress lines a saved notebook keeps: the batch-size search's latest (a rank's
    "-> 8 ..." before a restart is told again, ended, by the rank that speaks for all after),
    and every other one (each rank's caught out-of-memory error, the effective batch size)."""
    latest_search = [text for (_, what), text in model.progress.items() if what == "batch_size"]
    others = [text for (_, what), text in model.progress.items() if what != "batch_size"]
    return list(dict.fromkeys(latest_search[-1:] + others))


def _groups(
    model: RunModel, ranks: list[int], outcomes: dict[int, str]
) -> list[tuple[str, RunState, str]]:
    """``(which ranks, state, outcome)`` rows for a run of many ranks: failed, stalled and
    debugging ranks one by one (the first ``NAMED_RANKS``), the others grouped by state, with
    their outcome when they share one: ("62 (0-16,18-63)", DONE, "returned"), ("rank 17",
    FAILED, "ValueError: bad batch")."""
    by_state: dict[RunState, list[int]] = {}
    for r in ranks:
        by_state.setdefault(model.state(r), []).append(r)
    rows = []
    for state, members in sorted(by_state.items(), key=lambda item: item[0] not in HOT_STATES):
        if state in HOT_STATES:
            rows += [
                (f"rank {r}", state, outcomes[r] or model.details.get(r, ""))
                for r in members[:NAMED_RANKS]
            ]
            if len(members) > NAMED_RANKS:
                rest = members[NAMED_RANKS:]
                rows.append((f"{len(rest)} more ({rank_ranges(rest)})", state, ""))
            continue
        shared = {outcomes[r] for r in members}
        if len(shared) == 1:
            outcome = shared.pop()
        elif all(o.startswith("returned") for o in shared):
            outcome = f"returned ({len(shared)} different values)"
        else:
            outcome = f"{len(shared)} different outcomes"
        rows.append((f"{len(members)} ({rank_ranges(members)})", state, outcome))
    return rows


def _tails(model: RunModel, ranks: list[int]) -> list[tuple[int, list[Line], int]]:
    """``(rank, last lines, earlier lines)`` for the summary, within its line budget."""
    with_lines = [r for r in ranks if model.rank_lines.get(r)]
    if not with_lines:
        return []
    each = max(1, min(SUMMARY_LINES, SUMMARY_TOTAL_LINES // len(with_lines)))
    tails = []
    budget = SUMMARY_TOTAL_LINES
    for r in with_lines:
        lines = list(model.rank_lines[r])[-min(each, budget) :] if budget else []
        budget -= len(lines)
        tails.append((r, lines, model.line_counts[r] - len(lines)))
    return tails


def _earlier_note(model: RunModel, rank: int, earlier: int) -> str:
    where = model.log_path(rank)
    return f"… {_plural(earlier, 'earlier line')}{' in ' + where if where else ''}"


def _outcome(model: RunModel, rank: int, outcome: str) -> str:
    """The rank's outcome, with a short form of what it returned when that is cheap."""
    value = model.results.get(rank)
    if outcome != "returned" or value is None:
        return outcome
    shown = short_repr(value)
    # None reads as nothing, as a cell that ends without a value: a pool cell's main rank
    # returns the cell's result (not shown here) and the others None, alike.
    return f"returned {shown}" if shown and shown != "None" else outcome


def short_repr(value_bytes: bytes) -> str:
    """A one-line repr of a small returned value of a plain type; "" for anything else.

    The summary does not unpickle what it cannot show in a line anyway (large values, objects
    of the user's own classes): the launcher returns those to the caller.
    """
    import pickle
    import reprlib

    if len(value_bytes) > SUMMARY_VALUE_BYTES:
        return ""
    try:
        value = pickle.loads(value_bytes)
    except Exception:
        return ""
    if type(value).__module__ not in ("builtins", "numpy", "torch"):
        return ""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 60
    try:
        text = short.repr(value) if type(value).__module__ == "builtins" else repr(value)
    except Exception:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= 120 else text[:117] + "..."


def _plural(count: int, what: str) -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def _cut(text: str) -> str:
    return text if len(text) <= SUMMARY_LINE_CHARS else text[:SUMMARY_LINE_CHARS] + " …"
