"""Print the version matrix's table (docs/versions.md) from the results nox wrote.

    python scripts/matrix_table.py [.nox/matrix.tsv ...]

Rows are Python x build, columns the torch versions of noxfile.py (and any other a result
names). A cell shows its latest
result: ``passed``, ``failed`` (with how many tests failed) or ``not run`` (no result, or no
wheel reachable), and the details follow the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from noxfile import BUILDS, PYTHONS, RESULTS, TORCHES

BUILD_NAMES = {"cpu": "CPU build", "cuda": "CUDA build, no GPU"}


def latest(paths: list[Path]) -> dict[tuple[str, str, str], list[str]]:
    """(python, torch, build) -> [result, detail, minutes, date] of its last run."""
    cells: dict[tuple[str, str, str], list[str]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            python, torch, build, *rest = line.split("\t")
            cells[(python, torch, build)] = rest
    return cells


def table(cells: dict[tuple[str, str, str], list[str]]) -> str:
    # noxfile's torches, and any other a result names (an older floor that failed)
    torches = sorted(
        set(TORCHES) | {torch for _, torch, _ in cells},
        key=lambda v: tuple(int(p) for p in v.split(".")),
    )
    lines = [
        "| Python | build | " + " | ".join(f"torch {t}" for t in torches) + " |",
        "|---|---|" + "---|" * len(torches),
    ]
    for python in PYTHONS:
        for build in BUILDS:
            row = []
            for torch in torches:
                result = cells.get((python, torch, build))
                row.append("not run" if result is None else result[0])
            lines.append(f"| {python} | {BUILD_NAMES[build]} | " + " | ".join(row) + " |")
    details = [
        f"- {python}, torch {torch}, {build}: {result}: {detail} ({minutes} min, {day})"
        for (python, torch, build), (result, detail, minutes, day) in sorted(cells.items())
    ]
    return "\n".join([*lines, "", *details]) + "\n"


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or [RESULTS]
    print(table(latest([p for p in paths if p.exists()])), end="")
