# The two README commands: `make demo` and `make test`. Each builds/updates .venv itself.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-newest-zarr lint bench-smoke clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,lightning,bench,recipes]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m insitubatch_nodes.demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check insitubatch_nodes tests recipes benchmarks
	$(PY) -m ruff format --check insitubatch_nodes tests recipes benchmarks
	$(PY) -m mypy

# Every test but the benchmark harness's smoke runs (the `bench` marker: `make bench-smoke`).
TEST_SELECTION ?= -m "not bench"
# Three workers on CI's two cores: a third of the suite's wall is tests waiting (servers, child
# processes, deadlines), not computing. The whole suite on this 2-core machine: 5:11 with 2
# workers, 4:39 with 3 (2026-12-06, same run conditions, every test passing in both); with 4,
# 5:34 against 5:35 with 3, and 606 CPU-s against 539 (2026-12-07, quiet machine, the CPU cgroup).
TEST_WORKERS ?= 3

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on
# the project's machines): without it every worker, and every fresh interpreter a test starts,
# compiles the package and rewrites the tests' asserts again (collection: 13.4 s a process
# against 5.5 s with the bytecode of an earlier one, 2026-12-06).
test: $(STAMP) lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(TEST_SELECTION) $(PYTEST_ARGS)

# Second CI leg: Python 3.12 with the newest zarr the package allows (docs/development.md,
# "Which zarr"). .venv312 is built once (torch==2.13.0 resolves the cp312 wheel and its CUDA
# dependencies from the index); `make clean` drops it so that the next run takes the newest zarr.
# PYTHON312 defaults to pyenv's newest 3.12, else python3.12 on PATH.
PYTHON312 ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12))),$(shell command -v python3.12 2>/dev/null))
VENV312   := .venv312
PY312     := $(VENV312)/bin/python
STAMP312  := $(VENV312)/.installed
# Everything but the end-to-end tests (Lightning, DDP, recipes, benchmarks: the `slow` marker).
NEWEST_ZARR_PYTEST_ARGS ?= -m "not slow"

$(STAMP312): pyproject.toml constraints.txt
	@test -n "$(PYTHON312)" || { echo "make test-newest-zarr: no Python 3.12 in" \
		"~/.pyenv/versions/3.12.*/bin or on PATH: install one or pass PYTHON312=..." >&2; exit 1; }
	@$(PYTHON312) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || { \
		echo "make test-newest-zarr: $(PYTHON312) is not Python 3.12" >&2; exit 1; }
	@test -x $(PY312) || $(PYTHON312) -m venv $(VENV312)
	$(PY312) -m pip install --quiet --upgrade pip
	$(PY312) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY312) -m pip install --quiet -c constraints.txt --upgrade -e '.[dev,lightning]' zarr
	@touch $(STAMP312)

test-newest-zarr: $(STAMP312)
	@$(PY312) -c 'import sys, zarr, numcodecs, numpy; print(f"== python {sys.version.split()[0]}, zarr {zarr.__version__}, numcodecs {numcodecs.__version__}, numpy {numpy.__version__}")'
	PYTHONDONTWRITEBYTECODE= $(PY312) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(NEWEST_ZARR_PYTEST_ARGS) $(PYTEST_ARGS)

# Benchmarks (benchmarks/README.md). Both install the `bench` extra when it is missing.
# `make bench` runs the side-by-side suite (BENCH_ARGS), then the archive-shape suite
# (benchmarks/archive.py, ARCHIVE_ARGS), the forecast and collections (HCS plate) runs
# (FORECAST_ARGS, COLLECTIONS_ARGS), then renders docs/benchmarks.md from the JSONLs.
.PHONY: bench
bench: $(STAMP)
	@$(PY) -c "import psutil, matplotlib, xarray, xbatcher, tensorstore" 2>/dev/null || \
		$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	BENCH_COMMAND="make bench" $(PY) -m benchmarks.run --suite full $(BENCH_ARGS)
	BENCH_COMMAND="make bench" $(PY) -m benchmarks.archive --suite full $(ARCHIVE_ARGS)
	$(PY) -m benchmarks.forecast --out benchmarks/results $(FORECAST_ARGS)
	$(PY) -m benchmarks.stack_inputs --out benchmarks/results $(STACK_INPUTS_ARGS)
	$(PY) -m benchmarks.plates --out benchmarks/results $(COLLECTIONS_ARGS)
	$(PY) -m benchmarks.report

# The harness's claims first (tests marked `bench`: each suite's smoke run and its report),
# then both suites' smoke runs rendered together.
bench-smoke: $(STAMP)
	@$(PY) -c "import psutil, matplotlib, xarray, xbatcher, tensorstore" 2>/dev/null || \
		$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) -m pytest -n 2 --dist loadgroup -m bench -p no:cacheprovider
	@tmp=$$(mktemp -d) && \
		BENCH_COMMAND="make bench-smoke" $(PY) -m benchmarks.run --suite smoke --out $$tmp --check && \
		BENCH_COMMAND="make bench-smoke" $(PY) -m benchmarks.archive --suite smoke --out $$tmp \
			--check && \
		$(PY) -m benchmarks.forecast --smoke --out $$tmp --check && \
		$(PY) -m benchmarks.stack_inputs --smoke --out $$tmp --check && \
		$(PY) -m benchmarks.plates --smoke --out $$tmp && \
		$(PY) -m benchmarks.report $$tmp/bench-smoke-*.jsonl --archive $$tmp/archive-smoke-*.jsonl \
			--doc $$tmp/benchmarks.md --plots $$tmp/plots && \
		rm -rf $$tmp

clean:
	rm -rf $(VENV) $(VENV312) data .pytest_cache .mypy_cache .ruff_cache
