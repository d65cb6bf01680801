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
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,lightning,bench]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m insitubatch_nodes.demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check insitubatch_nodes tests recipes benchmarks
	$(PY) -m ruff format --check insitubatch_nodes tests recipes benchmarks
	$(PY) -m mypy

test: $(STAMP) lint
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# Benchmarks (benchmarks/README.md). Both install the `bench` extra when it is missing.
.PHONY: bench
bench: $(STAMP)
	@$(PY) -c "import psutil, matplotlib, xarray, xbatcher" 2>/dev/null || \
		$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	BENCH_COMMAND="make bench" $(PY) -m benchmarks.run --suite full $(BENCH_ARGS)
	$(PY) -m benchmarks.report

bench-smoke: $(STAMP)
	@$(PY) -c "import psutil, matplotlib, xarray, xbatcher" 2>/dev/null || \
		$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	@tmp=$$(mktemp -d) && \
		BENCH_COMMAND="make bench-smoke" $(PY) -m benchmarks.run --suite smoke --out $$tmp --check && \
		$(PY) -m benchmarks.report $$tmp/bench-smoke-*.jsonl --doc $$tmp/benchmarks.md \
			--plots $$tmp/plots && \
		rm -rf $$tmp

clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
