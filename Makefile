# The two quick-start commands (see README.md):
#   make run    set up a virtual environment and start the broker on the embedded defaults
#   make test   set up everything the test suite needs (system packages included) and run it
# ARGS passes options to `brokerctl start` (make run ARGS="--workers 8") or `brokerctl bench`; PYTEST_ARGS to pytest.
# make bench   the side-by-side benchmark against nats-server and Redis (installs them if missing; see docs/performance.md)

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test bench setup setup-test setup-bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is required (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py workers/_speedups.c workers/workqueues/_qcore.c
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	@touch $@

setup: $(VENV)/.installed

# The suite runs the hot path both compiled and pure (tests/unit/test_speedups.py): once install-test-deps has made
# sure of a C compiler and Python's headers, build the extension if the first install could not.
setup-test: $(VENV)/.installed-test
	PYTHON=$(BIN)/python scripts/dev/install-test-deps
	@$(BIN)/python -c 'import shardbroker.workers._speedups, shardbroker.workers.workqueues._qcore' 2>/dev/null \
		|| $(BIN)/python -m pip install --quiet -e .

setup-bench: $(VENV)/.installed-bench
	PYTHON=$(BIN)/python scripts/dev/install-test-deps

# The package's bytecode, written now: workers start with the supervisor's interpreter flags, and with -B (set by
# PYTHONDONTWRITEBYTECODE) each worker would compile its modules again at every start, ~0.15 s of a broker's start-up
# (and of a crashed worker's replacement); the suite starts a broker several hundred times.  compileall writes what
# is out of date whatever that setting says, and Python ignores a .pyc whose source changed since.  Only a speed-up:
# a checkout it cannot write to (or a syntax error, which the import reports) does not stop the target.
COMPILE = $(BIN)/python -m compileall -q cluster workers router cli > /dev/null 2>&1 || true

run: setup
	$(COMPILE)
	$(BIN)/brokerctl start $(ARGS)

test: setup-test
	$(COMPILE)
	SHARDBROKER_REQUIRE_COMPILED=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup-bench
	$(BIN)/brokerctl bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache workers/_speedups*.so workers/workqueues/_qcore*.so
