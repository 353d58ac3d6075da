"""docs/leafnodes.md's complete example, as written there (its hub configuration, its broker configuration and its
nats-py program), run against a real hub with the ports moved to free ones: the page stays true."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.harness import REPO, Broker
from support.natshub import NatsServer, require_nats_server


class DocHub(NatsServer):
    def __init__(self, tmp, text: str) -> None:
        super().__init__(tmp, "hub")
        self.text = text

    def config(self) -> str:
        return (self.text.replace("127.0.0.1:4222", f"127.0.0.1:{self.port}")
                .replace("127.0.0.1:8222", f"127.0.0.1:{self.http_port}")
                .replace("127.0.0.1:7422", f"127.0.0.1:{self.leaf_port}"))


@pytest.mark.timeout(60)
def test_the_pages_example_runs(tmp_path):
    require_nats_server()
    page = (REPO / "docs" / "leafnodes.md").read_text()
    (hub_conf, broker_json, program) = [body for _, body in re.findall(r"```(\w*)\n(.*?)```", page, re.S)][:3]
    hub = DocHub(tmp_path, hub_conf).start()
    config = json.loads(broker_json.replace("127.0.0.1:7422", f"127.0.0.1:{hub.leaf_port}"))
    broker = Broker(tmp_path, workers=2, config=config).start()
    try:
        hub.wait_leafs(2)
        script = (program.replace("nats://127.0.0.1:4222", hub.url)
                  .replace("nats://127.0.0.1:4223", f"nats://127.0.0.1:{broker.ports['nats']}"))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["b'42'", "orders.new b'book'"]
        names = sorted(leaf["name"] for leaf in broker.http("/leafz?subs=1")[1]["leafs"])
        assert names == ["shop-broker-w0", "shop-broker-w1"]
    finally:
        broker.close()
        hub.close()
