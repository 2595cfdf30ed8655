# quantobs developer entry points. The README's two commands:
#   make run    set up .venv with the CLI and run the main job
#   make test   set up .venv with dev + peers, then lint, type-check and test;
#               then the tests again on the newest peers (make test-latest)
#
# Every pip install passes -c constraints.txt: it pins torch to the CPU build
# (an unpinned torch would pull a multi-GB CUDA build) and the dev tools to the
# versions the developers use. Set-up is idempotent: a stamp file per extra
# set, rebuilt only when pyproject.toml, setup.py or constraints.txt change.
#
# The native kernels: `pip install -e` builds them in place (setup.py's
# optional extension, src/quantobs/native/_qo_kernels.so). When their C
# sources change afterwards, `make run`, `make test` and `make bench` rebuild
# them first (src/quantobs/native/build.py --if-stale: a no-op while the
# library's embedded source hash matches the sources).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS := constraints.txt
SETUP_INPUTS := pyproject.toml setup.py $(CONSTRAINTS)
NATIVE_BUILD := $(BIN)/python src/quantobs/native/build.py

STAMP_CLI := $(VENV)/.stamp-cli
STAMP_DEV := $(VENV)/.stamp-dev

# The newest stack each peer publishes (requirements-latest.txt), in its own
# environment: pip resolves it freshly (no constraints file, pre-releases
# where that file names one).
VENV_LATEST ?= .venv-latest
BIN_LATEST := $(VENV_LATEST)/bin
REQUIREMENTS_LATEST := requirements-latest.txt
STAMP_LATEST := $(VENV_LATEST)/.stamp-latest

# Arguments for the main job, e.g. `make run RUN_ARGS="--quick --format json"`;
# the report (HTML + PNG plots) goes to REPORT_DIR, replaced on each run.
REPORT_DIR ?= compare-report
RUN_ARGS ?= --report $(REPORT_DIR) --overwrite
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k cli -x"`.
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help run test test-pinned test-latest setup setup-dev setup-latest native lint format typecheck pytest bench bench-gpu clean

help:
	@echo "make run        set up $(VENV) (.[cli]) and run 'quantobs compare' on the default model"
	@echo "make test       test-pinned, then test-latest"
	@echo "make test-pinned set up $(VENV) (.[dev,cli,peers]); ruff check, ruff format --check, mypy, pytest"
	@echo "make test-latest set up $(VENV_LATEST) (.[dev,cli] + $(REQUIREMENTS_LATEST)); pytest on the newest peers"
	@echo "make format     apply ruff format and the safe ruff fixes"
	@echo "make bench      run benchmarks/bench_qparams.py"
	@echo "make bench-gpu  run benchmarks/bench_gpu.py on CUDA (JSON: bench_gpu.json)"
	@echo "make native     rebuild the native kernels in place (src/quantobs/native)"
	@echo "make clean      remove $(VENV) and tool caches"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# `.[cli]` for the main job.
$(STAMP_CLI): $(SETUP_INPUTS) | $(BIN)/python
	$(PIP) install -c $(CONSTRAINTS) -e '.[cli]'
	touch $@

# `.[dev,cli,peers]` for the checks; it contains `.[cli]`, so it also
# satisfies `make run`.
$(STAMP_DEV): $(SETUP_INPUTS) | $(BIN)/python
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev,cli,peers]'
	touch $@ $(STAMP_CLI)

# `.[dev,cli]` with the newest peers instead of constraints.txt's pins.
$(STAMP_LATEST): $(SETUP_INPUTS) $(REQUIREMENTS_LATEST)
	$(PYTHON) -m venv $(VENV_LATEST)
	$(BIN_LATEST)/python -m pip install -e '.[dev,cli]' -r $(REQUIREMENTS_LATEST)
	touch $@

setup: $(STAMP_CLI)
setup-dev: $(STAMP_DEV)
setup-latest: $(STAMP_LATEST)

# Without a C compiler the job still runs (torch kernels, with a warning).
run: $(STAMP_CLI)
	-$(NATIVE_BUILD) --if-stale
	$(BIN)/quantobs compare $(RUN_ARGS)

native: | $(BIN)/python
	$(NATIVE_BUILD)

# Each step exits non-zero on failure and make stops there; all of them are
# what .pre-commit-config.yaml runs too.
test: test-pinned test-latest

test-pinned: lint typecheck pytest

lint: $(STAMP_DEV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP_DEV)
	$(BIN)/mypy src

pytest: $(STAMP_DEV)
	$(NATIVE_BUILD) --if-stale
	$(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS)

# The tests again on the newest peers; parity tests whose peer lacks what
# they compare skip with the reason. Left out: the tests of quantobs' own
# kernels, statistics, sync budget and device arithmetic, which import no
# peer and run on the same torch in both stacks (test-pinned runs them).
LATEST_SKIP := tests/native tests/stats tests/benchmarks \
	tests/observers/test_sync_budget.py tests/observers/test_device_identity.py
test-latest: $(STAMP_LATEST)
	$(BIN_LATEST)/python src/quantobs/native/build.py --if-stale
	$(BIN_LATEST)/python -m pytest -p no:cacheprovider \
		$(addprefix --ignore=,$(LATEST_SKIP)) $(PYTEST_ARGS)

format: $(STAMP_DEV)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP_DEV)
	$(NATIVE_BUILD) --if-stale
	$(BIN)/python benchmarks/bench_qparams.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) .mypy_cache .ruff_cache .pytest_cache .hypothesis
	rm -rf build src/quantobs/native/_qo_kernels.*

# The GPU benchmark (issue 24): every observer on CUDA against the
# torch.aminmax floor and llm-compressor, syncs, CPU == GPU qparams, a whole
# calibration; BENCH_GPU_ARGS e.g. "--quick" or "--device cpu --small".
BENCH_GPU_ARGS ?=
bench-gpu: $(STAMP_DEV)
	$(NATIVE_BUILD) --if-stale
	$(BIN)/python benchmarks/bench_gpu.py --json bench_gpu.json $(BENCH_GPU_ARGS)
