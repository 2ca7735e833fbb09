"""Metric charts in the notebook: the series the view keeps and their SVG pictures.

Charts are plain SVG made here: no chart library, no front-end extension, so they render the
same in JupyterLab, Notebook 7 and VS Code, and in the saved file.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping
from typing import Any

# Derived in the notebook from each rank's steps and their times.
THROUGHPUT = "steps/s"
THROUGHPUT_WINDOW_S = 0.5  # a throughput point covers at least this long
# Points kept per (metric, rank) in the view; longer series are thinned, keeping both ends.
MAX_POINTS = 400
CHART_WIDTH, CHART_HEIGHT = 260, 120
# Past this many ranks a chart shows the mean with a min-max band instead of a line per rank.
MAX_RANK_LINES = 4
RANK_COLORS = ("#2563eb", "#c2410c", "#15803d", "#7c3aed", "#0e7490", "#be185d", "#4d7c0f")
# Metric names the view charts; later names are only counted (metrics.jsonl keeps every one), so
# the notebook's memory stays bounded whatever a run logs (100k names in one call cost ~214 MB).
MAX_SERIES = 32
# Names left out that are remembered, to count them; past this the count says "or more".
MAX_LEFT_OUT_NAMES = 10_000


class MetricSeries:
    """What the view keeps of the metrics: per name and rank, at most ``MAX_POINTS`` points."""

    def __init__(self, max_points: int = MAX_POINTS, max_series: int = MAX_SERIES) -> None:
        self.max_points = max_points
        self.max_series = max_series
        self.series: dict[str, dict[int, list[tuple[float, float]]]] = {}
        self.left_out: set[str] = set()  # names past max_series (at most MAX_LEFT_OUT_NAMES)
        self._since: dict[int, tuple[int, float]] = {}  # rank -> (step, time) of its last rate

    def add(self, event: Mapping[str, Any]) -> None:
        rank, step = event["rank"], event["step"]
        for name, value in event["values"].items():
            self._append(name, rank, step, value)
        when = event.get("time")
        if when is None:
            return
        since = self._since.setdefault(rank, (step, when))
        if step > since[0] and when - since[1] >= THROUGHPUT_WINDOW_S:  # steps per second
            self._append(THROUGHPUT, rank, step, (step - since[0]) / (when - since[1]))
            self._since[rank] = (step, when)

    def _append(self, name: str, rank: int, step: int, value: float) -> None:
        if name not in self.series and len(self.series) >= self.max_series and name != THROUGHPUT:
            if len(self.left_out) < MAX_LEFT_OUT_NAMES:
                self.left_out.add(name)
            return
        points = self.series.setdefault(name, {}).setdefault(rank, [])
        points.append((float(step), value))
        if len(points) > self.max_points:
            points[:] = _thin(points, self.max_points // 2)

    def __bool__(self) -> bool:
        return bool(self.series)

    def left_out_note(self) -> str:
        """``"1,234 other metric names are not charted (every value is in metrics.jsonl)"``."""
        if not self.left_out:
            return ""
        count = f"{len(self.left_out):,}" + (
            " or more" if len(self.left_out) >= MAX_LEFT_OUT_NAMES else ""
        )
        return f"{count} other metric names are not charted (every value is in metrics.jsonl)"


def _thin(points: list[tuple[float, float]], keep: int) -> list[tuple[float, float]]:
    """Every other point of the older part, the newest ``keep`` untouched: both ends stay."""
    old, recent = points[:-keep], points[-keep:]
    return [*old[::2], *recent]


def render_svg(series: MetricSeries, width: int = CHART_WIDTH, height: int = CHART_HEIGHT) -> str:
    """One small line chart per metric, one line per rank, with a legend; HTML with inline SVG."""
    charts = [
        _chart(name, by_rank, width, height) for name, by_rank in sorted(series.series.items())
    ]
    ranks = sorted({rank for by_rank in series.series.values() for rank in by_rank})
    if len(ranks) > MAX_RANK_LINES:
        legend = f"mean of {len(ranks)} ranks, band from the lowest to the highest rank"
    else:
        legend = " ".join(
            f"<span style='color:{_color(rank)}'>&#9632; rank {rank}</span>" for rank in ranks
        )
    note = series.left_out_note()
    legend += f"; {html.escape(note)}" if note else ""
    return (
        "<div class='nbl-charts' style='display:flex;flex-wrap:wrap;gap:8px;margin:4px 0'>"
        + "".join(charts)
        + f"</div><div class='nbl-dim' style='font-size:11px'>{legend}</div>"
    )


def _chart(name: str, by_rank: Mapping[int, list[tuple[float, float]]], width: int, height: int):
    finite = [(x, y) for points in by_rank.values() for x, y in points if math.isfinite(y)]
    pad_left, pad, top = 44, 6, 16
    plot_w, plot_h = width - pad_left - pad, height - top - 16
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' style='background:#fcfcfd;border:1px solid #e2e8f0;"
        "border-radius:4px'>",
        f"<text x='{pad_left}' y='11' font-size='11' font-family='sans-serif' fill='#334155'>"
        f"{html.escape(name)}</text>",
    ]
    if finite:
        xs, ys = [x for x, _ in finite], [y for _, y in finite]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if y1 == y0:
            y0, y1 = y0 - 0.5, y1 + 0.5
        x1 = x1 if x1 > x0 else x0 + 1

        def scale(x: float, y: float) -> str:
            px = pad_left + (x - x0) / (x1 - x0) * plot_w
            py = top + (1 - (y - y0) / (y1 - y0)) * plot_h
            return f"{px:.1f},{py:.1f}"

        for label, y in ((_short(y1), top + 4), (_short(y0), top + plot_h)):
            parts.append(
                f"<text x='{pad_left - 4}' y='{y}' font-size='9' text-anchor='end' "
                f"font-family='sans-serif' fill='#64748b'>{label}</text>"
            )
        parts.append(
            f"<text x='{width - pad}' y='{height - 3}' font-size='9' text-anchor='end' "
            f"font-family='sans-serif' fill='#64748b'>step {_short(x1)}</text>"
        )
        if len(by_rank) > MAX_RANK_LINES:
            low, mean, high = _band(by_rank)
            outline = [scale(x, y) for x, y in low] + [scale(x, y) for x, y in reversed(high)]
            parts.append(f"<polygon fill='#bfdbfe' stroke='none' points='{' '.join(outline)}'/>")
            drawn = " ".join(scale(x, y) for x, y in mean)
            parts.append(
                f"<polyline fill='none' stroke='#1d4ed8' stroke-width='1.5' points='{drawn}'/>"
            )
        for rank, points in sorted(by_rank.items()) if len(by_rank) <= MAX_RANK_LINES else ():
            drawn = " ".join(scale(x, y) for x, y in points if math.isfinite(y))
            if drawn:
                parts.append(
                    f"<polyline fill='none' stroke='{_color(rank)}' stroke-width='1.5' "
                    f"points='{drawn}'/>"
                )
    parts.append("</svg>")
    return "".join(parts)


def _band(by_rank: Mapping[int, list[tuple[float, float]]]) -> tuple[list, list, list]:
    """Per step seen by any rank: the lowest, mean and highest value over the ranks."""
    at: dict[float, list[float]] = {}
    for points in by_rank.values():
        for x, y in points:
            if math.isfinite(y):
                at.setdefault(x, []).append(y)
    steps = sorted(at)
    low = [(x, min(at[x])) for x in steps]
    mean = [(x, sum(at[x]) / len(at[x])) for x in steps]
    high = [(x, max(at[x])) for x in steps]
    return low, mean, high


def _short(value: float) -> str:
    return f"{value:.4g}"


def _color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def series_from(events: Iterable[Mapping[str, Any]]) -> MetricSeries:
    """The series of a list of ``metrics`` events (tests, saved runs)."""
    series = MetricSeries()
    for event in events:
        series.add(event)
    return series
