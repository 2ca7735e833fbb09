# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is installed first so that no requirement pulls another: the CPU build where a CPU wheel
# is reachable (PyTorch's CPU index, or a local wheel pip's find-links name), else PyPI's wheel,
# which on Linux is the CUDA build (about 5 GB; it runs on CPUs too). The recipes say which.
TORCH_VERSION ?= 2.13.0
TORCH ?= torch==$(TORCH_VERSION)
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
SAY_TORCH = $(PY) -c "import torch; c = torch.version.cuda; print('torch', torch.__version__, \
	f'(the CUDA {c} build: no CPU wheel was reachable)' if c else '(the CPU build)')"

# The suite runs on PYTEST_WORKERS processes, a test file to each (pytest-xdist; 0: in this one):
# its tests mostly wait on ranks, so 2 take 580 s where one took 973 s on this project's 2 cores.
# (exported: the matrix cells of noxfile.py run theirs so too). Files go out in collection order,
# the longest first (tests/conftest.py's LONGEST_FILES): 896 s on 2026-12-07, each worker's
# tests adding up to 882 s; 928 s the run before in xdist's own order (most tests first).
export PYTEST_WORKERS ?= 2
PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-fast test-matrix test-ci-cuda test-browser test-slurm test-xla screenshots lint bench docs install clean lab-build

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)+cpu" --extra-index-url $(CPU_INDEX) --retries 1 --timeout 30 \
		|| $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	@$(SAY_TORCH)
	$(PY) scripts/run_notebook.py notebooks/quickstart.ipynb

# The docs' screenshots at 8 and 64 ranks are remade by `make screenshots`, not by every run:
# the 16-rank browser test checks the same view, and 64 ranks on 2 cores cost half a minute.
test: install
	@$(SAY_TORCH)
	$(PY) -m pytest -q -m "not screenshots" $(PARALLEL)

# The fast tests on every Python x torch x build of noxfile.py (docs/versions.md has the table;
# 5-10 min and a few GB of downloads per cell). One cell: make test-matrix NOX_ARGS='-s
# "tests-3.13(2.13.0-cuda)"'.
NOX_ARGS ?=
test-matrix: install
	$(VENV)/bin/nox $(NOX_ARGS)
	$(PY) scripts/matrix_table.py .nox/matrix.tsv

# The matrix cell CI runs besides `make test`: the fast tests on Python 3.13 with PyPI's torch
# (the CUDA build, on a machine without GPUs), in a fresh venv; docs/versions.md says what it
# costs (about 5 GB of downloads unless pip's cache has them).
CI_CUDA_CELL ?= tests-3.13(2.13.0-cuda)
test-ci-cuda: install
	$(VENV)/bin/nox --error-on-missing-interpreters -s "$(CI_CUDA_CELL)"

# Every browser test, the 8- and 64-rank one too, saving its pictures over the docs' own (a
# test run keeps them in its temporary folders).
screenshots: install
	NBLAUNCH_DOC_PICTURES=1 $(PY) -m pytest -q -m browser

test-fast: install
	@$(SAY_TORCH)
	$(PY) -m pytest -q -m "not browser and not slow" $(PARALLEL)

test-browser: install
	$(PY) -m pytest -q -m browser

# The Slurm tests alone (tests/test_slurm.py, ~80 s, and the pure test_slurm_plan.py): a real
# slurmctld and a slurmd per network namespace, started and stopped by the tests. Needs root
# and Debian's slurm-wlm and munge (.ci/run installs them); without them the tests are skipped
# and -rs prints why. `make test` runs them too, where Slurm is installed.
test-slurm: install
	$(PY) -m pytest -q -rs tests/test_slurm.py tests/test_slurm_plan.py

# The real torch_xla on its CPU runtime (PJRT_DEVICE=CPU), in a venv of its own: torch_xla 2.9
# needs torch 2.9, and pip takes a CUDA build of it here (7.1 GB, 2.5 min to install; see
# docs/devices.md). Not part of `make test`.
VENV_XLA := .venv-xla
TORCH_XLA ?= torch_xla==2.9.0
TORCH_FOR_XLA ?= torch==2.9.1

$(VENV_XLA)/.installed: pyproject.toml
	test -x $(VENV_XLA)/bin/python || $(PYTHON) -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/pip install -q --upgrade pip
	$(VENV_XLA)/bin/pip install -q "$(TORCH_FOR_XLA)" "$(TORCH_XLA)"
	$(VENV_XLA)/bin/pip install -q -e . "pytest>=8" "pytest-timeout>=2.3"
	touch $@

test-xla: $(VENV_XLA)/.installed
	PJRT_DEVICE=CPU $(VENV_XLA)/bin/python -m pytest -q tests/xla

# The runs panel's JupyterLab extension, built into nblaunch/lab/labextension (committed, so users
# need no Node.js). A developer step after changing labextension/: needs Node.js and npm.
lab-build: install
	$(PY) scripts/build_lab.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site, from docs/ and the docstrings, into site/ (open site/index.html). Strict: a broken
# link, anchor or API reference fails the build; tests/test_docs.py runs the same build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The comparisons need the other tools (Accelerate, nbdistributed, ipyparallel) installed.
bench: install
	$(PIP) install -q -e ".[dev,bench]"
	for b in benchmarks/bench_*.py; do echo "### $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VENV_XLA) .nblaunch .pytest_cache site .nox
