"""A queue journal that cannot be written (a full disk): pushes and receives are undone and refused with
``journal_unavailable``, other changes wait for the disk, nothing stored is lost, the file stays whole.

The shard-level tests write to ``/dev/full`` (a real device whose every write fails with ENOSPC): the journal's
descriptor is pointed at it for the turns that must fail and back at the file afterwards ("space freed").  The
broker-level test fills a real filesystem: a small tmpfs where it can be mounted (root), else the workers'
RLIMIT_FSIZE (EFBIG), raised again with prlimit to free the space.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.messages import D_RECEIPT
from shardbroker.workers.workqueues.rules import Settings
from shardbroker.workers.workqueues.shard import Shard
from shardbroker.workers.workqueues.shard_commit import JOURNAL_UNAVAILABLE

from support.harness import REPO, Broker, free_space, on_worker, small_disk

REFUSED = {"ok": False, "error": JOURNAL_UNAVAILABLE, "retry": True}
HAVE_DEV_FULL = os.path.exists("/dev/full")


class Disk:
    """A shard journaling to ``path``, whose disk can be made full (its descriptor on /dev/full) and freed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.journal = Journal(path)
        self.shard = Shard(0, Settings(), self.journal, lambda: None, 256)
        self._file = os.dup(self.journal._fd)
        self._full = os.open("/dev/full", os.O_WRONLY)

    def full(self) -> None:
        os.dup2(self._full, self.journal._fd)

    def free(self) -> None:
        os.dup2(self._file, self.journal._fd)

    def ask(self, op: str, **args) -> list:
        """Run one request; -> a list that gets its reply once the shard answers."""
        box: list = []
        self.shard.handle(op, args, (0, 1), box.append)
        return box

    def turn(self, *requests: tuple) -> list[list]:
        """Requests ``(op, args)`` read in one event-loop turn, then the turn's commit."""
        boxes = [self.ask(op, **args) for op, args in requests]
        self.shard.commit()
        return boxes

    def replayed(self) -> Shard:
        fresh = Shard(0, Settings(), Journal(self.path), lambda: None, 256)
        fresh.replay()
        return fresh

    def close(self) -> None:
        self.free()
        self.journal.close()
        os.close(self._file)
        os.close(self._full)


def run(fn):
    async def main():
        return fn()
    return asyncio.run(main())


def push(data: bytes, **args) -> tuple:
    return ("push", {"queue": "jobs", "data": data, **args})


pytestmark_unit = pytest.mark.skipif(not HAVE_DEV_FULL, reason="needs /dev/full")


@pytestmark_unit
def test_a_push_that_cannot_be_journaled_is_undone_and_refused(tmp_path):
    def body():
        d = Disk(str(tmp_path / "j"))
        (ok,) = d.turn(push(b"kept"))
        assert ok[0]["ok"]
        size = os.path.getsize(d.path)
        q = d.shard.queue("jobs")
        before = q.stat(0)
        d.full()
        one, batch, group, columns, run_ = d.turn(
            push(b"lost"), ("push", {"queue": "jobs", "messages": [(b"a", 0, None, None), (b"b", 0, 9, 5000)]}),
            ("pushes", {"queue": "jobs", "pushes": [{"data": b"c"}, {"data": b"d"}]}),
            ("push", {"queue": "jobs", "datas": [b"e", b"f"]}),        # journaled as columns (pushcol)
            ("pushes", {"queue": "jobs", "pushes": [b"g", b"h"]}))     # a run of canonical pushes: columns too
        # refused at once (nothing else waits for the disk), and nothing of them is left in memory; single pushes
        # sent together are refused each (a run stored whole is refused whole: ndjson_ops tells each of its pushes)
        assert one == [REFUSED] and batch == [REFUSED] and group == [{"ok": True, "results": [REFUSED, REFUSED]}]
        assert columns == [REFUSED] and run_ == [REFUSED]
        assert q.stat(0) == before and len(q.messages) == 1 and q.visible == 1 and q.bytes == 4
        assert not d.journal.dirty and os.path.getsize(d.path) == size
        assert d.shard.journal_refused == 6
        # space again: the next push is stored, and the journal replays to exactly what was acknowledged
        d.free()
        (ok2,) = d.turn(push(b"later"))
        assert ok2[0]["ok"]
        got = d.ask("recv", queue="jobs", max=10)
        d.shard.commit()
        assert [m[3] for m in got[0]["messages"]] == [b"kept", b"later"]
        again = d.replayed().queue("jobs")
        assert sorted(m[3] for m in again.messages.values()) == [b"kept", b"later"]
        assert again.pushed == 2 and again.in_flight == 2
        d.close()
    run(body)


