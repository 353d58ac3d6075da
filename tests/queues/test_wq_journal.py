"""The work-queue journal's file format, without a broker: round trips, group commit, torn tails, compaction."""

import errno
import glob
import itertools
import logging
import marshal
import os
import stat
import struct
import zlib

import pytest

from shardbroker.workers.workqueues import journal as jmod
from shardbroker.workers.workqueues import journal_codec, journal_disk
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.messages import D_ID, D_RECEIPT, DATA, MS, SEQ
from shardbroker.workers.workqueues.rules import Settings

RECORDS = [
    ("orders", ("push", 1, "aWQtMQ==", b"\x00hello\xff" * 3, 4, 1_700_000_000_000_000_000, 0, 0, "", "", 0)),
    ("orders", ("lease", 1, os.urandom(16), 123_456_789, 30_123_456_789, 30_000, 1_700_000_000_000_000_001)),
    ("orders", ("deadline", b"r" * 16, 2 ** 62)),
    ("caf\u00e9.\u2603", ("push", 7, "x", b"", 9, 1, 5, 3, "max_deliveries", "orders", 2)),
    ("orders", ("requeue", b"r" * 16, 0)),
    ("orders", ("take", [1, 2, 3])),
    ("orders.dlq", ("dead", 7, "terminated")),
    ("orders", ("ack", b"\x01" * 16)),
    ("orders", ("purge",)),
    ("misc", ("weird", None, -1, 2 ** 100, [b"a", ("nested", [None])], ())),
]


def write(path, records, **kwargs):
    """One commit per record: a file of single records (a turn's several records are one batch record)."""
    j = Journal(str(path), **kwargs)
    for queue, record in records:
        j.append(queue, record)
        j.commit()
    j.close()


def replay(path):
    j = Journal(str(path))
    try:
        return list(j.replay())
    finally:
        j.close()


def test_round_trip(tmp_path):
    path = tmp_path / "j"
    write(path, RECORDS)
    got = replay(path)
    assert got == RECORDS
    # Types survive exactly: tuples stay tuples, lists lists, bytes bytes.
    assert type(got[5][1][1]) is list and type(got[9][1][4][1]) is tuple and type(got[0][1][3]) is bytes


def test_on_disk_format(tmp_path):
    path = tmp_path / "j"
    write(path, RECORDS[:2])
    raw = path.read_bytes()
    n, crc = struct.unpack_from("<II", raw, 0)
    body = raw[8:8 + n]
    assert zlib.crc32(body) == crc
    assert marshal.loads(body) == RECORDS[0]
    assert raw[:8 + n] == journal_codec.encode(*RECORDS[0])
    assert len(raw) == sum(len(journal_codec.encode(q, r)) for q, r in RECORDS[:2])


def test_file_created_private(tmp_path):
    path = tmp_path / "j"
    Journal(str(path)).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_nothing_written_before_commit(tmp_path):
    path = tmp_path / "j"
    j = Journal(str(path))
    assert not j.dirty and j.size == 0
    for queue, record in RECORDS:
        j.append(queue, record)
    assert j.dirty
    assert j.size == 0 and os.path.getsize(path) == 0
    assert list(j.replay()) == []          # the file, not the buffer
    j.commit()
    assert not j.dirty
    assert j.size == os.path.getsize(path) > 0
    j.commit()                             # nothing buffered: nothing written
    assert j.size == os.path.getsize(path)
    assert list(j.replay()) == RECORDS
    j.close()


def test_commit_is_one_write(tmp_path, monkeypatch):
    path = tmp_path / "j"
    j = Journal(str(path))
    calls = []
    real = journal_disk.write
    monkeypatch.setattr(journal_disk, "write", lambda fd, data: calls.append(len(data)) or real(fd, data))
    for queue, record in RECORDS:
        j.append(queue, record)
    j.commit()
    assert calls == [os.path.getsize(path)]
    j.close()


def test_partial_writes_are_continued(tmp_path, monkeypatch):
    path = tmp_path / "j"
    j = Journal(str(path))
    real = journal_disk.write
    monkeypatch.setattr(journal_disk, "write", lambda fd, data: real(fd, bytes(data[:7])))
    for queue, record in RECORDS:
        j.append(queue, record)
    j.commit()
    monkeypatch.undo()
    j.close()
    assert replay(path) == RECORDS


def test_failed_commit_leaves_a_clean_file_and_retries(tmp_path, monkeypatch):
    path = tmp_path / "j"
    j = Journal(str(path))
    j.append(*RECORDS[0])
    j.commit()
    good = os.path.getsize(path)
    real = journal_disk.write
    state = {"n": 0}

    def flaky(fd, data):
        state["n"] += 1
        if state["n"] == 1:
            return real(fd, bytes(data[:5]))   # part of a record, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_disk, "write", flaky)
    for queue, record in RECORDS[1:]:
        j.append(queue, record)
    with pytest.raises(OSError):
        j.commit()
    assert os.path.getsize(path) == good == j.size
    assert j.dirty
    monkeypatch.undo()
    j.commit()
    j.close()
    assert replay(path) == RECORDS


def _last_record_offset(path, count):
    raw = path.read_bytes()
    offset = 0
    for _ in range(count - 1):
        n, _ = struct.unpack_from("<II", raw, offset)
        offset += 8 + n
    return offset, len(raw)


@pytest.mark.parametrize("keep", [1, 4, 7, 8, 9, 20, -1])
def test_torn_tail_is_truncated(tmp_path, caplog, keep):
    path = tmp_path / "j"
    write(path, RECORDS)
    start, end = _last_record_offset(path, len(RECORDS))
    cut = start + keep if keep >= 0 else end - 1
    with open(path, "r+b") as f:
        f.truncate(cut)
    j = Journal(str(path))
    with caplog.at_level(logging.WARNING, logger="broker.journal"):
        assert list(j.replay()) == RECORDS[:-1]
    assert f"at byte {start} " in caplog.text
    assert os.path.getsize(path) == start == j.size
    # Appends after the cut follow the last good record.
    j.append("after", ("push", 99, "z", b"new", 0, 0, 0, 0, "", "", 0))
    j.commit()
    j.close()
    caplog.clear()
    assert replay(path) == RECORDS[:-1] + [("after", ("push", 99, "z", b"new", 0, 0, 0, 0, "", "", 0))]
    assert "truncating" not in caplog.text


