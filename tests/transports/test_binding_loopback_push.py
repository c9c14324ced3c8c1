"""Push mode through the binding over the loopback transport: real bytes, exact times.

D hosts the holder (a writable lease on its empty blocks), P the writer; P's blocks
carry tagged bytes and the WRITE moves them into D's blocks. What is checked: the
bytes land, the Arm round trip comes first, the done frees DONE only after the data,
a write that lands after the lease ended is fenced and its blocks stay out of reuse
until it landed, and a failure of P's request is held back while its write reads P's
blocks.
"""

from __future__ import annotations

from kvproto.config import LeaseConfig
from kvproto.events import ReadDeferred, ReadGo, ReleaseReason
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.states import WriteState
from kvproto_binding.step import Binding
from kvproto_transports.loopback import LinkFaults, LoopbackNetwork
from tests.core.pair import counter_entropy

BLOCK = 64


class PushWorld:
    """D (holder) and P (writer) endpoints on one loopback network, stepped together."""

    def __init__(
        self, *, delay: float = 0.001, bandwidth: float | None = None, d_block: int = BLOCK
    ) -> None:
        self.cfg = LeaseConfig()
        self.net = LoopbackNetwork(seed=5, detection_delay=0.05, read_bandwidth=bandwidth)
        self.p_ep = self.net.endpoint("P")
        self.d_ep = self.net.endpoint("D")
        self.net.set_link("P", "D", LinkFaults(delay=delay))
        self.net.set_link("D", "P", LinkFaults(delay=delay))
        self.p_ep.register_blocks(self.p_ep.allocate_layout(2, BLOCK, 8))
        self.d_ep.register_blocks(self.d_ep.allocate_layout(2, d_block, 8))
        holder = Holder(self.cfg, engine="D", incarnation=1, entropy=counter_entropy(1))
        writer = Reader(self.cfg, engine="P", incarnation=2, entropy=counter_entropy(99))
        self.d = Binding(self.d_ep, holder=holder)
        self.p = Binding(self.p_ep, reader=writer)
        self.d_ep.add_peer(self.p_ep.metadata())  # the registration's introduction
        self.freed: list[tuple[float, ReleaseReason]] = []
        self.fenced: list[tuple[float, ReleaseReason]] = []
        self.confirmed: list[tuple[float, str]] = []
        self.failed: list[tuple[float, str]] = []
        for region in range(2):
            for block in range(8):
                self.p_ep.write_block(region, block, bytes([region * 16 + block]) * BLOCK)

    def registered(self) -> int:
        """D grants a writable lease at 0 and P tracks it to write; the lease id."""
        assert self.d.holder is not None and self.p.reader is not None
        ticket = self.d.holder.grant(0.0, request_id="d-1", writable=True)
        self.p.reader.track(0.0, request_id="p-1", ticket=ticket, writes=True)
        return ticket.lease

    def run(self, until: float, step: float = 0.01) -> None:
        t = self.net.now
        while t < until - 1e-9:
            t = min(until, t + step)
            self.net.advance(t)
            d_result = self.d.step(t)
            self.freed += [(t, f.reason) for f in d_result.freed]
            self.fenced += [(t, f.reason) for f in d_result.fenced]
            result = self.p.step(t)
            for connect in result.connects:
                self.p.connected(
                    t, engine=connect.engine, rank=connect.rank, metadata=self.d_ep.metadata()
                )
            self.confirmed += [(t, rid) for rid in result.confirmed]
            self.failed += [(t, f.reason.value) for f in result.failed]

    def write(
        self, at: float, local: list[int], remote: list[int], parts: list[int] | None = None
    ) -> ReadGo:
        """Arm at ``at``, then write at the step after the ArmAck came back (``parts``: the
        part of its holder block each local block fills, D's blocks being twice P's)."""
        split = {} if parts is None else {"remote_parts": parts, "parts": 2}
        self.run(at)
        first = self.p.start_write(at, "p-1", local_blocks=local, remote_blocks=remote, **split)
        assert isinstance(first, ReadDeferred)
        t = at
        while True:
            t += 0.01
            self.run(t)
            go = self.p.start_write(t, "p-1", local_blocks=local, remote_blocks=remote, **split)
            if isinstance(go, ReadGo):
                return go
            assert isinstance(go, ReadDeferred), go