@pytestmark_unit
def test_an_undone_run_of_pushes_forgets_their_dedup_ids(tmp_path):
    """Single pushes with their own dedup_ids stored together (one record, an id remembered per push): when the
    record cannot be written, every one of the ids is forgotten with the messages, so the producer's retry stores
    them; and a retry once they are written is known, through a replay too."""
    def body():
        d = Disk(str(tmp_path / "j"))
        run_ = ("pushes", {"queue": "jobs", "pushes": [
            {"data": b"a", "kind": 0, "dedup_id": "a"}, {"data": b"b", "kind": 0}, b"c",
            {"data": b"d", "kind": 0, "dedup_id": "d"}], "priority": 4})
        d.full()
        (refused,) = d.turn(run_)
        assert refused == [REFUSED] and not d.shard.queue("jobs").messages
        d.free()
        (stored,) = d.turn(run_)
        ids = stored[0]["ids"]
        assert len(ids) == 4 and d.shard.queue("jobs").visible == 4
        (again,) = d.turn(run_)   # the same pushes again: the two with ids are known, the others stored anew
        results = again[0]["results"]
        assert [r.get("duplicate") for r in results] == [True, None, None, True]
        assert (results[0]["id"], results[3]["id"]) == (ids[0], ids[3])
        replayed = d.replayed().queue("jobs")
        assert (replayed.tokens.get("a"), replayed.tokens.get("d"), len(replayed.messages)) == (ids[0], ids[3], 6)
        d.close()
    run(body)


@pytestmark_unit
def test_a_receive_is_undone_and_an_ack_waits_for_the_disk(tmp_path):
    def body():
        d = Disk(str(tmp_path / "j"))
        d.turn(push(b"one"), push(b"two"), push(b"three"))
        (got,) = d.turn(("recv", {"queue": "jobs", "max": 1}))
        receipt = got[0]["messages"][0][D_RECEIPT]
        q = d.shard.queue("jobs")
        d.full()
        ack, recv = d.turn(("ack", {"queue": "jobs", "receipt": receipt}), ("recv", {"queue": "jobs", "max": 5}))
        # the receive is undone (both messages visible again, never delivered) and refused; the ack is kept
        # applied, its reply waiting for the write
        assert recv == [REFUSED] and ack == []
        assert q.visible == 2 and q.in_flight == 0 and q.acked == 1 and q.delivered == 1
        assert not q.deliveries and len(q.messages) == 2
        assert d.journal.dirty
        d.shard.commit()      # still full: still waiting
        assert ack == []
        d.free()
        d.shard.commit()      # the retry (the shard's timer schedules it): written, answered
        assert ack == [{"ok": True}]
        again = d.replayed().queue("jobs")
        assert sorted(m[3] for m in again.messages.values()) == [b"three", b"two"]
        assert again.visible == 2 and again.acked == 1 and not again.deliveries
        d.close()
    run(body)


@pytestmark_unit
def test_a_long_poll_served_by_an_undone_push_waits_again(tmp_path):
    def body():
        d = Disk(str(tmp_path / "j"))
        (first,) = d.turn(("recv", {"queue": "jobs", "max": 10, "wait_ms": 60_000}))
        (second,) = d.turn(("recv", {"queue": "jobs", "max": 10, "wait_ms": 60_000}))
        assert first == [] and second == [] and len(d.shard.waiters["jobs"]) == 2
        d.full()
        (refused,) = d.turn(push(b"x"))
        assert refused == [REFUSED] and first == [] and second == []
        assert [w.done for w in d.shard.waiters["jobs"]] == [False, False]   # both waiting, in their order
        assert d.shard._waiting[(0, 1)] == 2
        q = d.shard.queue("jobs")
        assert not q.messages and not q.leases and q.delivered == 0
        d.free()
        (ok,) = d.turn(push(b"y"))
        assert ok[0]["ok"] and [m[3] for m in first[0]["messages"]] == [b"y"] and second == []
        d.close()
    run(body)


