"""Where a rank stands, as the notebook reads it: source lines added, notebook cells named.

A rank's position (``"train.py:9 in train"``) and stack name files and line numbers only; the
parent adds the lines of code, which it can read (a notebook cell's lines are in the kernel's
line cache, a script's in its file), and names a notebook cell's file as IPython does.
"""

from __future__ import annotations

import linecache
import re
import sys

_WHERE = re.compile(r"^(.+):(\d+) in (.+)$")
_FILE_LINE = re.compile(r'^(\s*)File "(.+)", line (\d+), in ')


def with_source(where: str) -> str:
    """``"train.py:9 in train"`` with the line's source added when the parent can read it
    (a notebook cell's lines are in the kernel's line cache, a script's in its file)."""
    match = _WHERE.match(where)
    if not match:
        return where
    source = linecache.getline(match.group(1), int(match.group(2))).strip()
    return f"{where}: `{source}`" if source else where


def cell_names(text: str) -> str:
    """Show the notebook's cell files as IPython does ("Cell In[5]") instead of their temp paths.

    Functions defined in a notebook cell carry a file name like ``/tmp/ipykernel_1/123.py``;
    the kernel running this launch knows which cell each such file holds.
    """
    ipython = sys.modules.get("IPython")  # never imported here: the engine runs without it
    shell = ipython.get_ipython() if ipython is not None else None
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not names:
        return text
    shown = [name for name in names if isinstance(name, str) and name in text]
    if shown:
        text = _add_cell_source(text, set(shown))
    for filename in shown:
        text = text.replace(filename, f"Cell In[{names[filename]}]")
    return text


def _add_cell_source(stack: str, cells: set[str]) -> str:
    """Put the source line under each frame of a notebook cell: the rank had no copy of the
    cell's text, the kernel's line cache has it."""
    lines = stack.split("\n")
    out = []
    for index, line in enumerate(lines):
        out.append(line)
        match = _FILE_LINE.match(line)
        if not match or match.group(2) not in cells:
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if following.startswith(match.group(1) + "  ") and not _FILE_LINE.match(following):
            continue  # the source line is already there
        source = linecache.getline(match.group(2), int(match.group(3))).strip()
        if source:
            out.append(f"{match.group(1)}  {source}")
    return "\n".join(out)
