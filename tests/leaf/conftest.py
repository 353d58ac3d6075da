"""Fixtures for the leaf-node tests: real nats-servers (tests/support/natshub.py), stopped and reaped at teardown
whatever the test did."""

import pytest
from leafclients import leaf_config

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


@pytest.fixture
def leaf_broker(nats_hub, start_broker):
    """leaf_broker(workers=2, bridge=False) -> a started broker whose every worker is a leaf of ``nats_hub``
    (once the hub lists them all).  Requested after the hub, so it stops first."""
    def start(workers: int = 2, bridge: bool = False, config: dict | None = None):
        broker = start_broker(workers=workers, config={**leaf_config(nats_hub), **(config or {})},
                              args=["--bridge-port", "0"] if bridge else [])
        nats_hub.wait_leafs(workers)
        return broker

    return start