def test_a_write_moves_the_bytes_and_the_done_fills_the_blocks() -> None:
    w = PushWorld()
    lease = w.registered()
    go = w.write(1.0, local=[5, 6, 7], remote=[0, 1, 2])
    assert len(go.orders) == 1
    assert w.d.holder is not None and w.d.holder.write_state(lease) is WriteState.ARMED
    w.run(1.5)
    assert [reason for _, reason in w.freed] == [ReleaseReason.DONE]
    assert w.fenced == [] and w.failed == []
    assert [rid for _, rid in w.confirmed] == ["p-1"]
    for region in range(2):
        for local, remote in zip([5, 6, 7], [0, 1, 2], strict=True):
            assert w.d_ep.read_block(region, remote) == bytes([region * 16 + local]) * BLOCK
    assert w.p_ep.counters.reads_started == 1  # the one write (loopback counts transfers)


def test_a_write_into_larger_holder_blocks_fills_their_parts_and_the_done_follows_the_last() -> (
    None
):
    """D's blocks hold two of P's: one WRITE per part (two here), and the done only once
    both landed, alone (a done riding the first could tell D a half-written block is
    whole)."""
    w = PushWorld(bandwidth=384.0, d_block=2 * BLOCK)  # part 0 (256 B) 0.67 s, part 1 0.33 s
    lease = w.registered()
    go = w.write(1.0, local=[4, 5, 6], remote=[1, 1, 2], parts=[0, 1, 0])
    began = w.net.now
    assert len(go.orders) == 1
    w.run(began + 0.5)
    assert w.freed == [] and w.d.holder is not None
    assert w.d.holder.write_state(lease) is WriteState.ARMED  # part 0 still on the wire
    assert w.p.writing("p-1")
    w.run(began + 2.0)
    assert [reason for _, reason in w.freed] == [ReleaseReason.DONE]
    assert w.freed[0][0] >= began + 0.67  # after the slower part landed
    assert [rid for _, rid in w.confirmed] == ["p-1"] and w.failed == [] and w.fenced == []
    for region in range(2):
        tag = region * 16
        assert w.d_ep.read_block(region, 1) == bytes([tag + 4]) * BLOCK + bytes([tag + 5]) * BLOCK
        assert w.d_ep.read_block(region, 2)[:BLOCK] == bytes([tag + 6]) * BLOCK
    assert not w.p.writing("p-1")


def test_a_write_landing_after_the_lease_is_fenced_and_freed_only_when_it_landed() -> None:
    w = PushWorld(bandwidth=8.0)  # the 3-block write of 2 regions, 384 B, takes 48 s
    lease = w.registered()
    w.write(1.0, local=[5, 6, 7], remote=[0, 1, 2])
    write_began = w.net.now
    # P stops stepping (paused: no heartbeat leaves) while its write is on the wire.
    t = w.net.now
    while t < 60.0:
        t += 0.5
        w.net.advance(t)
        d_result = w.d.step(t)
        w.freed += [(t, f.reason) for f in d_result.freed]
        w.fenced += [(t, f.reason) for f in d_result.fenced]
    assert [reason for _, reason in w.fenced] == [ReleaseReason.EXPIRED]
    assert w.fenced[0][0] < write_began + 48.0  # ended while the data was on its way
    assert [reason for _, reason in w.freed] == [ReleaseReason.EXPIRED]
    assert w.freed[0][0] >= write_began + 48.0  # not before the data could have landed
    assert w.d.holder is not None and w.d.holder.write_state(lease) is WriteState.SETTLED


def test_a_failure_of_the_writers_request_waits_for_its_write() -> None:
    w = PushWorld(bandwidth=384.0)  # the write takes 1 s
    lease = w.registered()
    w.write(1.0, local=[5, 6, 7], remote=[0, 1, 2])
    assert w.d.holder is not None
    w.d.holder.revoke(w.net.now, lease)
    w.run(w.net.now + 0.5)
    # P heard the Revoke, but its write still reads P's blocks: the failure is held back.
    assert w.failed == [] and w.p.stats.failures_held == 1
    assert w.fenced and w.freed == []
    w.run(w.net.now + 1.0)
    assert [reason for _, reason in w.failed] == ["revoked"]
    assert [reason for _, reason in w.freed] == [ReleaseReason.REVOKED]