@pytest.mark.parametrize("where", ["length", "crc", "body_first", "body_last"])
def test_corrupt_last_record_is_truncated(tmp_path, caplog, where):
    path = tmp_path / "j"
    write(path, RECORDS)
    start, end = _last_record_offset(path, len(RECORDS))
    at = {"length": start, "crc": start + 5, "body_first": start + 8, "body_last": end - 1}[where]
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    j = Journal(str(path), fsync="always")
    with caplog.at_level(logging.WARNING, logger="broker.journal"):
        assert list(j.replay()) == RECORDS[:-1]
    assert f"at byte {start} " in caplog.text
    assert os.path.getsize(path) == start == j.size
    j.append(*RECORDS[-1])
    j.commit()
    j.close()
    assert replay(path) == RECORDS


def test_corruption_in_the_middle_drops_the_rest(tmp_path, caplog):
    path = tmp_path / "j"
    write(path, RECORDS)
    start, _ = _last_record_offset(path, 4)
    raw = bytearray(path.read_bytes())
    raw[start + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="broker.journal"):
        assert replay(path) == RECORDS[:3]
    assert "checksum mismatch" in caplog.text
    assert os.path.getsize(path) == start


def test_valid_crc_but_undecodable_body_stops(tmp_path, caplog):
    path = tmp_path / "j"
    write(path, RECORDS[:2])
    good = os.path.getsize(path)
    body = b"\xff\xfe not marshal"
    with open(path, "ab") as f:
        f.write(struct.pack("<II", len(body), zlib.crc32(body)) + body)
        f.write(struct.pack("<II", 0, 0))   # an empty body: not a record either
    with caplog.at_level(logging.WARNING, logger="broker.journal"):
        assert replay(path) == RECORDS[:2]
    assert "undecodable" in caplog.text
    assert os.path.getsize(path) == good


def test_reopen_appends_after_existing_records(tmp_path):
    path = tmp_path / "j"
    write(path, RECORDS[:3])
    j = Journal(str(path))
    assert j.size == os.path.getsize(path)
    assert list(j.replay()) == RECORDS[:3]
    for queue, record in RECORDS[3:]:
        j.append(queue, record)
    j.close()                               # close commits
    assert replay(path) == RECORDS


def test_replay_across_read_chunks(tmp_path, monkeypatch):
    """Records straddling the reader's chunk boundaries, and records bigger than a chunk."""
    path = tmp_path / "j"
    records = [("q", ("push", i, str(i), os.urandom(i * 7 % 300), 0, i, 0, 0, "", "", 0)) for i in range(500)]
    records.insert(250, ("q", ("push", 1000, "big", os.urandom(3 << 20), 0, 0, 0, 0, "", "", 0)))
    write(path, records)
    assert replay(path) == records
    monkeypatch.setattr(journal_disk, "CHUNK", 37)
    assert replay(path) == records


def test_rewrite_replaces_contents_and_appending_continues(tmp_path):
    path = tmp_path / "j"
    j = Journal(str(path))
    for queue, record in RECORDS:
        j.append(queue, record)
    j.commit()
    before = j.size
    live = RECORDS[:2]
    j.rewrite(iter([live]))
    assert glob.glob(str(path) + ".*") == []   # no file of the rewrite left beside it
    assert j.size == os.path.getsize(path) < before
    assert list(j.replay()) == live
    assert replay(path) == live            # what a fresh worker would see
    j.append(*RECORDS[2])
    j.commit()
    assert j.size == os.path.getsize(path)
    j.close()
    assert replay(path) == RECORDS[:3]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_rewrite_to_nothing(tmp_path):
    path = tmp_path / "j"
    write(path, RECORDS)
    j = Journal(str(path))
    j.rewrite([])
    assert j.size == 0 == os.path.getsize(path)
    j.close()
    assert replay(path) == []


def test_rewrite_large_in_chunks(tmp_path):
    path = tmp_path / "j"
    j = Journal(str(path))
    records = [("q%d" % (i % 3), ("push", i, str(i), b"x" * 1000, 0, i, 0, 0, "", "", 0)) for i in range(3000)]
    j.rewrite(records[i:i + 1024] for i in range(0, len(records), 1024))
    j.close()
    assert replay(path) == records


def test_failed_rewrite_keeps_the_old_journal(tmp_path, monkeypatch):
    path = tmp_path / "j"
    j = Journal(str(path))
    for queue, record in RECORDS:
        j.append(queue, record)
    j.commit()

    def broken():
        yield RECORDS[:1]
        raise RuntimeError("snapshot failed")

    with pytest.raises(RuntimeError):
        j.rewrite(broken())
    assert glob.glob(str(path) + ".*") == []
    with pytest.raises(ValueError):
        j.rewrite([[("q", ("push", object()))]])   # marshal cannot encode it
    assert glob.glob(str(path) + ".*") == []

    def failing_disk(fd):   # the rewritten file's sync, in its flush
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", failing_disk)
        with pytest.raises(OSError, match="Input/output"):
            j.rewrite([RECORDS[:1]])
    assert glob.glob(str(path) + ".*") == [] and not j.rewriting
    assert list(j.replay()) == RECORDS
    j.append(*RECORDS[0])
    j.close()
    assert replay(path) == RECORDS + RECORDS[:1]


def test_rewrite_refuses_uncommitted_records(tmp_path):
    j = Journal(str(tmp_path / "j"))
    j.append(*RECORDS[0])
    with pytest.raises(AssertionError):
        j.rewrite([RECORDS])
    j.close()


def test_rewrite_over_a_stale_tmp(tmp_path):
    path = tmp_path / "j"
    (tmp_path / "j.tmp").write_bytes(b"left over by a crash during compaction")
    j = Journal(str(path))
    j.rewrite([RECORDS[:2]])
    j.close()
    assert replay(path) == RECORDS[:2]


# -- compaction while serving -------------------------------------------------------------------------------------
def _finish(j):
    """Write the rewrite's batches, flush them, then put it in place (what the shard does a step per turn)."""
    assert j.rewriting
    j.complete_rewrite()
    assert not j.rewriting


def _committed(path, records=RECORDS, durable=True):
    """A journal open on ``path`` with ``records`` committed as one turn."""
    j = Journal(str(path), durable=durable)
    for queue, record in records:
        j.append(queue, record)
    j.commit()
    return j


