"""The live view's HTML, rendered from a :class:`~nblaunch.notebook.views.model.RunModel`.

Pure functions from the model to HTML strings: no widgets, no clock (the elapsed time is passed
in), so the markup the browser gets is tested by calling them. The widget puts each part in its
own ipywidgets ``HTML`` and sends only the parts that changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nblaunch.events import RunState, after_restarts, checking_mode
from nblaunch.notebook.charts import render_svg
from nblaunch.notebook.views.ansi import esc, strip_to_html, to_html
from nblaunch.notebook.views.fold import fold_lines, rank_ranges
from nblaunch.notebook.views.model import FD, TEXT, Line, RunModel

# Calm colours: a soft background and a dark foreground per state.
STATE_COLORS: dict[RunState, tuple[str, str]] = {
    RunState.STARTING: ("#f1f5f9", "#475569"),
    RunState.RUNNING: ("#e0f2fe", "#075985"),
    RunState.RETRYING: ("#fef3c7", "#92400e"),
    RunState.STALLED: ("#ffedd5", "#9a3412"),
    RunState.DEBUGGING: ("#ede9fe", "#5b21b6"),
    RunState.FAILED: ("#fee2e2", "#991b1b"),
    RunState.DONE: ("#dcfce7", "#166534"),
    RunState.STOPPED: ("#e5e7eb", "#374151"),
}
# Past this many ranks, a grid of badges replaces the rows, and a rank picker the rank tabs.
GRID_AFTER = 8
# States that stand out in the grid: outlined, and named in its counts.
HOT_STATES = (RunState.FAILED, RunState.STALLED, RunState.DEBUGGING)
# Rank tags in the "All ranks" log, repeated past eight ranks.
RANK_COLORS = (
    "#2563eb",
    "#c2410c",
    "#15803d",
    "#7c3aed",
    "#0e7490",
    "#be185d",
    "#4d7c0f",
    "#b45309",
)
SEVERITY_COLORS = {"error": ("#fef2f2", "#b91c1c"), "warning": ("#fffbeb", "#b45309")}
SEVERITY_COLORS["info"] = ("#f0f9ff", "#0369a1")

CSS = """<style>
.nbl-root{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px}
.nbl-head{color:#334155;line-height:1.6}
.nbl-head b{color:#0f172a}
.nbl-dim{color:#64748b}
.nbl-warn{color:#b45309}
.nbl-ranks{display:flex;flex-direction:column;gap:3px;margin:2px 0}
.nbl-rank{display:flex;align-items:center;gap:8px;min-width:0}
.nbl-badge{display:inline-block;min-width:8.5em;padding:1px 8px;border-radius:9px;
  font-size:12px;font-weight:600;white-space:nowrap}
.nbl-last{font-family:var(--jp-code-font-family,monospace);font-size:12px;color:#334155;
  overflow:hidden;text-overflow:ellipsis;white-space:nowrap;flex:1;min-width:0}
.nbl-bar{display:inline-block;width:60px;height:6px;background:#fcd34d;border-radius:3px;
  overflow:hidden;vertical-align:middle}
.nbl-bar span{display:block;height:100%;background:#38bdf8}
.nbl-meter{font-size:11px;color:#64748b;white-space:nowrap}
.nbl-pbar{display:inline-block;width:140px;height:8px;background:#e2e8f0;border-radius:4px;
  overflow:hidden;vertical-align:middle}
.nbl-pbar span{display:block;height:100%;background:#2563eb}
.nbl-log{max-height:24em;overflow-y:auto;display:flex;flex-direction:column-reverse;
  border:1px solid #e2e8f0;border-radius:4px;background:#fcfcfd}
.nbl-log pre{flex:none;overflow:visible;margin:0;padding:6px 8px;font-size:12px;
  line-height:1.4;white-space:pre-wrap;overflow-wrap:anywhere;font-family:var(--jp-code-font-family,monospace);color:#1e293b}
.nbl-err{color:#9a3412}
.nbl-tag{font-weight:600}
.nbl-diag{border-left:4px solid;border-radius:3px;padding:6px 10px;margin:4px 0}
.nbl-diag pre{margin:4px 0 0;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere;
  max-height:20em;overflow-y:auto;font-family:var(--jp-code-font-family,monospace)}
.nbl-title{font-weight:600}
.nbl-diag details{margin-top:4px;color:#475569}
.nbl-grid{display:flex;flex-wrap:wrap;gap:3px;margin:3px 0;max-width:60em}
.nbl-cell{display:inline-block;min-width:2.4em;text-align:center;padding:1px 0;border-radius:4px;
  font-size:11px;font-weight:600;font-family:var(--jp-code-font-family,monospace);cursor:default}
.nbl-hot{outline:2px solid currentColor;outline-offset:-2px}
.nbl-progress{padding:4px 10px;border-left:4px solid #f59e0b;background:#fffbeb;margin:4px 0}
</style>"""


def head_html(model: RunModel, elapsed_s: float) -> str:
    """The header: ranks, device, start method, checks, time, run directory, notes, warnings.

    ``elapsed_s`` is shown while the run goes on; once it ended, its own time is.
    """
    info = model.info or {}
    world = info.get("world_size", 0)
    parts = [
        f"<b>{world} rank{'s' if world != 1 else ''}</b>",
        esc(info.get("device_kind", "")),
        esc(info.get("start_method", "")),
        checking_mode(info),
    ]
    if model.ended is not None:
        ended = model.ended
        parts.append(f"<b>{model.outcome_word()}</b> in {ended['elapsed_s']:.1f} s")
        parts[-1] += after_restarts(ended)
    else:
        parts.append(f"{elapsed_s:.0f} s")
    out = "<div class='nbl-head'>nblaunch · " + " · ".join(parts)
    if info.get("run_dir"):
        out += f"<br><span class='nbl-dim'>logs: {esc(info['run_dir'])}</span>"
    for note in info.get("notes", ()):
        out += f"<br><span class='nbl-dim'>{esc(note)}</span>"
    for warning in info.get("warnings", ()):
        out += f"<br><span class='nbl-warn'>⚠ {esc(warning)}</span>"
    return out + "</div>"


def ranks_html(model: RunModel) -> str:
    """One row per rank: its state badge, device, last line or tqdm bar, and compute share;
    past ``GRID_AFTER`` ranks, a grid of badges instead (:func:`grid_html`).

    With more than one rank drawing a bar, an "all ranks" row first shows the slowest.
    """
    if len(model.states) > GRID_AFTER:
        return grid_html(model)
    rows = []
    bars = []  # the tqdm bars ranks draw now
    for rank in sorted(model.states):
        state = model.states[rank]
        bg, fg = STATE_COLORS[state]
        detail = model.details.get(rank, "")
        if state in (RunState.FAILED, RunState.STALLED, RunState.RETRYING, RunState.STOPPED):
            last = detail or model.last_line(rank)
        else:
            last = model.last_line(rank) or detail
        device = model.devices.get(rank, "")
        row = (
            f"<div class='nbl-rank'><span class='nbl-badge' style='background:{bg};"
            f"color:{fg}'>rank {rank} · {state.value}</span>"
        )
        if device:
            row += f"<span class='nbl-dim'>{esc(device)}</span>"
        bar = model.progress_bar(rank)
        if bar is not None:  # a tqdm bar: drawn as a bar, with its count, rate and ETA
            bars.append(bar)
            row += bar_html(*bar)
        else:
            preview = strip_to_html(last[:500])
            row += f"<span class='nbl-last' title='{preview}'>{preview}</span>"
        beat = model.heartbeats.get(rank)
        if beat is not None:
            wait, busy, collective = beat
            share = min(1.0, max(0.0, (busy - wait) / busy))
            inside = f" · in {esc(collective)}" if collective else ""
            row += (
                f"<span class='nbl-meter'><span class='nbl-bar'><span style='width:"
                f"{share * 100:.0f}%'></span></span> compute {share:.0%} · wait "
                f"{1 - share:.0%}{inside}</span>"
            )
        rows.append(row + "</div>")
    if len(bars) > 1:  # all ranks: as far as the slowest
        slowest = min(bars, key=lambda bar: bar[0])
        rows.insert(
            0,
            "<div class='nbl-rank'><span class='nbl-badge' style='background:#f1f5f9;"
            f"color:#334155'>all ranks</span>{bar_html(*slowest)}</div>",
        )
    return "<div class='nbl-ranks'>" + "".join(rows) + "</div>"


def grid_html(model: RunModel) -> str:
    """Many ranks at a glance: the ranks counted by state (the failed and stalled ones named),
    the slowest progress bar, and a badge per rank coloured by state; hovering a badge shows
    the rank's state, device and last line. Failed, stalled and debugging ranks are outlined."""
    counts: dict[RunState, list[int]] = {}
    cells = []
    bars = []
    for rank in sorted(model.states):
        state = model.states[rank]
        counts.setdefault(state, []).append(rank)
        bg, fg = STATE_COLORS[state]
        last = model.details.get(rank, "") or model.last_line(rank)
        bar = model.progress_bar(rank)
        if bar is not None:
            bars.append(bar)
            last = f"{bar[0]:.0%} · {bar[1]}"
        device = model.devices.get(rank, "")
        title = f"rank {rank} · {state.value}{' · ' + device if device else ''}\n{last[:300]}"
        hot = " nbl-hot" if state in HOT_STATES else ""
        cells.append(
            f"<span class='nbl-cell{hot}' style='background:{bg};color:{fg}' "
            f"title='{strip_to_html(title)}'>{rank}</span>"
        )
    summary = " · ".join(
        f"<b>{len(ranks)} {state.value}</b>"
        + (f" ({_named(ranks)})" if state in HOT_STATES else "")
        for state, ranks in sorted(counts.items(), key=lambda item: -len(item[1]))
    )
    out = f"<div class='nbl-head'>{summary}</div>"
    if len(bars) > 1:
        out += f"<div>all ranks {bar_html(*min(bars, key=lambda bar: bar[0]))}</div>"
    return out + f"<div class='nbl-grid'>{''.join(cells)}</div>"


def _named(ranks: list[int]) -> str:
    """Ranks named, the first few: "rank 17", "ranks 3, 9, 12 and 4 more"."""
    shown = ", ".join(str(r) for r in ranks[:5])
    more = f" and {len(ranks) - 5} more" if len(ranks) > 5 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def bar_html(fraction: float, text: str) -> str:
    """A progress bar filled to ``fraction``, with its percentage and ``text``."""
    return (
        f"<span class='nbl-meter'><span class='nbl-pbar'><span style='width:"
        f"{min(1.0, max(0.0, fraction)) * 100:.0f}%'></span></span> {fraction:.0%} · "
        f"{esc(text)}</span>"
    )


def panel_html(model: RunModel) -> str:
    """The diagnoses: the first error as the root cause, later ones folded under it."""
    errors = [d for d in model.diagnoses if d["severity"] == "error"]
    others = [d for d in model.diagnoses if d["severity"] != "error"]
    blocks = []
    if errors:
        root, *later = errors
        secondary = list(root["secondary"]) + [d["title"] for d in later]
        blocks.append(diagnosis_html(root, secondary))
    blocks += [diagnosis_html(d, d["secondary"]) for d in others]
    return "".join(blocks)


def diagnosis_html(diagnosis: dict[str, Any], secondary: list[str]) -> str:
    """One finding: its title, its body when that says more, and ``secondary`` folded."""
    bg, fg = SEVERITY_COLORS.get(diagnosis["severity"], SEVERITY_COLORS["info"])
    icon = {"error": "⛔", "warning": "⚠"}.get(diagnosis["severity"], "ℹ")
    out = (
        f"<div class='nbl-diag' style='background:{bg};border-color:{fg}'>"
        f"<div class='nbl-title' style='color:{fg}'>{icon} {esc(diagnosis['title'])}</div>"
    )
    if diagnosis["body"] and diagnosis["body"] != diagnosis["title"]:
        out += f"<pre>{to_html(diagnosis['body'])}</pre>"
    if secondary:
        items = "".join(f"<li>{esc(line)}</li>" for line in secondary)
        count = len(secondary)
        out += (
            f"<details><summary>{count} other failure{'s' if count != 1 else ''}"
            f" (consequences)</summary><ul>{items}</ul></details>"
        )
    return out + "</div>"


def progress_html(model: RunModel) -> str:
    """Multi-attempt operations (out-of-memory retries), one line per rank and operation."""
    if not model.progress:
        return ""
    rows = [
        f"<div><b>rank {rank}</b> · {esc(what)}: {esc(text)}</div>"
        for (rank, what), text in sorted(model.progress.items())
    ]
    return "<div class='nbl-progress'>" + "".join(rows) + "</div>"


def charts_html(model: RunModel) -> str:
    """The metric charts, or "" before any metric arrived."""
    return render_svg(model.metrics) if model.metrics else ""


def log_html(model: RunModel, rank: int | None, max_line_chars: int) -> str:
    """A log tab: the rank's kept lines, or every rank's, alike lines folded and tagged with
    their ranks (``[0-7] ...``; see :mod:`~nblaunch.notebook.views.fold`), when ``rank`` is None.

    A rank's tab starts with how many earlier lines its log file holds; lines longer than
    ``max_line_chars`` are cut, with a note.
    """
    parts = []
    if rank is None:
        world = (model.info or {}).get("world_size", 0)
        for fold in fold_lines(model.all_lines, world):
            ranks = fold.ranks
            color = RANK_COLORS[ranks[0] % len(RANK_COLORS)] if len(ranks) == 1 else "#334155"
            text = fold.text()
            exact = f" title='{esc(fold.exact())}'" if text != fold.lines[0][TEXT] else ""
            tag = f"<span class='nbl-tag' style='color:{color}'{exact}>[{rank_ranges(ranks)}]"
            parts.append(f"{tag}</span> {_line_html(text, fold.fd, max_line_chars)}\n")
        return f"<div class='nbl-log'><pre>{''.join(parts)}</pre></div>"
    lines: Sequence[Line] = model.rank_lines.get(rank, ())
    if model.line_counts[rank] > len(lines):
        earlier = model.line_counts[rank] - len(lines)
        where = model.log_path(rank)
        parts.append(
            f"<span class='nbl-dim'>… {earlier} earlier line{'s' if earlier != 1 else ''}"
            f"{' in ' + esc(where) if where else ''}</span>\n"
        )
    parts += [_line_html(line[TEXT], line[FD], max_line_chars) + "\n" for line in lines]
    return f"<div class='nbl-log'><pre>{''.join(parts)}</pre></div>"


def _line_html(text: str, fd: int, max_line_chars: int) -> str:
    """One line of a log: stderr's in its colour, cut past ``max_line_chars`` with a note."""
    cut = ""
    if len(text) > max_line_chars:
        cut = f"<span class='nbl-dim'> … ({len(text) - max_line_chars} more characters)</span>"
        text = text[:max_line_chars]
    body = to_html(text)
    return (f"<span class='nbl-err'>{body}</span>" if fd == 2 else body) + cut
