"""The model of scripts/measure/stages.py ``--model``: throughput against workers and cores, from the costs a
``--json`` run of it measured (its docstring and docs/performance-notes.md, "A model for 8 and 16 cores", say how).
Run that script, not this one (it imports this, from its own folder)."""

from __future__ import annotations

from shardbroker.workers.turn import TURN_BUDGET


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``points``, flat beyond the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class Costs:
    """One protocol's CPU µs per message, by stage, from a run's JSON (compiled path): the model's inputs."""

    def __init__(self, res: dict, protocol: str, size: int) -> None:
        py = res["paths"]["compiled"]["python"][protocol]
        whole = res["paths"]["compiled"]["whole"][protocol]
        kern, fit = res["kernel"][protocol], res["zmq"]["fit"]
        self._write_fit = res["kernel"]["write_fit"]
        self.loop_turn = kern["loop_turn_us"]
        self.size = size
        self.per_read = py["messages_per_read"]
        self.msg_bytes = py["frame_bytes"] / self.per_read
        self.read, self.parse, self.route = kern["read"]["median"], py["parse"]["median"], py["route"]["median"]
        self.encode, self.decode = py["encode"]["median"], py["decode"]["median"]
        self.ok = kern["write_ok"]["median"] if "write_ok" in kern else 0.0   # NDJSON's replies to the publisher
        self._fan = sorted((int(f), v) for f, v in py["delivery"].items())
        self._fit = fit
        # What the in-process whole path spends beyond the stages: per message at one worker (the turn, the
        # loop), and per frame beyond that at two (the fabric's and the inbox's bookkeeping, the fabric's wake-ups).
        self.rest = max(0.0, whole["1"]["main_us"]["median"] - (self.parse + self.route + self.delivery(1)))
        n = whole["2"]["messages_per_frame"] or self.per_read
        cross = (self.parse + self.route + self.encode + self.decode + self.delivery(1) + self.zmq("send", n)
                 + self.zmq("recv", n))
        self.rest_frame = max(0.0, whole["2"]["main_us"]["median"] - cross - self.rest) * n
        # ZeroMQ's I/O threads: per KiB as the hop measured them; per frame as the whole path did (a frame a turn,
        # each a wake-up of both I/O threads, where the hop's back-to-back frames shared them)
        self._io_kib = fit["io_send"]["per_kib_us"] + fit["io_recv"]["per_kib_us"]
        self._io_frame = max(fit["io_send"]["per_frame_us"] + fit["io_recv"]["per_frame_us"],
                             whole["2"]["io_us"]["median"] * n - self._io_kib * n * self.msg_bytes / 1024)

    def delivery(self, fanout: float) -> float:
        """Python's part of one delivery, ``fanout`` subscribers on the worker."""
        return _interp([(f, v["median"]) for f, v in self._fan], fanout)

    def write(self, fanout: float) -> float:
        """The kernel's part of one delivery: a write per subscriber per batch, of the batch's size."""
        per_write = _interp([(f, v["messages_per_write"]) for f, v in self._fan], fanout)
        nbytes = _interp([(f, v["bytes_per_write"]) for f, v in self._fan], fanout)
        f = self._write_fit
        # the fit counts a turn of the loop a write; with many subscribers a turn has as many writes
        return (f["per_call_us"] + f["per_kib_us"] * nbytes / 1024 - self.loop_turn * (1 - 1 / fanout)) / per_write

    def zmq(self, key: str, n: float) -> float:
        """A ZeroMQ side (send, io_send, io_recv, recv) per message, ``n`` messages a frame."""
        f = self._fit[key]
        return (max(0.0, f["per_frame_us"]) + f["per_kib_us"] * n * self.msg_bytes / 1024) / n

    # the three kinds of work: a publish delivered on its own worker, and a cross-worker one's two halves
    def local(self) -> float:
        return self.read + self.parse + self.route + self.ok + self.delivery(1) + self.write(1) + self.rest

    def publisher(self, n: float, copies: int = 1) -> float:
        return (self.read + self.parse + self.route + self.ok + self.rest / 2
                + copies * (self.encode + self.zmq("send", n) + self.rest_frame / n / 2))

    def subscriber(self, n: float, fanout: float = 1) -> float:
        return (self.zmq("recv", n) + self.decode + self.rest / 2 + self.rest_frame / n / 2
                + fanout * (self.delivery(fanout) + self.write(fanout)))

    def io(self, n: float) -> float:
        return (self._io_frame + self._io_kib * n * self.msg_bytes / 1024) / n


class LiveCosts(Costs):
    """The same, but a publish's three kinds of work as the real broker's workers spent them here (``live``, 1 and
    2 workers): every cost the stages leave out is in, and so is what two busy cores shared with the generators
    and other tenants add to each.  No fan-out to many connections (``wide``): not measured live."""

    def __init__(self, res: dict, protocol: str, size: int) -> None:
        super().__init__(res, protocol, size)
        lv = res["live"][protocol]
        self._local = lv["1"]["cpu_us"]["median"]
        two = lv["2"]
        self._pub = two["pub_main"]["median"] + two["pub_other"]["median"]
        self._sub = two["sub_main"]["median"] + two["sub_other"]["median"]
        self._io = two["pub_io"]["median"] + two["sub_io"]["median"]

    def local(self) -> float:
        return self._local

    def publisher(self, n: float, copies: int = 1) -> float:
        return self._pub

    def subscriber(self, n: float, fanout: float = 1) -> float:
        return self._sub

    def io(self, n: float) -> float:
        return self._io