@pytest.mark.parametrize("durable", [True, False])
def test_a_rewrite_while_serving_keeps_what_was_appended_while_it_ran(tmp_path, monkeypatch, durable):
    path = tmp_path / "j"
    j = _committed(path, durable=durable)
    before = j.size
    live = RECORDS[:2]
    j.start_rewrite([live[:1], [], live[1:]])
    assert j.rewriting and not j.rewrite_written and not j.finish_rewrite()
    assert not j.rewrite_step()                            # one batch written
    j.append(*RECORDS[2])
    j.commit()
    assert not j.rewrite_step() and not j.rewrite_step()   # the empty batch, the last one
    assert j.rewrite_step()                                # nothing left
    flush = j.rewrite_flush()        # fsynced (durable) or its writeback started, in a thread by the shard
    assert not j.rewrite_written and not j.finish_rewrite()
    synced, written_back = [], []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(journal_disk, "writeback", lambda fd, offset, length, advice: written_back.append(advice))
    flush()
    assert (len(synced), written_back) == ((1, []) if durable else (0, [os.POSIX_FADV_DONTNEED]))
    assert j.rewrite_written and j.rewrite_flush() is None
    j.append(*RECORDS[3])
    assert not j.finish_rewrite() and j.rewriting          # not with records buffered
    j.commit()
    assert j.finish_rewrite()
    assert not j.rewriting and glob.glob(str(path) + ".rewrite-*") == []
    assert j.size == os.path.getsize(path) < before + 1000
    assert replay(path) == live + RECORDS[2:4]             # the state at the start, then what came after
    j.append(*RECORDS[4])
    j.close()
    assert replay(path) == live + RECORDS[2:5]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("mode", ["everysec", "always"])
def test_a_rewrite_while_serving_syncs_in_the_event_loop_only_for_always(tmp_path, monkeypatch, syncs, mode):
    """The flush (run in a thread by the shard) copies what the journal gained since the start and fsyncs the
    rewrite's file; ``finish_rewrite`` copies only what came meanwhile and renames.  With ``always`` it fsyncs
    the file and the directory there, before the next reply; with ``everysec`` it fsyncs nothing, and the next
    sync (in the syncer's thread) syncs the file, then the directory."""
    import threading

    calls, clock = syncs
    path = tmp_path / "j"
    j = Journal(str(path), fsync=mode)
    j.append(*RECORDS[0])
    j.commit()
    if j._syncer is not None:
        j._syncer.wait()
    start = j.size
    j.start_rewrite([RECORDS[:1]])
    j.append(*RECORDS[1])
    j.commit()                                          # gained since the start: the flush copies it
    assert not j.rewrite_step() and j.rewrite_step()
    flush, at_flush = j.rewrite_flush(), j.size
    j.append(*RECORDS[2])
    j.commit()                                          # gained during the flush: the finish copies it
    fsyncs, dirs, copies = [], [], []
    here = threading.current_thread().name
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(threading.current_thread().name))
    monkeypatch.setattr(journal_disk, "sync_dir", lambda d: dirs.append((d, threading.current_thread().name)))
    real_copy = journal_disk.copy
    monkeypatch.setattr(journal_disk, "copy", lambda src, a, b, fd: (copies.append((a, b)), real_copy(src, a, b, fd)))
    flusher = threading.Thread(target=flush, name="flush")
    flusher.start()
    flusher.join()
    assert fsyncs == ["flush"] and copies == [(start, at_flush)]
    del calls[:]
    assert j.finish_rewrite()
    assert copies == [(start, at_flush), (at_flush, j.size)]
    assert replay(path) == RECORDS[:3]
    if mode == "always":
        assert fsyncs == ["flush", here] and dirs == [(str(tmp_path), here)]
    else:
        assert fsyncs == ["flush"] and dirs == [] and calls == []
        j.append(*RECORDS[3])
        j.commit()                                      # within the second of the last sync: not yet
        j._syncer.wait()
        assert calls == [] and dirs == []
        failure = [OSError(errno.EIO, "Input/output error")]

        def sync(fd):
            if failure:
                raise failure.pop()
            calls.append(fd)

        monkeypatch.setattr(journal_disk, "sync", sync)
        clock[0] += 1.0
        j.tick()                                        # a sync that fails: its directory is not synced either
        j._syncer.wait()
        with pytest.raises(OSError, match="Input/output"):
            j.tick()
        assert calls == [] and dirs == []
        j.tick()                                        # the new file, then the directory, in the syncer's thread
        j._syncer.wait()
        assert len(calls) == 1 and dirs == [(str(tmp_path), "journal-fsync")]
    j.close()
    assert replay(path) == RECORDS[:3 if mode == "always" else 4]


def test_a_failed_rewrite_while_serving_keeps_the_old_journal(tmp_path):
    path = tmp_path / "j"
    j = _committed(path)

    def full_disk():
        yield RECORDS[:1]
        raise OSError(errno.ENOSPC, "No space left on device")

    j.start_rewrite(full_disk())
    assert not j.rewrite_step()
    with pytest.raises(OSError) as failed:
        j.rewrite_step()
    assert failed.value.errno == errno.ENOSPC
    assert not j.rewriting and glob.glob(str(path) + ".rewrite-*") == []
    j.start_rewrite([[("q", ("push", object()))]])         # marshal cannot encode it
    with pytest.raises(ValueError):
        j.rewrite_step()
    assert not j.rewriting and glob.glob(str(path) + ".rewrite-*") == []
    j.append(*RECORDS[0])
    j.close()
    assert replay(path) == RECORDS + RECORDS[:1]


def test_close_stops_a_rewrite_and_a_new_journal_clears_a_stale_one(tmp_path):
    path = tmp_path / "j"
    j = _committed(path, RECORDS[:1])
    j.start_rewrite(itertools.repeat(RECORDS[1:2]))
    for _ in range(3):
        assert not j.rewrite_step()
    assert glob.glob(str(path) + ".rewrite-*")
    j.close()
    assert glob.glob(str(path) + ".rewrite-*") == []
    (tmp_path / "j.rewrite-12345").write_bytes(b"left by a worker killed while it rewrote its journal")
    assert replay(path) == RECORDS[:1]
    assert glob.glob(str(path) + ".rewrite-*") == []


def test_path_none_is_off(tmp_path):
    j = Journal(None)
    for queue, record in RECORDS:
        j.append(queue, record)
    assert not j.dirty
    j.commit()
    j.tick()
    assert list(j.replay()) == []
    j.rewrite([RECORDS])
    assert j.size == 0
    j.close()
    j.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["no", "everysec", "always"])
def test_fsync_modes_accepted(tmp_path, mode):
    path = tmp_path / "j"
    write(path, RECORDS, fsync=mode)
    assert replay(path) == RECORDS


