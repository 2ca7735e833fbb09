"""The version matrix: the fast tests on each Python x torch x build that nblaunch supports.

``make test-matrix`` (or ``nox``) runs every cell; one cell alone::

    nox -s "tests-3.13(2.13.0-cuda)"
    nox -s "tests-3.11(2.13.0-cpu)" -- tests/test_magics.py     # other pytest arguments

Each cell is a fresh venv with one torch build, installed before nblaunch so that nothing pulls
another: ``cpu`` is the CPU build (PyTorch's CPU index, or a local wheel in ``$PIP_FIND_LINKS``),
``cuda`` is PyPI's Linux wheel, the CUDA build that ``pip install torch`` gives, run here on a
machine without GPUs. A cell whose wheel cannot be had (no such wheel for that Python, or the
index is unreachable) is skipped and says why. Each result goes to ``.nox/matrix.tsv``;
``python scripts/matrix_table.py`` prints the table docs/versions.md shows.

A CUDA build's venv is about 5 GB, so a cell's venv is removed when it ends unless
``NBLAUNCH_MATRIX_KEEP_VENVS=1``; pip's cache keeps the wheels for the next run.
"""

from __future__ import annotations

import datetime
import glob
import os
import shutil
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# The declared floor (pyproject.toml; 2.2 and 2.5 failed, see docs/versions.md), the one
# notebook platforms shipped in 2025 (2.9; not checked against Colab or Kaggle today, which
# this machine cannot reach), the one `make test` installs, and the newest this machine's pip
# may install (/etc/xdg/pip caps it).
TORCHES = ["2.8.0", "2.9.1", "2.13.0", "2.14.1"]
BUILDS = ["cpu", "cuda"]
# The fast tests in PYTEST_WORKERS processes, a test file to each, as `make test` runs them (the
# Makefile exports it; 0: in one process).
WORKERS = os.environ.get("PYTEST_WORKERS", "2")
PARALLEL = ["-n", WORKERS, "--dist", "loadfile", "--no-loadscope-reorder"]
FAST = ["-m", "not browser and not slow", *PARALLEL]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
RESULTS = Path(".nox/matrix.tsv")
NO_WHEEL = "no torch"  # how a cell's detail starts when its torch would not install
PARTIAL_RESULTS = Path(".nox/matrix-partial.tsv")  # runs given other pytest arguments

nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = False
# pyenv's Pythons, where nox looks for python3.X, when they are not on PATH already.
_pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
os.environ["PATH"] = os.pathsep.join(
    [*sorted(glob.glob(f"{_pyenv}/versions/3.1[0-9]*/bin")), os.environ.get("PATH", "")]
)


@nox.session(python=PYTHONS)
@nox.parametrize(
    "torch,build",
    [nox.param(t, b, id=f"{t}-{b}") for t in TORCHES for b in BUILDS],
)
def tests(session: nox.Session, torch: str, build: str) -> None:
    """The fast tests on one Python x torch x build."""
    try:
        _run_cell(session, torch, build)
    finally:
        _remove_venv(session)


def _run_cell(session: nox.Session, torch: str, build: str) -> None:
    started = time.monotonic()
    cell = (str(session.python), torch, build)
    results = PARTIAL_RESULTS if session.posargs else RESULTS
    try:
        _install_torch(session, torch, build)
    except nox.command.CommandFailed:
        _record(results, cell, "not run", f"{NO_WHEEL} {torch} {build} wheel reachable", started)
        session.skip(f"no {build} build of torch {torch} for Python {session.python} reachable")
    # nblaunch and its test requirements, keeping the torch installed above: unpinned, pip
    # upgrades it for a requirement's sake (it took 2.2.2 to 2.14.1 here). The installed
    # 2.13.0 satisfies torch==2.13.0, so a local 2.13.0+cpu wheel does not replace it.
    _check_build(session, torch, build)
    try:
        # the extras `make test` has, less the browser's (these are the fast tests)
        # Python 3.10's newest ipykernel, 7.3, can leave a request unread (ipykernel#1554,
        # fixed in 7.4, which needs 3.11): its kernel tests then wait for an idle kernel.
        kernel = ["ipykernel<7"] if session.python == "3.10" else []
        session.install("-e", ".[test,compat,tensorboard]", f"torch=={torch}", *kernel)
    except nox.command.CommandFailed:
        _record(results, cell, "failed", "nblaunch's test extras do not install", started)
        raise
    version = _check_build(session, torch, build)
    # Not session.create_tmp(): it points TMPDIR into .nox, and the tests' Unix sockets under
    # it outgrow AF_UNIX's 108 bytes ("AF_UNIX path too long", 6 detached tests failed).
    junit = Path(session.virtualenv.location) / "junit.xml"
    arguments = session.posargs or FAST
    try:
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", *arguments)  # fmt: skip
    except nox.command.CommandFailed:
        _record(results, cell, "failed", _counts(junit, version), started)
        raise
    _record(results, cell, "passed", _counts(junit, version), started)


def _install_torch(session: nox.Session, torch: str, build: str) -> None:
    """Install the one torch build, ignoring the pip config (its local wheels and mirrors)."""
    env = {"PIP_CONFIG_FILE": os.devnull}
    if build == "cpu":
        # PyTorch's CPU index, and local CPU wheels where the machine has some; torch's own
        # requirements from PyPI (only a "+cpu" wheel satisfies torch==X+cpu), as `make` does.
        session.install(f"torch=={torch}+cpu", "--extra-index-url", CPU_INDEX, "--retries", "1",
                        "--timeout", "30", env=env)  # fmt: skip
    else:
        # PyPI only: a local "+cpu" wheel would satisfy torch==X too.
        session.install(f"torch=={torch}", env={**env, "PIP_FIND_LINKS": ""})


def _check_build(session: nox.Session, torch: str, build: str) -> str:
    """The installed torch's version; fails the cell when it is not the one asked for."""
    out = session.run(
        "python", "-c",
        "import torch; print(torch.__version__, 'cuda' if torch.version.cuda else 'cpu')",
        silent=True,
    )  # fmt: skip
    version, got = str(out).split()[-2:]
    if got != build or version.split("+")[0] != torch:
        session.error(f"asked for the {build} build of torch {torch}, got {version} ({got})")
    return version


def _counts(junit: Path, version: str) -> str:
    try:
        suite = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError):
        return f"torch {version}; no test report"
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    tests, failures, errors, skipped = (
        int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
    )
    passed = tests - failures - errors - skipped
    return f"torch {version}; {passed} passed, {failures + errors} failed, {skipped} skipped"


def _record(
    results: Path, cell: tuple[str, str, str], result: str, detail: str, started: float
) -> None:
    results.parent.mkdir(exist_ok=True)
    minutes = (time.monotonic() - started) / 60
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with results.open("a") as out:
        out.write("\t".join([*cell, result, detail, f"{minutes:.1f}", day]) + "\n")


def _remove_venv(session: nox.Session) -> None:
    location = getattr(session.virtualenv, "location", None)
    if not location:
        return
    # The test report (each test's time and failure) outlives the venv: .nox/junit/<cell>.xml
    junit = Path(location) / "junit.xml"
    if junit.exists():
        kept = Path(".nox/junit") / f"{Path(location).name}.xml"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(junit, kept)
    if os.environ.get("NBLAUNCH_MATRIX_KEEP_VENVS") != "1":
        shutil.rmtree(location, ignore_errors=True)
