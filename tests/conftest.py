import resource

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
