"""Print the version matrix's table (docs/versions.md) from the results nox wrote.

    python scripts/matrix_table.py [.nox/matrix.tsv ...]

Rows are Python x build, columns the torch versions of noxfile.py (and any other a result
names). A cell shows its latest
result: ``passed``, ``failed`` (with how many tests failed), ``no wheel here`` (nox could not
install that torch build: no such wheel, or its index unreachable) or ``not run`` (no result);
the details follow the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from noxfile import BUILDS, NO_WHEEL, PYTHONS, RESULTS, TORCHES

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


def shown(result: list[str] | None) -> str:
    """A cell's word: its result, or "no wheel here" when its torch could not be installed."""
    if result is None:
        return "not run"
    if result[0] == "not run" and result[1].startswith(NO_WHEEL):
        return "no wheel here"
    return result[0]


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
                row.append(shown(cells.get((python, torch, build))))
            lines.append(f"| {python} | {BUILD_NAMES[build]} | " + " | ".join(row) + " |")
    details = [
        f"- {python}, torch {torch}, {build}: {result}: {detail} ({minutes} min, {day})"
        for (python, torch, build), (result, detail, minutes, day) in sorted(cells.items())
        if shown([result, detail]) != "no wheel here"
    ]
    missing = sorted(
        f"{python} {torch} {build}"
        for (python, torch, build), result in cells.items()
        if shown(result) == "no wheel here"
    )
    if missing:  # one line for them all: each says the same
        details.append(f"- no wheel here (pip could not install that torch): {', '.join(missing)}")
    return "\n".join([*lines, "", *details]) + "\n"


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or [RESULTS]
    print(table(latest([p for p in paths if p.exists()])), end="")