@pytest.mark.parametrize("mode", ["", "yes", "Always", "every_sec", None, 1])
def test_bad_fsync_mode(tmp_path, mode):
    with pytest.raises(ValueError):
        Journal(str(tmp_path / "j"), fsync=mode)
    assert not (tmp_path / "j").exists()


@pytest.fixture
def syncs(monkeypatch):
    """Count fsyncs and drive the journal's clock by hand."""
    calls = []
    clock = [1000.0]
    monkeypatch.setattr(journal_disk, "sync", lambda fd: calls.append(fd))
    monkeypatch.setattr(journal_disk, "monotonic", lambda: clock[0])
    return calls, clock


def test_fsync_always(tmp_path, syncs):
    calls, _ = syncs
    j = Journal(str(tmp_path / "j"), fsync="always")
    for i in range(3):
        j.append(*RECORDS[i])
        j.commit()
    j.commit()           # nothing to write, nothing to sync
    j.tick()
    assert len(calls) == 3
    j.close()
    assert len(calls) == 3


def test_fsync_no(tmp_path, syncs):
    calls, clock = syncs
    j = Journal(str(tmp_path / "j"), fsync="no")
    for i in range(3):
        j.append(*RECORDS[i])
        j.commit()
        clock[0] += 5
        j.tick()
    j.close()
    assert calls == []


def test_fsync_everysec(tmp_path, syncs):
    """At most one fsync a second, from a commit or from the owner's tick, each in the journal's thread
    (``_Syncer``): ``synced`` waits for it before counting."""
    calls, clock = syncs
    j = Journal(str(tmp_path / "j"), fsync="everysec")

    def synced() -> int:
        j._syncer.wait()
        return len(calls)

    j.append(*RECORDS[0])
    j.commit()
    assert synced() == 1               # the first commit syncs
    for _ in range(5):                  # within the second: none
        clock[0] += 0.1
        j.append(*RECORDS[1])
        j.commit()
    assert synced() == 1
    clock[0] += 0.5                     # 1.0 s after the last fsync: this commit syncs
    j.append(*RECORDS[2])
    j.commit()
    assert synced() == 2
    j.tick()                            # nothing written since
    assert synced() == 2
    clock[0] += 0.2
    j.append(*RECORDS[3])
    j.commit()
    assert synced() == 2
    j.tick()                            # the owner's once-a-second timer syncs the rest
    assert synced() == 3
    j.tick()
    assert synced() == 3
    clock[0] += 0.3
    j.append(*RECORDS[4])
    j.commit()                          # 0.3 s after tick's fsync: not yet
    assert synced() == 3
    j.close()                           # close syncs what is unsynced
    assert len(calls) == 4


def test_an_everysec_fsync_holds_up_no_commit_and_its_failure_is_raised_by_the_next(tmp_path, monkeypatch, caplog):
    """A sync under way (a slow disk) lets commits go on, writing and returning, and no second sync starts until it
    is done (one under way for 2 s is logged, once); a sync that fails is raised by the next commit (after that
    commit's records are written, as a failing sync of its own would), and the one after that syncs again."""
    import threading
    import time

    clock = [1000.0]
    monkeypatch.setattr(journal_disk, "monotonic", lambda: clock[0])
    release = threading.Event()
    started = []
    outcome = [None]

    def slow_sync(fd):
        started.append(fd)
        assert release.wait(10)
        if outcome[0] is not None:
            raise outcome[0]

    monkeypatch.setattr(journal_disk, "sync", slow_sync)
    path = tmp_path / "j"
    j = Journal(str(path), fsync="everysec")
    j.append(*RECORDS[0])
    j.commit()                          # starts the first sync, which hangs
    deadline = time.monotonic() + 10
    while not started:                  # (once its thread is running)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with caplog.at_level(logging.WARNING, logger="broker.journal"):
        for i in (1, 2, 3):
            clock[0] += 1.0             # due again, but one is under way
            j.append(*RECORDS[i])
            j.commit()
            j.tick()
    assert replay(path) == RECORDS[:4] and len(started) == 1
    slow = [r.getMessage() for r in caplog.records if "still under way" in r.getMessage()]
    assert len(slow) == 1 and "begun 2 s ago" in slow[0], slow
    outcome[0] = OSError(errno.EIO, "Input/output error")
    release.set()
    j._syncer.wait()
    j.append(*RECORDS[4])
    with pytest.raises(OSError, match="Input/output"):
        j.commit()                      # the failed sync's error, this commit's record written all the same
    assert not j.dirty and replay(path) == RECORDS[:5]
    outcome[0] = None
    clock[0] += 1.0
    j.tick()                            # and the next sync goes ahead
    j._syncer.wait()
    assert len(started) == 2
    j.close()


def test_an_everysec_journal_keeps_room_allocated_past_its_end_and_gives_it_back_at_close(tmp_path, syncs):
    """Before each sync the syncer's thread allocates twice what was written since the last one (at least
    ``RESERVE_MIN``) past the end, so that appends meanwhile find their blocks there (ext4 makes an append that
    allocates wait for a sync's writeback); the file's size and records are untouched, and close frees the room."""
    _, clock = syncs
    path = tmp_path / "j"

    def room() -> int:
        j._syncer.wait()
        st = os.stat(path)
        assert st.st_size == j.size
        return st.st_blocks * 512 - st.st_size

    j = Journal(str(path), fsync="everysec")
    j.append(*RECORDS[0])
    j.commit()                                  # the first sync: the least room
    if journal_disk.fallocate is None:
        j.close()
        pytest.skip("no fallocate(2) with FALLOC_FL_KEEP_SIZE for this directory's filesystem")
    assert room() >= jmod.RESERVE_MIN
    big = ("misc", ("weird", b"x" * (3 << 20)))
    j.append(*big)
    j.commit()                                  # within the second: no sync; the room shrinks by 3 MiB
    clock[0] += 1.0
    j.tick()                                    # less than half of twice the 3 MiB written since is left: 6 MiB more
    assert room() >= 6 << 20
    assert replay(path) == [RECORDS[0], big]
    j.close()
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size + (64 << 10)
    j = Journal(str(path), fsync="everysec")     # a journal that had room past its end goes on where its records end
    j.append(*RECORDS[1])
    j.close()
    assert replay(path) == [RECORDS[0], big, RECORDS[1]]


