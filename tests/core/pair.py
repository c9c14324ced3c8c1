"""A holder and a reader wired by an in-memory link, for exact-time tests.

Modelled on aioquic's test pairs: nothing happens unless the test moves time
or delivers frames, so every assertion can name an exact ``now``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvproto.config import LeaseConfig
from kvproto.events import Connect, FreeBlocks, ReadConfirmed, RequestFailed, SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket

HOLDER = "holder-agent"
READER = "reader-agent"


def counter_entropy(seed: int = 0) -> Callable[[int], bytes]:
    """Deterministic 'random' bytes so that test runs are reproducible."""
    counter = itertools.count(seed)

    def entropy(n: int) -> bytes:
        return next(counter).to_bytes(8, "big").rjust(n, b"\x01")[:n]

    return entropy


@dataclass
class Pair:
    """One holder rank and one reader rank over a link that the test drives."""

    config: LeaseConfig = field(default_factory=LeaseConfig)
    holder: Holder = field(init=False)
    reader: Reader = field(init=False)
    to_holder: deque[bytes] = field(default_factory=deque)
    to_reader: deque[bytes] = field(default_factory=deque)
    freed: list[FreeBlocks] = field(default_factory=list)
    failed: list[RequestFailed] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    connects: list[Connect] = field(default_factory=list)
    auto_connect: bool = True

    def __post_init__(self) -> None:
        self.holder = Holder(self.config, engine="P", incarnation=7, entropy=counter_entropy(1000))
        self.reader = Reader(self.config, engine="D", incarnation=9, entropy=counter_entropy(2000))

    def collect(self, now: float) -> None:
        """Move every output into the link queues and result lists."""
        for out in self.holder.drain():
            if isinstance(out, SendFrame):
                assert out.peer == READER
                self.to_reader.append(out.payload)
            else:
                self.freed.append(out)
        for rout in self.reader.drain():
            if isinstance(rout, SendFrame):
                assert rout.peer == HOLDER
                self.to_holder.append(rout.payload)
            elif isinstance(rout, Connect):
                self.connects.append(rout)
                if self.auto_connect:
                    self.reader.connected(now, engine=rout.engine, rank=rout.rank, peer=HOLDER)
                    self.collect(now)
            elif isinstance(rout, RequestFailed):
                self.failed.append(rout)
            elif isinstance(rout, ReadConfirmed):
                self.confirmed.append(rout.request_id)

    def deliver(self, now: float) -> int:
        """Deliver every queued frame (both ways) at ``now``, until quiet. Returns the count."""
        self.collect(now)
        n = 0
        while self.to_holder or self.to_reader:
            while self.to_holder:
                self.holder.handle_frame(now, READER, self.to_holder.popleft())
                n += 1
            self.collect(now)
            while self.to_reader:
                self.reader.handle_frame(now, HOLDER, self.to_reader.popleft())
                n += 1
            self.collect(now)
        return n

    def tick(self, now: float) -> None:
        """Run both timers at ``now`` and deliver what they sent."""
        self.holder.handle_timer(now)
        self.reader.handle_timer(now)
        self.deliver(now)

    def run_until(self, end: float, step: float = 0.5, start: float = 0.0) -> None:
        """Tick every ``step`` seconds from ``start`` to ``end`` inclusive."""
        t = start
        while t <= end + 1e-9:
            self.tick(t)
            t += step

    def grant_and_track(self, now: float, request_id: str = "r1") -> LeaseTicket:
        ticket = self.holder.grant(now, request_id="p-" + request_id)
        self.reader.track(now, request_id=request_id, ticket=ticket)
        self.deliver(now)
        return ticket

    def read(
        self, now: float, request_id: str = "r1", *, done_arrives: float | None = None
    ) -> None:
        """Begin the read; the done frame reaches the holder at ``done_arrives`` (default now)."""
        from kvproto.events import ReadGo

        go = self.reader.begin_read(now, request_id)
        assert isinstance(go, ReadGo), go
        for order in go.orders:
            self.reader.read_completed(now, request_id, order.holder_rank)
            self.collect(now)
            at = now if done_arrives is None else done_arrives
            self.holder.handle_frame(at, READER, order.notify)
        self.deliver(now if done_arrives is None else done_arrives)
