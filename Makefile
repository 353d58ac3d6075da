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

# An editable install serves the package through an import hook, which PySpark's search for data sources
# (pkgutil.iter_modules over sys.path, for top-level pyspark_* modules) does not see: a .pth puts the one folder
# that holds pyspark_shardbroker on sys.path (docs/spark.md).  An install from a wheel has it in site-packages.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py workers/_speedups.c workers/workqueues/_qcore.c
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "pyspark_shardbroker_dev.pth").write_text(str(pathlib.Path("cli/spark/discovery").resolve()) + "\n")'
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

# The suite runs in two steps.  First every test but the `exclusive` ones, on 4 pytest-xdist workers whatever the
# cores: a test spends most of its time waiting on the brokers it starts, so 4 share 2 cores well.  --dist loadfile
# keeps a file's tests on one worker (the Spark ones share its JVM), and the `spark` tests run one at a time
# (tests/conftest.py).  Then the `exclusive` ones (they measure time or CPU against a threshold, which other tests
# beside them would make noisy) in one process, alone.  Both steps run; either failing fails the target, and an exit
# status of 5 (no test selected) is no failure.  PYTEST_ARGS applies to both (a -m in it replaces the split);
# PYTEST_XDIST="-n 0" runs the first step in one process.  On 2 shared cores: ~8 min, against ~14 in one process.
#
# The coverage figure (printed once, by the second step, for both) is of the pytest processes only: the unit and
# in-process tests, and what the tests run of the package in their own process (clients, codecs, in-process
# hubs).  It is not the brokers': their workers start with -S and leave through os._exit, where coverage's
# `patch = ["subprocess"]` does not follow.  That patch, tried, measured the supervisors and the CLI runs alone,
# slowed every Python start (it imports coverage first: the Ctrl-C-at-start-up test failed with it) and the
# subprocess-heavy tests by 6-34 %.  The in-process figure slows the in-process tests 2-5x (test_qcore, test_fuzz),
# which is lost in the waiting: the first step took 425 s with it and 445 s without, on 2 shared cores.
# PYTEST_COV= leaves coverage out.
#
# Before the tests: ruff (pyproject.toml [tool.ruff]) on the whole tree; the layers, the import cycles and the
# 500-line limit are tests of the suite (tests/unit/test_layout.py).
PYTEST_XDIST ?= -n 4 --dist loadfile
PYTEST_COV   ?= --cov
PYTEST        = SHARDBROKER_REQUIRE_COMPILED=1 $(BIN)/python -m pytest

test: setup-test
	$(COMPILE)
	$(BIN)/ruff check .
	$(PYTEST) $(PYTEST_XDIST) -m "not exclusive" $(PYTEST_COV) --cov-report= $(PYTEST_ARGS); one=$$?; \
	$(PYTEST) -m exclusive $(PYTEST_COV) --cov-append --cov-report=term:skip-covered $(PYTEST_ARGS); two=$$?; \
	[ $$one = 0 -o $$one = 5 ] && [ $$two = 0 -o $$two = 5 ]

bench: setup-bench
	$(BIN)/brokerctl bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .coverage .coverage.* workers/_speedups*.so workers/workqueues/_qcore*.so