def test_close_commits_and_is_idempotent(tmp_path):
    path = tmp_path / "j"
    j = Journal(str(path))
    j.append(*RECORDS[0])
    j.close()
    j.close()
    assert replay(path) == RECORDS[:1]
    j.append(*RECORDS[1])
    with pytest.raises(ValueError):
        j.commit()


def test_an_unencodable_record_is_left_out_and_the_turn_written(tmp_path, caplog):
    path = tmp_path / "j"
    j = Journal(str(path))
    j.append(*RECORDS[0])
    j.append("q", ("push", object()))
    j.append(*RECORDS[1])
    j.commit()
    assert not j.dirty
    j.close()
    assert replay(path) == RECORDS[:2]
    assert "cannot be encoded" in caplog.text


def test_a_turn_of_several_records_is_one_batch_record(tmp_path, caplog):
    """Several records committed together are one body on disk, replayed as the records; torn, the whole turn
    goes (none of its replies had been sent) and the turns before it stay."""
    path = tmp_path / "j"
    j = Journal(str(path))
    j.append(*RECORDS[0])
    j.commit()
    single = os.path.getsize(path)
    for queue, record in RECORDS[1:]:
        j.append(queue, record)
    j.commit()
    j.close()
    raw = path.read_bytes()
    n, crc = struct.unpack_from("<II", raw, single)
    assert single + 8 + n == len(raw)                               # one record for the nine
    assert marshal.loads(raw[single + 8:]) == ("", ("batch", RECORDS[1:]))
    assert replay(path) == RECORDS
    with open(path, "r+b") as fh:
        fh.truncate(len(raw) - 1)
    with caplog.at_level(logging.WARNING):
        assert replay(path) == RECORDS[:1]
    assert os.path.getsize(path) == single


def test_a_journal_from_another_boot_ends_leases_and_keeps_delays_by_the_wall_clock(tmp_path):
    """A kept data_dir replayed after a reboot: monotonic deadlines of the old boot mean nothing."""
    import asyncio
    import time

    from shardbroker.workers.workqueues.shard import Shard

    path = str(tmp_path / "q.journal")

    async def write_then_replay():
        journal = Journal(path)
        shard = Shard(0, Settings(), journal, lambda: None, 256)
        shard.replay()
        q = shard.queue("jobs")
        now, wall = time.monotonic_ns(), time.time_ns()
        q.push(0, b"leased", 4, now, wall, 0)
        q.push(0, b"delayed", 4, now, wall, 60_000)          # due in a minute
        [lease] = q.lease(now, 1, 3_600_000, None)           # an hour's lease (one delivery: D_* tuple)
        journal.commit()
        # the same journal as if written on another boot of the machine
        journal.close()
        records = list(Journal(path).replay())
        rewritten = Journal(str(tmp_path / "other.journal"))
        for name, record in records:
            if not name:
                record = ("clock", "another-boot", record[2], record[3])
            rewritten.append(name, record)
        rewritten.commit()
        rewritten.close()
        fresh = Shard(0, Settings(), Journal(str(tmp_path / "other.journal")), lambda: None, 256)
        fresh.replay()
        return fresh.queue("jobs"), lease[D_RECEIPT]

    q, receipt = asyncio.run(write_then_replay())
    assert q.in_flight == 0 and q.visible == 1 and q.delayed == 1
    msg = next(m for m in q.messages.values() if m[DATA] == b"leased")
    assert q.deliveries[msg[SEQ]] == 1                       # the lease ended, its delivery counted
    assert q.state(msg[SEQ]) == "visible"
    delayed = next(m for m in q.messages.values() if m[DATA] == b"delayed")
    left_ms = (q.delay_at[delayed[SEQ]] - time.monotonic_ns()) // MS
    assert 50_000 < left_ms <= 60_000                        # still about a minute, by the wall clock
    assert receipt not in q.leases


def _state(q, counters=True):
    """What a queue holds, comparable across a replay (leases by receipt, without their holder; the counters
    only where every record was replayed: a snapshot starts them again from what it holds)."""
    return (dict(q.messages), list(q._ready.peek(10 ** 9)), dict(q.delay_at), dict(q.deliveries),
            {r: lease[:4] for r, lease in q.leases.items()}, dict(q.leased), q.bytes, q.next_seq,
            (q.pushed, q.delivered, q.redelivered, q.acked) if counters else ())


def test_batch_records_replay_to_the_same_queue(tmp_path):
    """``pushes``, ``leases`` and ``acks`` (one record per batch) rebuild the queue exactly, and so does the
    snapshot a compaction writes."""
    import asyncio
    import time

    from shardbroker.workers.workqueues.shard import Shard

    path = str(tmp_path / "q.journal")

    async def run():
        shard = Shard(0, Settings(), Journal(path), lambda: None, 256)
        shard.replay()
        q = shard.queue("jobs")
        now, wall = time.monotonic_ns(), time.time_ns()
        q.push_many([(0, b"m%d" % i, i % 10, 60_000 if i % 7 == 0 else 0) for i in range(100)], now, wall,
                    token=(1, 2, 3))
        q.push(1, b"single", 4, now, wall, 0)
        got = q.lease(now, 30, 30_000, None)
        q.ack_many([d[D_RECEIPT] for d in got[:20]], now)
        q.nack(got[20][D_RECEIPT], now, 0)
        q.extend(got[21][D_RECEIPT], now, 90_000)
        again = q.lease(now, 5, 30_000, None)                 # the nacked one comes back first: deliveries 2
        assert again[0][D_ID] == got[20][D_ID] and again[0][4] == 2
        shard.journal.commit()
        live = _state(q)
        assert len(q.tokens[(1, 2, 3)]) == 100              # a resent batch is known by its token
        replayed = Shard(0, Settings(), Journal(path), lambda: None, 256)
        replayed.replay()                                      # replays, then compacts (a snapshot)...
        assert replayed.journal.rewriting
        _finish(replayed.journal)                              # ... written in the background
        assert _state(replayed.queue("jobs")) == live
        again_replayed = Shard(0, Settings(), Journal(path), lambda: None, 256)
        again_replayed.replay()                                # from the snapshot this time
        assert _state(again_replayed.queue("jobs"), counters=False) == live[:-1] + ((),)
        assert again_replayed.queue("jobs").tokens.get((1, 2, 3)) == q.tokens[(1, 2, 3)]   # in the snapshot too
        # live receipts still work after both (what ended leases became is not in a snapshot: unknown now)
        assert replayed.queue("jobs").ack_many([got[0][D_RECEIPT]], now) == [{"ok": True, "already_acked": True}]
        q2 = again_replayed.queue("jobs")
        assert q2.ack_many([got[22][D_RECEIPT], got[0][D_RECEIPT]], now) == [
            {"ok": True}, {"ok": False, "error": "unknown_receipt"}]

    asyncio.run(run())


