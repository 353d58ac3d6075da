import fcntl
import resource
from pathlib import Path

import pytest

from support.harness import Broker

# Tests open hundreds of sockets at once.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _soft < min(_hard, 16384):
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(_hard, 16384), _hard))


@pytest.fixture
def start_broker(tmp_path):
    """start_broker(workers=2, config=None, args=()) -> a running Broker, stopped and reaped at teardown."""
    started: list[Broker] = []

    def start(**kwargs) -> Broker:
        broker = Broker(tmp_path, **kwargs)
        started.append(broker)
        return broker.start()

    yield start
    errors = []
    for broker in started:
        try:
            broker.close()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, errors


@pytest.fixture
def broker(start_broker):
    """A 2-worker broker with defaults."""
    return start_broker(workers=2)


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for the whole test run (load tests; its JVM starts once, in ~5 s)."""
    from shardbroker.cli.loadtest.job import session

    s = session("local[6]", 6, timeout_s=300)
    yield s
    s.stop()


# -- pytest-xdist (make test: 4 workers, --dist loadfile, then the exclusive tests alone: see the Makefile) --------

@pytest.hookimpl(tryfirst=True)   # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
    """A test that uses the ``spark`` session is a ``spark`` test.  (Under ``--dist loadfile`` the ones in one
    file share a worker, and so a JVM; ``loadgroup`` would do it whatever the files, but pytest-xdist 3.8 loses
    its groups under pytest 9.2: pytest-xdist#1386.)"""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


_LOCKS: dict = {}   # this worker's lock files, by name, opened once


def _lock(item, name: str):
    if name not in _LOCKS:   # in the run's base temporary directory, the parent of every worker's (popen-gw0, ...)
        _LOCKS[name] = open(Path(item.config.option.basetemp).parent / f"{name}.lock", "a")
    return _LOCKS[name]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, the ``spark`` tests (seconds of a JVM on every core each) run one at a time, and a test marked
    ``exclusive`` with no other beside it (make test runs those in a step of their own; this is for ``pytest -n``
    by hand).  Every test holds ``room`` shared, an exclusive one holds it alone, and ``door`` keeps the tests that
    come after a waiting exclusive one out until it is done.  The waits come before pytest-timeout's clock starts
    (this wrapper is the outermost one) and count in no test's duration.  Without xdist there is nothing to do."""
    if getattr(item.config, "workerinput", None) is None or not item.config.option.basetemp:
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    wanted = [("door", fcntl.LOCK_EX), ("room", fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)]
    if item.get_closest_marker("spark") is not None:
        wanted.insert(0, ("spark", fcntl.LOCK_EX))   # first: no test waits for it while holding the room
    held = []
    try:
        for name, how in wanted:
            fcntl.flock(_lock(item, name), how)
            held.append(name)
        if not exclusive:
            fcntl.flock(_lock(item, "door"), fcntl.LOCK_UN)
        yield
    finally:
        for name in held:
            fcntl.flock(_lock(item, name), fcntl.LOCK_UN)


@pytest.hookimpl(trylast=True)   # after pytest-cov's table
def pytest_terminal_summary(terminalreporter, config):
    """make test's coverage figure, with what it is of (the Makefile says why)."""
    total = getattr(config.pluginmanager.get_plugin("_cov"), "cov_total", None)
    if total is not None:
        terminalreporter.write_line(f"coverage of the pytest processes only, not of the brokers they start: "
                                    f"{total:.1f}%")