@pytestmark_unit
def test_a_long_poll_put_back_is_served_once_the_disk_has_room(tmp_path):
    """A waiter put back while messages are visible (its receive of them undone) gets them at the next write."""
    def body():
        d = Disk(str(tmp_path / "j"))
        d.turn(push(b"old"))
        d.turn(("recv", {"queue": "jobs", "max": 1, "visibility_ms": 0}))   # leased, and lost at once
        (waiting,) = d.turn(("recv", {"queue": "jobs", "max": 1, "wait_ms": 60_000}))
        d.shard._on_timer()    # the lease's expiry: visible again, the waiter served in the commit...
        d.full()
        d.shard.commit()       # ...which cannot be written: the waiter waits again
        assert waiting == [] and d.shard.queue("jobs").visible == 1
        d.free()
        d.shard._retry_write()  # the shard's retry timer
        d.shard.commit()
        assert [m[3] for m in waiting[0]["messages"]] == [b"old"] and waiting[0]["messages"][0][4] == 2
        d.close()
    run(body)


@pytestmark_unit
def test_a_remote_push_token_is_forgotten_with_its_push(tmp_path):
    def body():
        d = Disk(str(tmp_path / "j"))
        d.full()
        (refused,) = d.turn(push(b"x", token=(1, 7, 42)))
        assert refused == [REFUSED] and not d.shard.queue("jobs").tokens
        d.free()
        (ok,) = d.turn(push(b"x", token=(1, 7, 42)))   # the same request sent again: stored this time
        assert ok[0]["ok"] and len(d.shard.queue("jobs").messages) == 1
        d.close()
    run(body)


@pytestmark_unit
def test_a_turn_that_acks_what_it_leased_keeps_both(tmp_path):
    """A lease acked in the turn it was granted in (a guessed receipt is impossible; a dead-letter by seq is
    not): the queue's pushes and leases of that turn are all kept, and their replies wait for the write."""
    def body():
        d = Disk(str(tmp_path / "j"))
        d.turn(push(b"a"))
        d.full()
        q = d.shard.queue("jobs")
        pushed = d.ask("push", queue="jobs", data=b"b")
        got = d.ask("recv", queue="jobs", max=1)
        (receipt,) = q.leases     # the reply is not out yet: only the broker itself could know the receipt
        acked = d.ask("ack", queue="jobs", receipt=receipt)
        d.shard.commit()
        assert pushed == [] and got == [] and acked == []
        assert len(q.messages) == 1 and d.journal.dirty
        d.free()
        d.shard.commit()
        assert pushed[0]["ok"] and got[0]["messages"][0][3] == b"a" and acked == [{"ok": True}]
        again = d.replayed().queue("jobs")
        assert [m[3] for m in again.messages.values()] == [b"b"]
        d.close()
    run(body)


@pytestmark_unit
def test_dead_letters_are_kept_not_undone(tmp_path):
    """A nack that dead-letters (a requeue's twin: a ``dead`` and a DLQ ``push`` with a reason) is not a client
    push: it is kept and written later, never dropped."""
    def body():
        d = Disk(str(tmp_path / "j"))
        d.shard.settings = Settings(max_deliveries=1)
        d.turn(push(b"m"))
        (got,) = d.turn(("recv", {"queue": "jobs", "max": 1}))
        d.full()
        (nacked,) = d.turn(("nack", {"queue": "jobs", "receipt": got[0]["messages"][0][D_RECEIPT]}))
        assert nacked == [] and len(d.shard.queue("jobs.dlq").messages) == 1
        d.free()
        d.shard.commit()
        assert nacked == [{"ok": True, "state": "dead"}]
        again = d.replayed()
        assert not again.queue("jobs").messages and len(again.queue("jobs.dlq").messages) == 1
        d.close()
    run(body)


# -- the real broker on a full filesystem -----------------------------------------------------------------------
def nats_request(port: int, subject: str, payload: bytes, timeout: float = 5.0) -> dict:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        f = s.makefile("rb")
        f.readline()   # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\nSUB _r 1\r\nPUB %s _r %d\r\n%s\r\nPING\r\n' % (
            subject.encode(), len(payload), payload))
        while True:
            line = f.readline()
            if line.startswith(b"MSG"):
                n = int(line.split()[-1])
                return json.loads(f.read(n + 2)[:n])
            assert line in (b"PONG\r\n", b"+OK\r\n"), line


