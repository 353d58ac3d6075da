"""Fixtures for the leaf-node tests: real nats-servers (tests/support/natshub.py), stopped and reaped at teardown
whatever the test did."""

import pytest

from support.natshub import NatsServer, require_nats_server


@pytest.fixture
def nats_servers(tmp_path):
    """nats_servers(name="hub", leaf_listen=True, remotes=None, extra="", cluster=None, start=True, ...) -> a
    NatsServer (started unless start=False); every one made is closed at teardown."""
    require_nats_server()
    made: list[NatsServer] = []

    def make(*args, start: bool = True, **kwargs) -> NatsServer:
        server = NatsServer(tmp_path, *args, **kwargs)
        made.append(server)
        return server.start() if start else server

    yield make
    for server in reversed(made):
        server.close()


@pytest.fixture
def nats_hub(nats_servers):
    """A started hub (nats-server listening for leafnodes on a loopback port)."""
    return nats_servers("hub")
