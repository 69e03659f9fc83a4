# Two commands from a fresh clone: `make run` (the default search + its report) and `make test`.
# Both create .venv on first use and do nothing more the second time.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The installer of the venv's packages: uv (pinned, put into the venv by its own pip) installs the
# 7 GB working set in parallel, pip one file at a time: 53 s against 686 s on the same busy 2 cores
# (README). uv does not read pip's configuration files: behind a private index set UV_DEFAULT_INDEX
# (or UV_INDEX_URL), or run `make venv INSTALLER=pip`.
INSTALLER ?= uv
UV_VERSION := 0.13.9
ifeq ($(INSTALLER),uv)
INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY)
else ifeq ($(INSTALLER),pip)
INSTALL := $(PY) -m pip install --quiet
else
$(error INSTALLER=$(INSTALLER): expected uv or pip)
endif
# The wheels installed without their declared dependencies ([tool.dptune] no-deps in pyproject.toml).
NO_DEPS = $$($(PY) -c "import tomllib;print(' '.join(tomllib.load(open('pyproject.toml','rb'))['tool']['dptune']['no-deps']))")

.PHONY: venv test-venv run lint test plan bench clean-venv

# `venv`: what a run needs; `test-venv` adds the test extra (ruff, mypy, pytest, polars, duckdb, ...),
# which `make run` does without: 3 s less of a cold install (26.3 against 23.2 s, bench/RESULTS.md).
venv: $(STAMP)
test-venv: $(TEST_STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(filter uv,$(INSTALLER)),$(PY) -m pip install --quiet uv==$(UV_VERSION))
	$(INSTALL) -e .
	$(INSTALL) --no-deps $(NO_DEPS)
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(INSTALL) -e '.[test]'
	touch $(TEST_STAMP)

# `run` and `test` write the bytecode of what they import (into .venv/ and __pycache__/, both this
# clone's own) even where the environment sets PYTHONDONTWRITEBYTECODE: otherwise every process (the
# driver, each Ray worker, each test's search) compiles torch, Ray and the rest from source at every
# import. Measured against compiling everything at install (bench/RESULTS.md).
BYTECODE := PYTHONDONTWRITEBYTECODE=

# --resume: the first run starts the search; a later one continues an interrupted search, or, for
# a finished one, computes nothing and prints its summary and rebuilds its report (seconds).
run: venv
	$(BYTECODE) $(PY) -m dptune.search --space search_spaces/default.yaml --resume

# ruff and mypy (pinned in the test extra, configured in pyproject.toml): the formatter's check, then
# import order, pyflakes, pycodestyle, bugbear, pyupgrade, then the types of dptune/ (about 30 s of CPU
# from a fresh clone, a few seconds once .mypy_cache/ holds the libraries' analysis).
lint: test-venv
	$(PY) -m ruff format --check dptune tests bench
	$(PY) -m ruff check dptune tests bench
	$(PY) -m mypy

# Two pytest-xdist workers: the suite spends much of its time waiting on Ray processes to start and
# register, so 2 workers on 2 cores finish it in 0.7 of the time of one (bench/RESULTS.md).
# TEST_WORKERS=0 runs it in one process. A worker that dies ends the run at once, naming the test it
# was running (pytest-xdist would restart it, and its loadgroup scheduler can then wait forever).
TEST_WORKERS ?= 2

test: lint
	$(BYTECODE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0

bench: venv
	$(PY) bench/run_all.py

clean-venv:
	rm -rf $(VENV)
