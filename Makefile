# The two README commands: `make demo` and `make test`. Each builds/updates .venv itself.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint bench-smoke clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,lightning]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m insitubatch_nodes.demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check insitubatch_nodes tests recipes benchmarks
	$(PY) -m ruff format --check insitubatch_nodes tests recipes benchmarks
	$(PY) -m mypy

test: $(STAMP) lint
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