def test_rows_of_single_pushes_replay_together_to_the_same_queues(tmp_path, monkeypatch):
    """A replay stores a row of plain single pushes to one queue with one ``_store`` (as a batch push), and what
    breaks a row (another queue, a delay, a token, a dead letter's deliveries, a lease, a commit) is applied in
    its place: the queues come back as they were."""
    import asyncio
    import time

    from shardbroker.workers.workqueues import model
    from shardbroker.workers.workqueues.shard import Shard

    path = str(tmp_path / "q.journal")

    async def run():
        shard = Shard(0, Settings(), Journal(path), lambda: None, 256)
        shard.replay()
        jobs, mail = shard.queue("jobs"), shard.queue("mail")
        now, wall = time.monotonic_ns(), time.time_ns()
        for i in range(30):
            q = mail if i % 10 == 9 else jobs
            q.push(i % 2, b"m%d" % i, (i // 3) % 10, now, wall + i, 60_000 if i == 14 else 0,
                   token=(7, i) if i == 17 else None)
            if i == 20:
                jobs.lease(now, 2, 30_000, None)
            if i == 23:
                jobs.push(0, b"dead", 4, now, wall, 0, msg_id="x" * 16, deliveries=3, reason="max_deliveries",
                          source="jobs", redriven=1)
            if i % 8 == 0:
                shard.journal.commit()
        shard.journal.commit()
        live = {name: _state(q) for name, q in shard.queues.items()}
        stores = []
        store = model.Queue._store
        monkeypatch.setattr(model.Queue, "_store", lambda self, messages, ready_ats: (
            stores.append(len(messages)), store(self, messages, ready_ats))[-1])
        replayed = Shard(0, Settings(), Journal(path), lambda: None, 256)
        replayed.replay()
        assert {name: _state(q) for name, q in replayed.queues.items()} == live
        assert replayed.queue("jobs").tokens.get((7, 17)) == jobs.tokens.get((7, 17)) is not None   # its token
        assert sum(stores) == 31 and max(stores) > 4 and len(stores) < 20   # rows, not a store per push
        replayed.journal.close()

    asyncio.run(run())


def test_a_queue_forgotten_and_made_anew_replays_as_it_is(tmp_path):
    """A forgotten queue leaves no record: its old records replay it empty, and the new queue's records, whose
    numbers start again from 1, come after them and rebuild what it holds."""
    import asyncio

    from shardbroker.workers.workqueues.shard import Shard

    path = str(tmp_path / "q.journal")

    async def run():
        shard = Shard(0, Settings(), Journal(path), lambda: None, 256)
        shard.replay()
        box: list = []
        for i in range(3):
            shard.handle("push", {"queue": "jobs", "data": b"old%d" % i}, (0, 1), box.append)
        shard.handle("recv", {"queue": "jobs", "max": 3}, (0, 1), box.append)
        shard.commit()
        receipts = [m[D_RECEIPT] for m in box[-1]["messages"]]
        shard.handle("ack", {"queue": "jobs", "receipts": receipts}, (0, 1), box.append)
        shard.commit()
        shard._forget_idle()
        shard._forget_idle()
        assert "jobs" not in shard.queues
        for i in range(3):
            shard.handle("push", {"queue": "jobs", "data": b"new%d" % i}, (0, 1), box.append)
        shard.handle("recv", {"queue": "jobs", "max": 1}, (0, 1), box.append)
        shard.commit()
        live = shard.queues["jobs"]
        assert sorted(live.messages) == [1, 2, 3]                      # numbered from 1 again
        replayed = Shard(0, Settings(), Journal(path), lambda: None, 256)
        replayed.replay()
        again = replayed.queues["jobs"]
        assert _state(again)[:6] == _state(live)[:6] and again.bytes == live.bytes   # messages, order, leases
        replayed.handle("push", {"queue": "jobs", "data": b"next"}, (0, 1), box.append)
        assert len(again.messages) == 4                                 # a fresh number, nothing overwritten
        replayed.journal.close()

    asyncio.run(run())


def test_a_snapshot_rebuilds_the_queue_as_it_was_when_taken(tmp_path, monkeypatch):
    """A compaction while serving writes its batches over many turns: they rebuild the queue as it was when the
    snapshot was taken, whatever it did meanwhile.  Visible messages never leased are ``pushcol`` records where
    ``SNAPSHOT_PUSHCOL`` or more of them were pushed together, ``pushes`` records otherwise, the others one record
    each; a batch holds ``SNAPSHOT_RUN`` messages or about ``SNAPSHOT_BYTES`` of their data."""
    import asyncio
    import time

    from shardbroker.workers.workqueues import queue_snapshot
    from shardbroker.workers.workqueues.shard import Shard

    monkeypatch.setattr(queue_snapshot, "SNAPSHOT_RUN", 7)
    monkeypatch.setattr(queue_snapshot, "SNAPSHOT_BYTES", 300)
    monkeypatch.setattr(queue_snapshot, "SNAPSHOT_PUSHCOL", 3)

    async def run():
        shard = Shard(0, Settings(), Journal(str(tmp_path / "q.journal")), lambda: None, 256)
        shard.replay()
        q = shard.queue("jobs")
        now, wall = time.monotonic_ns(), time.time_ns()
        q.push_data(0, [b"p%d" % i for i in range(20)], 4, 0, now, wall)
        q.push_data(0, [b"p%d" % i for i in range(20, 40)], 4, 0, now, wall + 1)   # pushed later: another run
        q.push(0, b"x" * 250, 9, now, wall, 0)
        q.push(0, b"y" * 400, 2, now, wall, 0)
        q.push_data(0, [b"z" * 200] * 5, 5, 0, now, wall)
        q.push_data(0, [b"q%d" % i for i in range(20)], 6, 0, now, wall)
        q.push_many([(0, b"d%d" % i, 3, 60_000 if i % 2 else 0) for i in range(10)], now, wall)
        got = q.lease(now, 3, 30_000, None)                   # x, then two of priority 6
        q.nack(got[1][D_RECEIPT], now, 0)                     # visible again, with a delivery
        q.push(0, b"last", 4, now, wall, 0)
        shard.journal.commit()
        taken = _state(q, counters=False)
        batches = q.snapshot()
        snapshot = shard._snapshot()
        store = q.messages   # out of order (no store is: a guard), a batch of 1..7 without 2 is not range(1, 8)
        q.messages = {seq: store[seq] for seq in [1, 9, 3, 4, 5, 6, 7, 2, 8] + sorted(set(store) - set(range(10)))}
        reordered = shard._snapshot()
        q.messages = store
        # meanwhile: acks, receives, pushes
        q.ack_many([got[0][D_RECEIPT], got[2][D_RECEIPT]], now)
        q.lease(now, 30, 30_000, None)
        q.push_data(0, [b"r%d" % i for i in range(9)], 4, 0, now, wall)
        shard.journal.commit()
        batches = list(batches)
        for batch in batches:
            data = [d for r in batch for d in ([m[DATA] for m in r[2]] if r[0] == "pushes" else r[5]
                                               if r[0] == "pushcol" else [r[4]] if r[0] == "push" else [])]
            assert 1 <= len(data) <= 7
            assert sum(map(len, data)) - len(data[-1]) <= 300       # the message that crossed the bound ends it
            assert all(len(r[5]) >= 3 for r in batch if r[0] == "pushcol")
        kinds = {r[0] for batch in batches for r in batch}
        assert kinds == {"pushcol", "pushes", "push", "lease"}
        for name, batches in (("snapshot", snapshot), ("reordered", reordered)):
            rewritten = Journal(str(tmp_path / name))
            rewritten.rewrite(batches)
            rewritten.close()
            fresh = Shard(0, Settings(), Journal(str(tmp_path / name)), lambda: None, 256)
            fresh.replay()
            assert _state(fresh.queue("jobs"), counters=False) == taken, name

    asyncio.run(run())


def test_a_compaction_step_waits_for_the_end_of_a_turn(tmp_path, monkeypatch):
    """A rewrite's batches are written at the end of a turn (``Shard.turn_done``, which the hub calls once the
    turn's replies are out), one a turn: never by the turn's commit, which comes before the replies, nor by the
    event loop on its own, where it would run ahead of the next turn's replies."""
    import asyncio
    import time

    from shardbroker.workers.workqueues import queue_snapshot
    from shardbroker.workers.workqueues.shard import Shard

    monkeypatch.setattr(queue_snapshot, "SNAPSHOT_RUN", 10)

    async def run():
        flushes = []
        shard = Shard(0, Settings(), Journal(str(tmp_path / "q.journal")), lambda: flushes.append(1), 256)
        q = shard.queue("jobs")
        now, wall = time.monotonic_ns(), time.time_ns()
        q.push_data(0, [b"m%d" % i for i in range(50)], 4, 0, now, wall)
        shard.journal.commit()
        shard._start_rewrite()
        assert flushes, "a rewrite asks for a turn, so that it goes on with no client asking anything"
        rewrite = shard.journal._rewriting.fd
        sizes = []
        for _ in range(3):
            for _ in range(3):   # commits, and turns of the loop that end no turn of the hub's
                shard.commit()
                await asyncio.sleep(0)
                sizes.append(os.fstat(rewrite).st_size)
            shard.turn_done()
            sizes.append(os.fstat(rewrite).st_size)
        assert sizes[0] == sizes[1] == sizes[2] == 0, sizes
        assert 0 < sizes[3] == sizes[4] == sizes[5] == sizes[6] < sizes[7], sizes   # a batch a turn's end
        assert sizes[7] == sizes[8] == sizes[9] == sizes[10] < sizes[11], sizes
        deadline = time.monotonic() + 10
        while shard.journal.rewriting:
            assert time.monotonic() < deadline
            shard.commit()
            shard.turn_done()
            await asyncio.sleep(0.01)   # the durable journal's flush runs in a thread
        assert shard.compactions == 1

    asyncio.run(run())


def test_the_shard_compacts_a_batch_per_turn_and_keeps_the_journal_when_that_fails(tmp_path, monkeypatch, caplog):
    """``Shard._start_rewrite``: a step per turn of the event loop while the shard serves, each at the turn's end
    (``turn_done``, once its replies are out), the rewrite put in place by the end of the turn that finds it
    written (and synced, in a thread); a step or a sync that fails leaves the journal as it was, is logged, and the
    next compaction waits (``tick``)."""
    import asyncio
    import time

    from shardbroker.workers.workqueues import queue_snapshot
    from shardbroker.workers.workqueues.shard import Shard

    monkeypatch.setattr(queue_snapshot, "SNAPSHOT_RUN", 10)
    path = str(tmp_path / "q.journal")

    async def run():
        loop = asyncio.get_running_loop()
        turns = [0]

        def turn():   # what the hub's flush does: commit, the replies (none here), then the turn's end
            turns[0] += 1
            shard.commit()
            shard.turn_done()

        shard = Shard(0, Settings(), Journal(path), lambda: loop.call_soon(turn), 256)
        shard.replay()
        q = shard.queue("jobs")
        now, wall = time.monotonic_ns(), time.time_ns()
        q.push_data(0, [b"m%d" % i for i in range(100)], 4, 0, now, wall)
        q.ack_many([d[D_RECEIPT] for d in q.lease(now, 60, 30_000, None)], now)
        shard.journal.commit()
        live = _state(q, counters=False)
        shard._start_rewrite()
        deadline = time.monotonic() + 10
        pushed = 0
        while shard.journal.rewriting:                              # then synced in a thread (a durable journal)
            q.push_data(0, [b"n%d" % pushed], 4, 0, now, wall)     # a turn's push, journaled at its commit
            pushed += 1
            turn()   # (and the turns the shard asks for, which the loop runs meanwhile)
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        assert shard.compactions == 1 and turns[0] >= 5            # 40 live messages, 10 a batch, then the end
        fresh = Shard(0, Settings(), Journal(path), lambda: None, 256)
        fresh.replay()
        assert _state(fresh.queue("jobs"), counters=False) == _state(q, counters=False) != live

        async def compaction_fails_with(text):
            before = os.path.getsize(path)
            caplog.clear()
            with caplog.at_level(logging.ERROR):
                shard._start_rewrite()
                while shard.journal.rewriting:
                    assert time.monotonic() < deadline + 20
                    await asyncio.sleep(0)
            assert f"compaction failed: {text}" in caplog.text
            assert shard.compactions == 1 and shard._compact_after > time.monotonic() + 30
            assert os.path.getsize(path) == before and glob.glob(path + ".rewrite-*") == []

        def full_disk(fd, data):
            if fd != shard.journal._fd:
                raise OSError(errno.ENOSPC, "No space left on device")
            return os.write(fd, data)

        monkeypatch.setattr(journal_disk, "write", full_disk)
        await compaction_fails_with("No space left on device")
        monkeypatch.setattr(journal_disk, "write", os.write)

        def failing_disk(fd):   # the sync of a durable journal's rewrite, in its thread
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_disk)
        await compaction_fails_with("Input/output error")

    asyncio.run(run())


