"""Prometheus' own checker on a real scrape, and the alerting rules under `promtool test rules`
(scripts/dev/install-test-deps installs promtool; without it these are skipped)."""

import shutil
import subprocess

import pytest
from test_metrics import scrape

from support.harness import REPO, Raw

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/dev/install-test-deps)")
RULES = REPO / "deploy" / "prometheus"


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=RULES)


def test_promtool_check_metrics_passes_a_real_scrape(start_broker):
    b = start_broker(workers=2, args=["--bridge-port", "0"])
    with Raw(b.port) as s, Raw(b.port) as p:
        s.request({"op": "sub", "topic": "t"})
        p.request({"op": "pub", "topic": "t", "data": "x"})
        p.request({"op": "qpush", "queue": "jobs", "data": 1})
        text, _ = scrape(b)
    result = promtool("check", "metrics", stdin=text)
    # a clean run prints nothing; lint findings (naming, units, missing _total) come out on stdout/stderr
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def test_alerting_rules_are_valid_and_their_tests_pass():
    check = promtool("check", "rules", "alerts.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    test = promtool("test", "rules", "alerts.test.yml")
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
