"""The quick faults of scripts/stress/faults.py, as tests: each promise of docs/reliability.md checked once.  The long
measurements (100 kills, a soak) are the scripts' to run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "stress"))

import faults  # noqa: E402


def check(result: dict) -> None:
    assert result["ok"], result


@pytest.mark.slow
@pytest.mark.exclusive   # a replacement within a second
def test_kill9_of_a_worker_under_load_others_lose_nothing_and_it_is_back_within_a_second():
    result = faults.kill9(kills=3, per_broker=3, rate=300)
    check(result)
    assert result["back_ms"]["max"] < 1000 and result["survivor_lost_or_duplicated"] == 0


@pytest.mark.slow
def test_sigstop_past_the_stall_timeout_others_flow_and_the_loss_is_counted():
    result = faults.sigstop(stopped=2.0, stall_timeout=0.5, rate=1000)
    check(result)
    assert result["stopped_worker"]["lost"] <= result["fabric_dropped_messages"]


def test_the_supervisor_killed_leaves_no_orphan():
    check(faults.supervisor(connections=50))


@pytest.mark.exclusive   # the supervisor's share of a CPU
def test_out_of_file_descriptors_accepts_pause_without_a_busy_loop():
    result = faults.fds(waiting=10, seconds=2.0)
    check(result)
    assert result["supervisor_cpu_percent"] < 20 and result["accept_errors"] >= 1


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_workers_out_of_file_descriptors_keep_serving():
    check(faults.fds_workers(connections=300, limit=128))


@pytest.mark.skipif(shutil.which("prlimit") is None and shutil.which("mount") is None, reason="needs mount or prlimit")
def test_a_full_journal_disk_keeps_what_was_acknowledged_and_pubsub_flowing():
    result = faults.disk(size_kib=128)
    check(result)
    assert result["acked"] > 0 and result["pubsub_flowing"] and result["kept_after_restart"] == result["acked"]
    assert result["refusal"] == "journal_unavailable" and not result["held_unanswered"]
    assert result["push_after_space_freed_ok"] and not result["journal_torn_tail"]
