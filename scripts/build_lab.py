"""Build the JupyterLab extension (the runs panel) into the Python package, and stamp it.

Used by ``make lab-build`` (a developer step: it needs Node.js and the npm registry)::

    python scripts/build_lab.py           # npm ci, tsc, the labextension build, the stamp
    python scripts/build_lab.py --check   # exit 1 when the shipped build is not the sources'

The build goes to ``nblaunch/lab/labextension/`` and is committed, so that ``pip install``
needs no Node.js. ``sources.sha256`` there is the hash of the sources it was built from
(:func:`sources_hash`); ``tests/test_lab.py`` compares it with the sources in the checkout.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "labextension"
BUILT = ROOT / "nblaunch" / "lab" / "labextension"
STAMP = BUILT / "sources.sha256"
# What the build is made from: the TypeScript, the style and the two files that configure it.
SOURCE_GLOBS = ("package.json", "package-lock.json", "tsconfig.json", "src/**/*", "style/**/*")


def sources_hash(folder: Path = SOURCES) -> str:
    """The sha256 of every source file's path and bytes, in sorted order."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in SOURCE_GLOBS for p in folder.glob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def build() -> None:
    import jupyterlab

    core = Path(jupyterlab.__file__).parent / "staging"  # the Lab the extension is built against
    builder = SOURCES / "node_modules" / "@jupyterlab" / "builder" / "lib" / "build-labextension.js"
    shutil.rmtree(BUILT, ignore_errors=True)  # no chunk of an older build stays behind
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SOURCES, check=True)
    subprocess.run(["npx", "tsc"], cwd=SOURCES, check=True)
    subprocess.run(["node", str(builder), "--core-path", str(core), "."], cwd=SOURCES, check=True)
    STAMP.write_text(sources_hash() + "\n")
    print(f"built {BUILT.relative_to(ROOT)}; commit it with its sources")


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        shipped = STAMP.read_text().strip() if STAMP.exists() else "(none)"
        if shipped != sources_hash():
            print(f"{BUILT} was not built from labextension/ as it is: run make lab-build")
            return 1
        return 0
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
