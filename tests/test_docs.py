"""The docs site: `make docs` builds it strictly, with navigation, search and the whole API."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

import nblaunch

BUILD_TIMEOUT_S = 240  # about 7 s alone; several times that on 2 busy cores


def _build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` as ``make docs`` runs it, from ``config_dir``."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=config_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocstrings_handlers.python", reason="the `docs` extra is not installed")
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _api_targets() -> dict[str, str]:
    """The ``::: module.name`` directives of docs/api.md, by the name they document."""
    text = (ROOT / "docs" / "api.md").read_text()
    return {path.rsplit(".", 1)[1]: path for path in re.findall(r"^::: (\S+)$", text, re.M)}


def _resolve(path: str) -> object:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_api_page_documents_every_public_name():
    targets = _api_targets()
    missing = [name for name in nblaunch.__all__ if name not in targets]
    assert not missing, f"docs/api.md has no `::: ...` entry for {missing}"
    for name in nblaunch.__all__:
        # The entry documents the very object `nblaunch.<name>` is, not a namesake.
        assert _resolve(targets[name]) is getattr(nblaunch, name), name
    # The magics too.
    assert "DistributedMagics" in targets


@pytest.mark.slow
def test_site_builds_strictly_with_navigation_search_and_the_api(site):
    api = (site / "api.html").read_text()
    for name, path in _api_targets().items():
        assert f'id="{path}"' in api, f"{name} is not in the built API page"
    # The API's text comes from the docstrings.
    assert "Run this cell on every rank, as if each rank were the notebook." in api
    index = json.loads((site / "search" / "search_index.json").read_text())
    assert any("find_executable_batch_size" in doc["text"] for doc in index["docs"])
    home = (site / "index.html").read_text()
    for section in ("Getting started", "Troubleshooting", "Measurements", "Reference", "Design"):
        assert section in home, f"the navigation has no {section!r}"
    for page in ("view", "background", "pool", "hangs", "memory", "metrics", "multinode"):
        assert f'href="{page}.html"' in home, f"the navigation does not link {page}.md"
    # Pictures are copied, and every measurement page says when, where and how.
    assert (site / "launch-view.png").stat().st_size > 0
    for page in (ROOT / "docs" / "measurements").glob("*.md"):
        if page.name != "index.md":
            text = page.read_text()
            assert "**Date**" in text and "**Machine**" in text and "**Command**" in text, page


def _slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading (for the headings these pages use)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_readme_links_and_pictures_resolve():
    """The README is not part of the site, so the build does not check it: this does."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert "docs/launch-view.png" in links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md: no #{anchor} in {path}"


@pytest.mark.slow
def test_a_broken_link_fails_the_build(tmp_path):
    pytest.importorskip("mkdocstrings_handlers.python", reason="the `docs` extra is not installed")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "nblaunch").symlink_to(ROOT / "nblaunch")
    view = tmp_path / "docs" / "view.md"
    view.write_text(view.read_text() + "\nSee [the hangs](hangs.md#no-such-section).\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-section" in done.stdout + done.stderr
