"""The live view at 8 to 64 ranks: what it costs the kernel as the ranks multiply.

Run: ``.venv/bin/python benchmarks/bench_views.py`` (about two minutes on 2 cores; 64 CPU
ranks is heavy there). ``--ranks 8,16`` measures only those; the table is printed and written
to ``benchmarks/results/bench_views.md`` (``--out PATH`` elsewhere, ``--out -`` nowhere).

Each rank count runs in a fresh Python process (this file with ``--scenario N``), with torch
imported first, as in a notebook, and ``NBLAUNCH_MAX_PROCESSES=N`` to oversubscribe the cores.
Every rank runs the loop a new user writes: a tiny model, ``STEPS`` steps of an all_reduce of
its gradient (DDP's work), a tqdm bar, and a print every ``PRINT_EVERY`` steps
(``epoch 0 step 40 loss 0.41``). The launch's view is the notebook's ``LaunchView`` (widgets
made, not displayed: no browser), wrapped to clock it; the seam is ``choose.make_view``.

Columns, per rank count (the per-rank columns divide by the ranks):

- lines: finished lines the relay handed the view (stream events not ended by ``\\r``);
- relay lines/s: those lines over the time from the first to the last line the view got;
- widget messages/s: widget updates sent (``LaunchView.messages_sent``) over the run's time
  from the view's first event to its ``close``;
- view CPU: the launching thread's CPU time spent inside the view's ``handle``, ``flush`` and
  ``close`` (``time.thread_time``), in ms, and per 1,000 lines;
- All ranks: the lines the "All ranks" tab showed at the end, as folded lines / kept lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_views.md"
DEFAULT_RANKS = (8, 16, 32, 64)
STEPS = 60
PRINT_EVERY = 20
RESULT_PREFIX = "BENCH-VIEWS "
SCENARIO_LIMIT_S = 600.0


def train(steps: int, print_every: int) -> int:
    """A new user's loop: an all_reduce per step, a tqdm bar, a print every few steps."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(16, 1)
    for step in tqdm(range(steps), mininterval=0.5):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= world
        if step % print_every == 0:
            print(f"epoch 0 step {step} loss {loss.item():.2f} lr 0.05")
    return rank


class ClockedView:
    """A view that hands every call on and adds up the launching thread's CPU time in it."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.cpu_s = 0.0
        self.lines = 0
        self.first = self.last = self.opened = self.closed = 0.0

    def handle(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        self.opened = self.opened or now
        if event["kind"] == "stream" and not event["carriage"]:
            self.lines += 1
            self.first = self.first or now
            self.last = now
        started = time.thread_time()
        self.view.handle(event)
        self.cpu_s += time.thread_time() - started

    def flush(self, force: bool = False) -> None:
        started = time.thread_time()
        self.view.flush(force)
        self.cpu_s += time.thread_time() - started

    def close(self) -> None:
        started = time.thread_time()
        self.view.close()
        self.cpu_s += time.thread_time() - started
        self.closed = time.monotonic()


def scenario(ranks: int) -> dict[str, Any]:
    """One launch of ``train`` on ``ranks`` CPU ranks under a clocked ``LaunchView``."""
    import torch  # noqa: F401  (a notebook has it imported before the launch)

    import nblaunch
    from nblaunch.notebook.views import LaunchView, choose, fold, widget

    widget._display = lambda *args, **kwargs: None  # no frontend: build, do not show
    clocked: list[ClockedView] = []

    def make_view(display: str) -> ClockedView:
        clocked.append(ClockedView(LaunchView()))
        return clocked[-1]

    choose.make_view = make_view
    started = time.monotonic()
    result = nblaunch.notebook_launcher(
        train, (STEPS, PRINT_EVERY), ranks, device_type="cpu", display="widget"
    )
    wall = time.monotonic() - started
    assert result == list(range(ranks)), result
    view = clocked[0]
    model = view.view.model
    shown = len(fold.fold_lines(model.all_lines, ranks))
    return {
        "ranks": ranks,
        "wall_s": wall,
        "lines": view.lines,
        "relay_lines_per_s": view.lines / max(view.last - view.first, 1e-9),
        "messages": view.view.messages_sent,
        "messages_per_s": view.view.messages_sent / max(view.closed - view.opened, 1e-9),
        "view_cpu_ms": view.cpu_s * 1000,
        "all_ranks_shown": shown,
        "all_ranks_kept": len(model.all_lines),
    }


def run_scenario(ranks: int) -> dict[str, Any]:
    env = dict(os.environ, NBLAUNCH_MAX_PROCESSES=str(ranks), NBLAUNCH_SPARE_RANKS="0")
    done = subprocess.run(
        [sys.executable, __file__, "--scenario", str(ranks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=SCENARIO_LIMIT_S,
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    raise RuntimeError(f"{ranks} ranks: no result\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| ranks | run s | lines | relay lines/s | per rank | widget msgs/s | per rank "
        "| view CPU ms | per 1k lines | All ranks shown/kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["ranks"]
        out.append(
            f"| {n} | {r['wall_s']:.1f} | {r['lines']} | {r['relay_lines_per_s']:.0f} "
            f"| {r['relay_lines_per_s'] / n:.1f} | {r['messages_per_s']:.1f} "
            f"| {r['messages_per_s'] / n:.2f} | {r['view_cpu_ms']:.0f} "
            f"| {r['view_cpu_ms'] / max(r['lines'], 1) * 1000:.0f} "
            f"| {r['all_ranks_shown']}/{r['all_ranks_kept']} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--scenario", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        print(RESULT_PREFIX + json.dumps(scenario(args.scenario)), flush=True)
        return
    rows = [run_scenario(int(n)) for n in args.ranks.split(",")]
    text = (
        f"{os.cpu_count()} cores; {STEPS} steps a rank, a print every {PRINT_EVERY}, a tqdm "
        f"bar (mininterval 0.5 s), an all_reduce per step.\n\n{table(rows)}\n"
    )
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
