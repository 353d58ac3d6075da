# The two quick-start commands (see README.md):
#   make run    set up a virtual environment and start the broker on the embedded defaults
#   make test   set up everything the test suite needs (system packages included) and run it
# ARGS passes options to `brokerctl start` (make run ARGS="--workers 8"); PYTEST_ARGS to pytest.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test setup setup-test clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is required (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test
	scripts/install-test-deps

run: setup
	$(BIN)/brokerctl start $(ARGS)

test: setup-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
