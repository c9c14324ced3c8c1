"""The binding (transport ↔ cores) over the loopback transport, with real bytes and exact times."""

from __future__ import annotations

from kvproto.config import LeaseConfig
from kvproto.events import ReadDeclined, ReadDeferred, ReadGo, ReleaseReason
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto_binding.step import Binding, frame_tag
from kvproto_transports.loopback import LinkFaults, LoopbackNetwork
from tests.core.pair import counter_entropy

BLOCK = 64


class World:
    """P (holder) and D (reader) endpoints on one loopback network, driven step by step."""

    def __init__(self, *, delay: float = 0.001, d_block_len: int = BLOCK) -> None:
        self.cfg = LeaseConfig()
        self.net = LoopbackNetwork(seed=3, detection_delay=0.05)
        self.p_ep = self.net.endpoint("P")
        self.d_ep = self.net.endpoint("D")
        self.net.set_link("P", "D", LinkFaults(delay=delay))
        self.net.set_link("D", "P", LinkFaults(delay=delay))
        self.p_layout = self.p_ep.allocate_layout(2, BLOCK, 8)
        self.p_ep.register_blocks(self.p_layout)
        self.d_ep.register_blocks(self.d_ep.allocate_layout(2, d_block_len, 8))
        holder = Holder(self.cfg, engine="P", incarnation=1, entropy=counter_entropy(1))
        reader = Reader(self.cfg, engine="D", incarnation=2, entropy=counter_entropy(99))
        self.p = Binding(self.p_ep, holder=holder)
        self.d = Binding(self.d_ep, reader=reader)
        # The holder must be able to answer the reader (the side channel's introduction).
        self.p_ep.add_peer(self.d_ep.metadata())
        self.freed: list[tuple[float, ReleaseReason]] = []
        self.confirmed: list[tuple[float, str]] = []
        self.failed: list[str] = []

    def tagged_and_tracked(self) -> None:
        """P's block ``b`` of region ``r`` filled with byte ``16 r + b``; P grants one lease
        at t=0 and D tracks it (request ids p-1 and d-1)."""
        for region in range(2):
            for block in range(8):
                self.p_ep.write_block(region, block, bytes([region * 16 + block]) * BLOCK)
        assert self.p.holder is not None and self.d.reader is not None
        ticket = self.p.holder.grant(0.0, request_id="p-1")
        self.d.reader.track(0.0, request_id="d-1", ticket=ticket)

    def run(self, until: float, step: float = 0.01) -> None:
        t = self.net.now
        while t < until - 1e-9:
            t = min(until, t + step)
            self.net.advance(t)
            for free in self.p.step(t).freed:
                self.freed.append((t, free.reason))
            result = self.d.step(t)
            for connect in result.connects:
                self.d.connected(
                    t, engine=connect.engine, rank=connect.rank, metadata=self.p_ep.metadata()
                )
            self.confirmed += [(t, rid) for rid in result.confirmed]
            self.failed += [f.reason.value for f in result.failed]


def test_queued_request_heartbeats_then_reads_real_bytes_and_frees_on_done() -> None:
    w = World()
    w.tagged_and_tracked()
    w.run(100.0, step=0.25)  # queued for 100 s, more than three lease durations
    assert w.freed == [] and w.failed == []
    assert w.d.reader is not None and w.d.reader.ready_to_read("d-1")
    go = w.d.start_read(100.0, "d-1", local_blocks=[0, 1, 2], remote_blocks=[5, 6, 7])
    assert isinstance(go, ReadGo)
    w.run(100.5)
    assert [reason for _, reason in w.freed] == [ReleaseReason.DONE]
    assert [rid for _, rid in w.confirmed] == ["d-1"]
    for region in range(2):
        for local, remote in zip([0, 1, 2], [5, 6, 7], strict=True):
            assert w.d_ep.read_block(region, local) == bytes([region * 16 + remote]) * BLOCK


def _read_in_parts(w: World, remote: list[int]) -> None:
    """P blocks ``remote`` (4 of them) into D blocks 1 and 2, two parts each."""
    w.tagged_and_tracked()
    w.run(2.0)
    go = w.d.start_read(
        2.0,
        "d-1",
        local_blocks=[1, 1, 2, 2],
        remote_blocks=remote,
        local_parts=[0, 1, 0, 1],
        parts=2,
    )
    assert isinstance(go, ReadGo)


def test_larger_local_blocks_are_read_in_parts_and_the_done_follows_the_last() -> None:
    w = World(d_block_len=2 * BLOCK)
    _read_in_parts(w, [4, 5, 6, 7])
    # One READ per part, no done attached to either; the done is its own notify-only
    # read, issued once both parts landed (a done riding one part could free P's blocks
    # while the other is still being read).
    assert w.d_ep.counters.reads_started == 2
    w.run(2.5)
    assert w.d_ep.counters.reads_started == 3
    assert [reason for _, reason in w.freed] == [ReleaseReason.DONE]
    assert [rid for _, rid in w.confirmed] == ["d-1"]
    for region in range(2):
        tag = region * 16
        assert w.d_ep.read_block(region, 1) == bytes([tag + 4]) * BLOCK + bytes([tag + 5]) * BLOCK
        assert w.d_ep.read_block(region, 2) == bytes([tag + 6]) * BLOCK + bytes([tag + 7]) * BLOCK