def test_records_of_older_journals_still_replay(tmp_path):
    """Journals written before receipts were kept as text (16-byte receipts in ``lease``, ``ack``, ``deadline``,
    ``requeue``) replay into the same queue."""
    import asyncio

    from shardbroker.workers.workqueues.receipts import receipt_text
    from shardbroker.workers.workqueues.shard import Shard

    path = str(tmp_path / "old.journal")
    r1, r2, r3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    records = [("jobs", ("push", seq, f"id{seq}", 0, b"d%d" % seq, 4, 1_700_000_000_000_000_000, 0, 0, "", "", 0,
                         None)) for seq in (1, 2, 3, 4)]
    far = 2 ** 62
    records += [
        ("jobs", ("lease", 1, r1, 1, far, 30_000, 1_700_000_000_000_000_001)),
        ("jobs", ("lease", 2, r2, 1, far, 30_000, 1_700_000_000_000_000_001)),
        ("jobs", ("lease", 3, r3, 1, far, 30_000, 1_700_000_000_000_000_001)),
        ("jobs", ("ack", r1)),
        ("jobs", ("deadline", r2, far - 1)),
        ("jobs", ("requeue", r3, 0)),
    ]
    write(tmp_path / "old.journal", records)

    async def run():
        shard = Shard(0, Settings(), Journal(path), lambda: None, 256)
        assert shard.replay() == len(records)
        return shard.queue("jobs")

    q = asyncio.run(run())
    assert sorted(q.messages) == [2, 3, 4]
    assert list(q.leases) == [receipt_text(r2)] and q.leases[receipt_text(r2)][2] == far - 1
    assert q.state(3) == "visible" and q.deliveries[3] == 1 and q.visible == 2
    assert receipt_text(r1) in q._acks and q._recent[receipt_text(r3)][0] == "lost"