def predict(c: Costs, scenario: str, workers: int, cores: int, gen: float = 0.0, nn: int = 64,
            wide: int = 5000) -> float:
    """Messages (deliveries, for ``wide``) a second.  ``gen``: the load generators' CPU µs per delivery when they
    share the cores (0: they run elsewhere).  A worker's thread is one core at most; the ZeroMQ I/O threads and
    the generators take what cores are left; frames carry one read's run (saturation)."""
    n, w = c.per_read, workers
    if scenario in ("1→1", "1→1 random"):   # one publisher, one subscriber: at most two workers' threads
        local = min(1 / c.local(), cores / (c.local() + gen))
        if w == 1:
            return local * 1e6
        pub, sub, io = c.publisher(n), c.subscriber(n), c.io(n)
        cross = min(1 / pub, 1 / sub, cores / (pub + sub + io + gen))
        if scenario == "1→1":   # the bench: the two connections on the two least loaded workers, never one
            return cross * 1e6
        return (local / w + cross * (w - 1) / w) * 1e6
    if scenario in ("N→N", "N→N random"):   # nn pairs, spread evenly; cross-worker: all (bench) or (W-1)/W
        f = 0.0 if w == 1 else 1.0 if scenario == "N→N" else (w - 1) / w
        per = (1 - f) * c.local() + f * (c.publisher(n) + c.subscriber(n))
        busiest = per / min(w, nn)   # each worker's share of one message's thread time
        return min(1 / busiest, cores / (per + f * c.io(n) + gen)) * 1e6
    if scenario == "wide":   # one publisher, ``wide`` subscribers spread over the workers
        if isinstance(c, LiveCosts):
            return float("nan")
        fan = wide / w
        # the publisher's worker also delivers to its own share: a turn's budget holds that many messages, the
        # frames to the others as many
        m = min(n, TURN_BUDGET / (1 + (c.size + 64) * fan / 1024))
        pub = c.publisher(m, copies=w - 1) + fan * (c.delivery(fan) + c.write(fan)) if w > 1 else \
            c.read + c.parse + c.route + c.ok + c.rest + fan * (c.delivery(fan) + c.write(fan))
        other = c.subscriber(m, fan) if w > 1 else 0.0
        io = (w - 1) * c.io(m)
        per_msg = min(1 / pub, 1 / other if other else float("inf"), cores / (pub + (w - 1) * other + io
                                                                               + gen * wide))
        return per_msg * wide * 1e6
    raise ValueError(scenario)


SCENARIOS = ("1→1", "1→1 random", "N→N", "N→N random", "wide")


def model_report(res: dict, cores: list[int], workers: list[int], gen: dict[str, float]) -> dict:
    size = res["args"]["size"]
    out: dict = {}
    for protocol in res["args"]["protocols"]:
        c = Costs(res, protocol, size)
        parts = {"read": c.read, "parse": c.parse, "route": c.route, "ok replies (write)": c.ok,
                 "encode": c.encode, "ZeroMQ send call": c.zmq("send", c.per_read),
                 "ZeroMQ I/O threads": c.io(c.per_read), "ZeroMQ recv call": c.zmq("recv", c.per_read),
                 "decode": c.decode, "delivery 1→1": c.delivery(1), "write 1→1": c.write(1),
                 "rest, per message": c.rest, f"rest, per frame of {c.per_read:.0f}": c.rest_frame / c.per_read}
        print(f"\n{protocol}: model inputs, CPU µs per message (compiled path)")
        for k, v in parts.items():
            print(f"  {k:32s} {v:7.3f}")
        bases = {"stages": c}
        if "live" in res:
            bases["live"] = LiveCosts(res, protocol, size)
        for name, b in bases.items():
            print(f"  {name}: local (one worker) {b.local():.3f}; across workers: the publisher's worker "
                  f"{b.publisher(c.per_read):.3f}, the subscriber's {b.subscriber(c.per_read):.3f}, "
                  f"the I/O threads {b.io(c.per_read):.3f}")
        print("  stages, wide, per delivery at 5,000/W: " + "  ".join(
            f"W={w}: {c.delivery(5000 / w) + c.write(5000 / w):.3f}" for w in workers))
        out[protocol] = {}
        for cc in cores:
            g = gen.get(protocol, 0.0) if cc == min(cores) and gen else 0.0
            print(f"\n{protocol}, {cc} cores" + (f", generators on them ({g} µs a message)" if g else
                                                  ", generators elsewhere") + ": msg/s (wide: deliveries/s)")
            print(f"  {'workers':22s}" + "".join(f"{w:>10d}" for w in workers))
            for name, b in bases.items():
                for sc in SCENARIOS:
                    row = [predict(b, sc, w, cc, g) for w in workers]
                    if all(x != x for x in row):   # nan: not on this basis
                        continue
                    out[protocol][f"{cc}/{name}/{sc}"] = row
                    print(f"  {name + ' ' + sc:22s}" + "".join(f"{x / 1e6:>9.2f}M" for x in row))
    return out
