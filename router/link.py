"""One peer's side of the fabric (router.fabric): the state of the two one-way links between this worker and it.

Outgoing: the messages and control items queued for the next frame, sequence numbers, and the window of frames
sent and not yet acknowledged.  Incoming: the peer's incarnation (epoch) and sequence numbers, so a gap is counted,
and which received frames are finished, which is what our ack to it says.  The sockets, the frames' coding and what
the worker is told are the fabric's; this is the bookkeeping, without I/O.
"""

from __future__ import annotations

import collections
import time

from shardbroker.router import frames


class Link:
    """State of the two one-way links between this worker and one peer."""

    __slots__ = ("peer", "prefix", "out_msgs", "out_bytes", "out_ctrl", "out_seq", "out_msg_count", "acked", "inflight",
                 "inflight_bytes", "congested_since", "acked_at", "lagging", "in_epoch", "in_seq", "in_msg_count",
                 "processed", "unfinished", "finished_early", "ack_owed", "ack_wanted", "up", "lost_frames",
                 "lost_messages", "frames_in", "frames_out", "acks_out", "messages_in", "messages_out",
                 "dropped_messages", "dropped_at_lag", "stalls", "waiting_since")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.prefix = frames.prefix(peer)
        self.out_msgs: list = []
        self.out_bytes = 0         # the payload bytes of out_msgs
        self.out_ctrl: list = []
        self.out_seq = 0
        self.out_msg_count = 0
        self.acked = 0
        self.inflight: collections.deque[tuple[int, int]] = collections.deque()  # (seq, frame size)
        self.inflight_bytes = 0
        self.congested_since = 0.0
        self.acked_at = 0.0        # when the peer's ack last moved forward
        self.lagging = False
        self.in_epoch = -1
        self.in_seq = 0
        self.in_msg_count = 0
        self.processed = 0         # the highest sequence number up to which every frame is finished: our ack
        self.unfinished: collections.deque[int] = collections.deque()   # received, not finished, in order
        self.finished_early: set[int] = set()   # finished while an earlier frame is still unfinished
        self.ack_owed = False
        self.ack_wanted = 0        # the peer asked for an ack as soon as every frame up to this one is processed
        # Up: the peer's current incarnation has acknowledged one of our frames, so both directions work.
        self.up = False
        self.lost_frames = 0
        self.lost_messages = 0
        self.frames_in = self.frames_out = self.messages_in = self.messages_out = 0
        self.acks_out = 0          # frames that carried only an ack (and perhaps a question: WANT_ACK)
        self.dropped_messages = 0  # not sent: the peer was lagging and its window full
        self.dropped_at_lag = 0    # dropped_messages when the current lagging episode began
        self.stalls = 0            # times this link held the worker's publishers back
        self.waiting_since = 0.0   # since when frames have been unacknowledged with no ack moving (0: none are)

    def forget_inflight(self) -> None:
        self.acked = self.out_seq
        self.inflight.clear()
        self.inflight_bytes = 0
        self.waiting_since = 0.0
        self.congested_since = 0.0
        self.lagging = False

    def restart(self, epoch: int, msgs_before: int) -> None:
        """A new incarnation of the peer: its sequence numbers start again, and it waits for nothing of ours."""
        self.in_epoch = epoch
        self.in_seq = 0
        self.processed = 0
        self.unfinished.clear()
        self.finished_early.clear()
        self.ack_wanted = 0
        self.in_msg_count = msgs_before
        self.forget_inflight()
        self.up = False

    def finish(self, seq: int) -> bool:
        """Every message of frame ``seq`` is delivered; True if that moved ``processed`` (the ack) forward: it was
        the oldest unfinished frame.  One finished before an older one waits for it."""
        unfinished = self.unfinished
        if not unfinished or unfinished[0] != seq:
            if seq in unfinished:
                self.finished_early.add(seq)
            return False
        unfinished.popleft()
        early = self.finished_early
        while unfinished and unfinished[0] in early:
            early.discard(unfinished.popleft())
        self.processed = unfinished[0] - 1 if unfinished else self.in_seq
        return True

    def take_ack(self, ack: int) -> None:
        """The peer has processed every frame up to ``ack``: they leave the window."""
        if ack > self.acked:
            self.acked = ack
            self.acked_at = time.monotonic()
            inflight = self.inflight
            while inflight and inflight[0][0] <= ack:
                self.inflight_bytes -= inflight.popleft()[1]
            self.waiting_since = self.acked_at if inflight else 0.0

    def window_full(self, window_bytes: int, window_frames: int) -> bool:
        return self.inflight_bytes > window_bytes or len(self.inflight) > window_frames

    def stats(self, now: float) -> dict:
        return {
            "up": self.up, "frames_out": self.frames_out, "frames_in": self.frames_in, "acks_out": self.acks_out,
            "messages_out": self.messages_out, "messages_in": self.messages_in,
            "lost_frames": self.lost_frames, "lost_messages": self.lost_messages,
            "inflight_bytes": self.inflight_bytes, "inflight_frames": len(self.inflight), "lagging": self.lagging,
            "dropped_messages": self.dropped_messages, "stalls": self.stalls,
            # how long frames to the peer have waited with no ack moving (a peer acks at least once a second):
            # /healthz reports a peer that stopped reading once this passes fabric.stall_timeout + 2 s
            "unacked_seconds": round(now - self.waiting_since, 3) if self.waiting_since else 0.0,
        }