@pytest.mark.parametrize("how", ["tmpfs", "fsize"])
def test_a_full_journal_disk_refuses_pushes_and_loses_nothing(tmp_path, how):
    """ENOSPC from a full tmpfs, or EFBIG past RLIMIT_FSIZE (the workers ignore SIGXFSZ, as Python does): the
    push that does not fit is cut back out of the file, undone, and refused; the others are kept."""
    if how == "tmpfs" and (shutil.which("mount") is None or os.geteuid() != 0):
        pytest.skip("mounting a tmpfs needs root")
    if how == "fsize" and shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    size_kib = 128
    body = "x" * 4000
    with small_disk(size_kib, mount=how == "tmpfs") as (path, mounted):
        if how == "tmpfs" and not mounted:
            pytest.skip("no tmpfs could be mounted here")
        config = {"queues": {"data_dir": os.path.join(path, "q"), "fsync": "no"}}
        prefix = [] if mounted else ["prlimit", f"--fsize={size_kib * 1024}:unlimited", "--"]
        b = Broker(tmp_path, workers=2, config=config, prefix=prefix).start()
        try:
            with on_worker(b.port, 0) as c:
                owner = c.request({"op": "qstat", "queue": "jobs"})["stat"]["owner"]
            other = 1 - owner
            acked, refused = 0, None
            with on_worker(b.port, owner) as c, on_worker(b.port, other) as far, \
                    on_worker(b.port, owner) as sub, on_worker(b.port, owner) as pub:
                assert sub.request({"op": "sub", "topic": "still.flowing"}) == {"ok": True}
                for i in range(4 * size_kib * 1024 // len(body)):
                    reply = c.request({"op": "qpush", "queue": "jobs", "data": {"n": i, "pad": body}})
                    if not reply["ok"]:
                        refused = reply
                        break
                    acked += 1
                assert refused == REFUSED, refused          # answered at once, not held
                # from another worker (a token, over the fabric), over NATS, and on the command line: refused
                assert far.request({"op": "qpush", "queue": "jobs", "data": {"pad": body}, "id": 7}) == \
                    dict(REFUSED, id=7)
                assert nats_request(b.ports["nats"], "$Q.PUSH.jobs", json.dumps({"pad": body}).encode()) == \
                    REFUSED
                cli = subprocess.run([sys.executable, "-m", "shardbroker.cli", "queue", "push", "-p", str(b.port), "jobs",
                                      body], capture_output=True, text=True, timeout=30,
                                     cwd=REPO)
                assert cli.returncode != 0 and "journal_unavailable (retry later)" in cli.stderr, cli
                # nothing refused is kept; pub/sub on that worker goes on
                stat = c.request({"op": "qstat", "queue": "jobs"})["stat"]
                assert stat["messages"] == acked and stat["pushed"] == acked
                assert pub.request({"op": "pub", "topic": "still.flowing", "data": 1}) == {"ok": True}
                assert sub.json(timeout=5)["data"] == 1
            # counted where an operator looks: the owner's /varz entry and /metrics (the four refusals above)
            refusals = {w["worker"]: w["journal_refused"] for w in b.varz()["workers"]}
            assert refusals == {owner: 4, other: 0}, refusals
            with urllib.request.urlopen(f"http://127.0.0.1:{b.ports['monitoring']}/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            assert f'shardbroker_workqueue_journal_refused_requests_total{{worker="{owner}"}} 4.0' in metrics
            # the owner killed while the disk is full: its replacement replays the journal (and compacts it, if
            # that fits: else logged, the journal kept) and has every acknowledged push
            with on_worker(b.port, owner) as c:
                pid = c.request({"op": "info"})["info"]["pid"]
            os.kill(pid, signal.SIGKILL)
            b.wait_log(rf"worker {owner} is back", timeout=20)
            with on_worker(b.port, owner) as c:
                assert c.request({"op": "qstat", "queue": "jobs"})["stat"]["messages"] == acked
                for _ in range(4 * size_kib * 1024 // len(body)):   # its compaction at start may free a little
                    reply = c.request({"op": "qpush", "queue": "jobs", "data": {"pad": body}})
                    if not reply["ok"]:
                        break
                    acked += 1
                assert reply == REFUSED, reply
                # space freed: pushes are stored again
                free_space(b, path, mounted, size_kib)
                assert c.request({"op": "qpush", "queue": "jobs", "data": "after"})["ok"]
                acked += 1
            assert "work-queue journal: " in b.log() and "written again" in b.log()
        finally:
            b.close()
        # a new broker on the same journal: exactly what was acknowledged, and a journal that ends cleanly
        b2 = Broker(tmp_path, workers=2, config=config).start()
        try:
            with on_worker(b2.port, owner) as c:
                stat = c.request({"op": "qstat", "queue": "jobs"})["stat"]
            assert stat["messages"] == acked
            assert "truncating" not in b2.log()
        finally:
            b2.close()
