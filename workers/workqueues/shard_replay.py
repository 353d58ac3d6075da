"""A shard and its journal as the whole of its queues' state: ``replay`` rebuilds the queues from it at start (a
replaced worker, a restarted broker), and compaction rewrites it as the live state once it is mostly records of what
is gone, a batch per turn while serving (``_start_rewrite``, ``turn_done``) or at once (``compact(force=True)``).

Together because each is the other's counterpart: a compaction writes what replaying rebuilds (the clock record
first, then each queue's snapshot), every replay is followed by a compaction, and a replay across a reboot must
compact at once.  A mixin of ``workers.workqueues.shard.Shard``, over its state (``Shard.__init__``); kept in a room
of its own so that the shard's room holds the state and the entry point.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("broker.queues")

# Rewrite the journal once it holds this much of what is gone, and more of that than of what is live: a rewrite
# costs the live bytes it writes and pays with the dead ones it drops, so its cost stays below what was appended
# (a queue drained from a backlog is not rewritten halfway, only once mostly gone), and the file stays below twice
# the live state plus this.
_COMPACT_DEAD = 64 << 20
_COMPACT_BACKOFF_S = 60.0   # after a failed compaction (a full disk), none is tried for this long


def _boot_id() -> str:
    """This boot of the machine (Linux): monotonic deadlines from another boot mean nothing."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _clock() -> tuple:
    """The shard's journal record of the clocks its deadlines are taken on."""
    return ("clock", _boot_id(), time.monotonic_ns(), time.time_ns())