def test_ready_order_matches_a_heap_of_priority_and_seq():
    """The visible messages' structure (FIFOs of runs per priority, a heap for what comes back out of order) serves
    in the order of one heap of (-priority, seq), through random adds, runs, batch pops, removals and discards."""
    import heapq
    import random

    from shardbroker.workers.workqueues.ready import Ready

    rng = random.Random(11)
    ready, ref = Ready(), []
    seq = 0
    for _ in range(20_000):
        r = rng.random()
        if r < 0.4:
            seq += 1 + (rng.random() < 0.2)   # a gap now and then: a push to another priority
            p = rng.choice((4, 4, 4, 9, 0, rng.randrange(10)))
            ready.add(seq, p)
            heapq.heappush(ref, (-p, seq))
        elif r < 0.5:   # a batch: consecutive numbers as a range or a list, or a list with gaps
            p = rng.choice((4, 9, rng.randrange(10)))
            k = rng.randrange(1, 40)
            new = list(range(seq + 1, seq + k + 1)) if rng.random() < 0.7 else \
                sorted(rng.sample(range(seq + 1, seq + 3 * k + 1), k))
            seq = new[-1]
            ready.extend_run(range(new[0], seq + 1) if new[-1] - new[0] == k - 1 and rng.random() < 0.5 else new, p)
            for one in new:
                heapq.heappush(ref, (-p, one))
        elif r < 0.6 and seq:
            old = rng.randrange(1, seq + 1)      # something coming back (or a double: skipped)
            p = rng.randrange(10)
            if (-p, old) not in ref and all(s != old for _, s in ref):
                ready.add(old, p)
                heapq.heappush(ref, (-p, old))
        elif r < 0.65 and ref:
            entry = rng.choice(ref) if rng.random() < 0.6 else max(ref, key=lambda e: e[1])   # the newest: undone
            ready.remove(entry[1], -entry[0])
            ref.remove(entry)
            heapq.heapify(ref)
        elif r < 0.66 and ref:
            taken = {s for _, s in rng.sample(ref, rng.randrange(1, min(len(ref), 20) + 1))}
            ready.discard(taken)
            ref = [e for e in ref if e[1] not in taken]
            heapq.heapify(ref)
        else:
            n = rng.randrange(1, 50)
            got = ready.pop_many(min(n, len(ready)))
            want = [heapq.heappop(ref)[1] for _ in range(min(n, len(ref)))]
            assert got == want
        assert len(ready) == len(ref)
        if rng.random() < 0.01:
            assert ready.peek(30) == [s for _, s in heapq.nsmallest(30, ref)]
    assert sorted(ready.seqs()) == sorted(s for _, s in ref)


def test_receipt_and_id_pools():
    """Receipts: 16 bytes from the CSPRNG with no ``;`` or NUL, canonical text, never repeated (also across a
    pool refill); a forked child draws its own."""
    import base64

    from shardbroker.workers.workqueues import receipts

    seen = set()
    for n in (1, 1, 300, 7, 1000, 1):
        for text in receipts.new_receipts(n):
            raw = base64.urlsafe_b64decode(text + "==")
            assert len(text) == 22 and len(raw) == 16 and b";" not in raw and b"\0" not in raw
            assert receipts.receipt_text(raw) == text
            seen.add(text)
    assert len(seen) == 1 + 1 + 300 + 7 + 1000 + 1
    ids = receipts.new_ids(500) + [receipts.new_id() for _ in range(300)]
    assert len(set(ids)) == 800 and all(len(i) == 16 for i in ids)
    receipts.new_receipts(1)                     # the pool holds receipts now
    assert receipts._receipt_pool
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if not receipts._receipt_pool and not receipts._id_pool else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


@pytest.mark.parametrize("durable", [True, False])
def test_a_rewrite_fsyncs_only_a_journal_that_must_outlive_the_machine(tmp_path, monkeypatch, durable):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    j = Journal(str(tmp_path / "j"), durable=durable)
    j.rewrite([RECORDS[:2]])
    j.close()
    assert bool(calls) is durable   # the file before the rename (fsync "no": the rename is the kernel's to write)
    assert replay(tmp_path / "j") == RECORDS[:2]