def test_a_failed_part_fails_the_request_once_every_part_has_ended() -> None:
    w = World(d_block_len=2 * BLOCK)
    _read_in_parts(w, [4, 99, 6, 7])  # P has no block 99: part 1's READ fails in flight
    w.run(2.5)
    assert w.d_ep.counters.reads_started == 2  # no done was sent
    assert w.confirmed == [] and w.failed != []
    assert ReleaseReason.DONE not in [reason for _, reason in w.freed]


def _queue_then(w: World, fault: str) -> None:
    assert w.p.holder is not None and w.d.reader is not None
    ticket = w.p.holder.grant(0.0, request_id="p-1")
    w.d.reader.track(0.0, request_id="d-1", ticket=ticket)
    w.run(12.0, step=0.5)
    if fault == "crash":
        w.net.crash("D")
    else:
        w.net.partition("P", "D")
    t = 12.0
    while not w.freed and t < 60:
        t += 0.5
        w.net.advance(t)
        w.freed += [(t, f.reason) for f in w.p.step(t).freed]


def test_reader_crash_reported_by_transport_frees_at_once() -> None:
    w = World()
    _queue_then(w, "crash")
    # Loopback reports the crash after its 50 ms detection delay: freed at the next step.
    assert w.freed == [(12.5, ReleaseReason.PEER_LOST)]


def test_silent_reader_loss_frees_at_last_heartbeat_plus_extension() -> None:
    w = World()
    _queue_then(w, "partition")
    # Nothing reports the loss, so it shows as a lapse. Hello at 0.5, Welcome seen at 1.5,
    # heartbeats at 1.5, 6.5 and 11.5; the last one is applied at the holder's step at 12.0
    # and renews to 12.0 + extension (20 s) = 32.0, when the holder frees.
    assert w.freed == [(32.0, ReleaseReason.EXPIRED)]


def _stalled_reader(until: float) -> World:
    w = World()
    assert w.p.holder is not None and w.d.reader is not None
    # A grant of the whole lease (30 s), not the default claim window (20 s): its own
    # deadline then outlives the session's renewal below.
    ticket = w.p.holder.grant(0.0, request_id="p-1", ttl=30.0)
    w.run(1.0)
    w.d.reader.track(1.0, request_id="d-1", ticket=ticket)
    w.run(2.0)
    # The reader stalls (no steps) until ``until``: heartbeats stopped at t=1, so the
    # session's renewal ends at 1 + 20 = 21 s and the ticket's own deadline at 30 s; the
    # holder side keeps stepping.
    t = 2.0
    while t < until:
        t += 0.5
        w.net.advance(t)
        w.freed += [(t, f.reason) for f in w.p.step(t).freed]
    return w


def test_read_deferred_when_lease_too_close_then_read_after_the_early_heartbeat() -> None:
    w = _stalled_reader(26.5)
    # The claim acknowledged at 1 s carried ~29 s left: 26.5 + 5 is too close, but the lease
    # is live, so the reader heartbeats at once instead of declining ...
    decision = w.d.start_read(26.5, "d-1", local_blocks=[0], remote_blocks=[0])
    assert isinstance(decision, ReadDeferred) and decision.until == 26.5 + 5.0
    w.run(26.6)
    # ... the holder renewed the lease at its step, and the read goes and is confirmed.
    go = w.d.start_read(26.6, "d-1", local_blocks=[0], remote_blocks=[0])
    assert isinstance(go, ReadGo)
    w.run(27.0)
    assert [rid for _, rid in w.confirmed] == ["d-1"]
    assert [reason for _, reason in w.freed] == [ReleaseReason.DONE]


def test_read_declined_at_once_when_the_lease_lapsed() -> None:
    w = _stalled_reader(32.0)
    assert [reason for _, reason in w.freed] == [ReleaseReason.EXPIRED]  # at 30 s
    decision = w.d.start_read(32.0, "d-1", local_blocks=[0], remote_blocks=[0])
    assert isinstance(decision, ReadDeclined)
    w.run(32.5)
    assert w.failed == ["deadline-too-close"]


def test_frame_tag_routes_native_frames_and_not_text() -> None:
    assert frame_tag(b"HB:a,b") is None
    assert frame_tag(b"") is None
    assert frame_tag(b"\x8bK\x01\x00\x92\x05") == 5


def test_failure_during_a_read_is_surfaced_only_after_the_read_ended() -> None:
    # The engine recomputes into (or reuses) a failed request's blocks at once, so a
    # failure must not reach it while a READ into those blocks may still write them.
    w = World()
    w.net.read_bandwidth = 1000.0  # 2 regions x 3 blocks x 64 B: the read lands 0.385 s on
    assert w.p.holder is not None and w.d.reader is not None
    ticket = w.p.holder.grant(0.0, request_id="p-1")
    w.d.reader.track(0.0, request_id="d-1", ticket=ticket)
    w.run(1.0)
    go = w.d.start_read(1.0, "d-1", local_blocks=[0, 1, 2], remote_blocks=[5, 6, 7])
    assert isinstance(go, ReadGo)
    w.p.holder.revoke(1.0, ticket.lease)  # memory pressure on P, mid-read
    w.run(1.3)  # the Revoke reached D (1 ms link); the read has not landed
    assert w.d.reader.stats.lost == 1  # the reader gave the request up at the Revoke
    assert w.failed == [] and w.d.stats.failures_held == 1
    w.run(1.5)  # the read landed at 1.385: now the engine hears of the failure
    assert w.failed == ["revoked"] and w.confirmed == []