class Replaying:
    """``Shard``'s replay and compaction (its state is the Shard's)."""

    def replay(self) -> int:
        """Rebuild the queues from the journal (a replaced worker): leases resume with their remaining time,
        and whatever fell due while the worker was down is handled now.  -> records replayed."""
        count = 0
        clock = None
        run_name, run = "", []   # plain single pushes in a row to one queue, stored together (as ``pushes``)
        for name, record in self.journal.replay():
            count += 1
            # A push with no delay, no deliveries and no token is its message tuple stored, and a row of them (to
            # one queue, numbers rising, as pushes journal them) is a batch push's: one ``_store`` for the row
            # instead of one per record, which was most of a journal of single pushes' replay time.
            if record[0] == "push" and len(record) == 13 and not record[7] and not record[8] \
                    and record[12] is None and type(record[4]) is bytes and name:
                if name != run_name or (run and record[1] <= run[-1][0]):
                    if run:
                        self._replay_record(run_name, ("pushes", None, run, None))
                    run_name, run = name, []
                run.append(record[1:7] + record[9:12])
                continue
            if run:
                self._replay_record(run_name, ("pushes", None, run, None))
                run_name, run = "", []
            if not name:  # the shard's own: the clock the deadlines were taken on
                clock = record if record[0] == "clock" else clock
                continue
            self._replay_record(name, record)
        if run:
            self._replay_record(run_name, ("pushes", None, run, None))
        if clock is not None and clock[1] != _boot_id():
            self._rebase(clock)
        now = time.monotonic_ns()
        for q in self.queues.values():
            q.dead.clear()   # their DLQ pushes are records of their own, replayed already
            q.due_at = 0
            nxt = q.expire(now)
            if nxt:
                q._at(nxt)
            self._settle(q, now)
        if count:
            try:
                if clock is not None and clock[1] != _boot_id():
                    self.compact(force=True)   # the old boot's deadlines must not be replayed again: rewrite now
                else:   # while serving, a batch at a time
                    self.journal.commit()
                    self._start_rewrite()
            except OSError as exc:   # a full disk: the journal stays as it was, and the worker starts all the same
                log.error("work-queue journal: compaction at start failed: %s; the journal is kept as it is",
                          exc.strerror or exc)
                self._compact_after = time.monotonic() + _COMPACT_BACKOFF_S
        else:
            self.journal.append("", _clock())
        return count

    def _replay_record(self, name: str, record: tuple) -> None:
        try:
            self.queue(name).apply(record)
        except (KeyError, ValueError, TypeError) as exc:
            log.error("journal record %r of queue %r not applicable (%s); skipped", record[:2], name, exc)

    def _rebase(self, clock: tuple) -> None:
        """The journal was written before a reboot (a kept ``data_dir``): its monotonic deadlines mean nothing
        now.  Leases end (their messages visible again, deliveries kept: nobody can still hold them); delayed
        messages keep the wall-clock time they had left."""
        _, _, then_mono, then_wall = clock
        now_mono, now_wall = time.monotonic_ns(), time.time_ns()
        for q in self.queues.values():
            for receipt in list(q.leases):
                q.apply(("requeue", receipt, 0))
            # the time a delayed message had left when the journal was written, by the wall clock since
            q.rebase_delays(lambda ready_at: ready_at - then_mono - (now_wall - then_wall), now_mono)
        log.warning("worker %d: queues journaled before a reboot: their leases ended, delays carried over by the "
                    "wall clock", self.index)

    def compact(self, force: bool = False) -> None:
        """Rewrite the journal as the live state once it is large and mostly records of what is gone: a batch at
        a time while serving (``_rewrite_step``), at once when ``force``d (at start)."""
        journal = self.journal
        if journal.dirty:
            if not force:   # the turn's flush writes it (or it waits for a disk with room): compact next time
                return
            journal.commit()
        if journal.rewriting and not force:   # under way: its steps go on, and the turn it is written ends it
            return
        live = sum(q.bytes + 96 * (len(q.messages) + len(q.leases)) for q in self.queues.values())
        if force:
            journal.rewrite(self._snapshot())
            self.compactions += 1
        elif journal.size - live >= _COMPACT_DEAD and live * 2 < journal.size:
            self._start_rewrite()

    def _snapshot(self) -> Iterator[list[tuple[str, tuple]]]:
        """The live state as batches of journal records, taken now (``Queue.snapshot``), read as they are written."""
        return _named_batches(_clock(), [(q.name, q.snapshot()) for q in self.queues.values()])

    def _start_rewrite(self) -> None:
        """Compact while serving: one batch of the state as it is now per turn of the event loop, in between."""
        self.journal.start_rewrite(self._snapshot())
        self._schedule_flush()   # its steps: turn_done

    def turn_done(self) -> None:
        """The turn's replies are out (the hub's flush): the compaction under way writes its next batch now, or is
        put in place once written.  Done before the replies, a batch (``queue_snapshot.SNAPSHOT_RUN`` messages, a
        fraction of a millisecond) would hold back the replies of every turn the rewrite takes."""
        journal = self.journal
        if not journal.rewriting:
            return
        if journal.rewrite_unwritten:
            self._rewrite_step()
        elif journal.rewrite_written:
            self._finish_rewrite()

    def _rewrite_step(self) -> None:
        journal = self.journal
        try:
            if not journal.rewrite_step():
                if journal.rewriting:
                    self._schedule_flush()   # the next batch at the next turn's end, whether or not clients ask
                return
            flush = journal.rewrite_flush()
        except Exception as exc:   # a full disk; or a record that cannot be encoded (a bug): the journal is kept
            self._compaction_failed(exc)
            return
        assert flush is not None   # written just now, so not yet flushed
        # In a thread: the copy of what the journal gained meanwhile, an fsync that may take seconds, a writeback
        # that renaming would otherwise do in the loop (~50 ms).  Then the next turn's end puts it in place
        # (_rewrite_flushed, turn_done).
        self.loop.run_in_executor(None, flush).add_done_callback(self._rewrite_flushed)

    def _rewrite_flushed(self, done: asyncio.Future) -> None:
        if done.cancelled():       # the worker is stopping
            return
        exc = done.exception()
        if exc is not None:
            self.journal.abort_rewrite()
            self._compaction_failed(exc)
            return
        self._schedule_flush()

    def _finish_rewrite(self) -> None:
        journal = self.journal
        before = journal.size
        try:
            journal.finish_rewrite()
        except OSError as exc:
            self._compaction_failed(exc)
            return
        self.compactions += 1
        log.debug("worker %d: journal compacted while serving: %d bytes, was %d", self.index, journal.size, before)

    def _compaction_failed(self, exc: Exception) -> None:
        self._compact_after = time.monotonic() + _COMPACT_BACKOFF_S
        log.error("work-queue journal: compaction failed: %s; the journal is kept as it is, next try in %d s",
                  getattr(exc, "strerror", None) or exc, _COMPACT_BACKOFF_S)


def _named_batches(clock: tuple, snapshots: list[tuple[str, Iterator[list[tuple]]]]
                   ) -> Iterator[list[tuple[str, tuple]]]:
    yield [("", clock)]
    for name, batches in snapshots:
        for batch in batches:
            yield [(name, record) for record in batch]
