# Two commands from a fresh clone: `make run` (the default search + its report) and `make test`.
# Both create .venv on first use and do nothing more the second time.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run test plan bench clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $$($(PY) -c "import tomllib;print(' '.join(tomllib.load(open('pyproject.toml','rb'))['tool']['dptune']['no-deps']))")
	touch $(STAMP)

# --resume: the first run starts the search; a later one continues an interrupted search, or, for
# a finished one, computes nothing and prints its summary and rebuilds its report (seconds).
run: venv
	$(PY) -m dptune.search --space search_spaces/default.yaml --resume

test: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) bench/run_all.py

clean-venv:
	rm -rf $(VENV)
