"""Loopback reads: real bytes, copied at completion time, notify strictly after the copy."""

from __future__ import annotations

import pytest

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout, BlockSlice, read_slices
from kvproto.transport import (
    FrameTooLarge,
    MemoryNotRegistered,
    ReadCompleted,
    ReadFailed,
    Received,
    TransportEvent,
)
from kvproto_transports.loopback import LinkFaults, LoopbackNetwork, LoopbackTransport

BLOCK = 64


def setup(
    delay: float = 0.0, bandwidth: float | None = None
) -> tuple[LoopbackNetwork, LoopbackTransport, LoopbackTransport, str]:
    """Holder H (2 regions x 4 blocks, block b of region r filled with bytes r*16+b),
    reader R (zeroed); returns (net, H, R, H's id at R)."""
    net = LoopbackNetwork(default_link=LinkFaults(delay=delay), read_bandwidth=bandwidth)
    h, r = net.endpoint("H"), net.endpoint("R")
    h.register_blocks(h.allocate_layout(2, BLOCK, 4))
    r.register_blocks(r.allocate_layout(2, BLOCK, 4))
    for region in range(2):
        for b in range(4):
            h.write_block(region, b, bytes([region * 16 + b]) * BLOCK)
    h_id = r.add_peer(h.metadata())
    h.add_peer(r.metadata())
    return net, h, r, h_id


def timeline(
    net: LoopbackNetwork, *eps: LoopbackTransport
) -> list[tuple[float, str, TransportEvent]]:
    """Step event by event; (time, endpoint, event) for everything observed."""
    out = []
    while (t := net.next_event_time()) is not None:
        net.advance(t)
        for ep in eps:
            out += [(t, ep.base_name, e) for e in ep.poll()]
    return out


def test_read_copies_real_bytes_and_completes_after_round_trip_plus_transfer() -> None:
    net, h, r, h_id = setup(delay=0.01, bandwidth=1000.0)
    rid = r.read_blocks(h_id, local_blocks=[0, 1], remote_blocks=[3, 2], notify=b"done")
    events = timeline(net, h, r)
    # 2 regions x 2 blocks x 64 B = 256 B at 1000 B/s, plus 2 x 10 ms of round trip.
    assert [(round(t, 9), who, e) for t, who, e in events] == [
        (0.276, "R", ReadCompleted(read_id=rid)),
        (0.286, "H", Received(peer="R#1", payload=b"done")),
    ]
    assert r.read_block(0, 0) == bytes([3]) * BLOCK
    assert r.read_block(1, 1) == bytes([16 + 2]) * BLOCK
    assert r.read_block(0, 2) == bytes(BLOCK)
    assert net.stats.reads_completed == 1 and r.stats.reads_started == 1


def test_data_is_taken_at_completion_not_at_issue() -> None:
    net, h, r, h_id = setup(delay=0.01)
    r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0])
    h.write_block(0, 0, b"\xaa" * BLOCK)  # the holder reuses the block while the read flies
    net.settle()
    assert r.read_block(0, 0) == b"\xaa" * BLOCK


def test_notify_is_delivered_strictly_after_the_copy_even_with_zero_latency() -> None:
    net, h, r, h_id = setup()
    rid = r.read_blocks(h_id, local_blocks=[1], remote_blocks=[1], notify=b"n")
    seen_data_at_notify: list[bytes] = []
    while (t := net.next_event_time()) is not None:
        net.advance(t)
        if any(isinstance(e, Received) for e in h.poll()):
            seen_data_at_notify.append(r.read_block(0, 1))
    assert seen_data_at_notify == [bytes([1]) * BLOCK]
    assert ReadCompleted(read_id=rid) in r.poll()


def test_sliced_reads_follow_tpmath() -> None:
    net = LoopbackNetwork()
    h0, h1, rd = net.endpoint("H0"), net.endpoint("H1"), net.endpoint("R")
    for ep, length in ((h0, 32), (h1, 32), (rd, 64)):
        ep.register_blocks(ep.allocate_layout(1, length, 2))
    h0.write_block(0, 1, b"\x01" * 32)
    h1.write_block(0, 1, b"\x02" * 32)
    for rank, holder in enumerate((h0, h1)):
        ls, rs = read_slices(0, 1, 2, rank)  # reader TP 1, holder TP 2
        rd.read_blocks(
            rd.add_peer(holder.metadata()),
            local_blocks=[0],
            remote_blocks=[1],
            local_slice=ls,
            remote_slice=rs,
        )
    net.settle()
    assert rd.read_block(0, 0) == b"\x01" * 32 + b"\x02" * 32
    # and the other way: a reader of TP 2 (rank 1) reads the second half of a whole block
    small = net.endpoint("S")
    small.register_blocks(small.allocate_layout(1, 32, 2))
    ls, rs = read_slices(1, 2, 1, 0)
    small.read_blocks(
        small.add_peer(rd.metadata()),
        local_blocks=[1],
        remote_blocks=[0],
        local_slice=ls,
        remote_slice=rs,
    )
    net.settle()
    assert small.read_block(0, 1) == b"\x02" * 32


def failure_of(net: LoopbackNetwork, r: LoopbackTransport, rid: int) -> str:
    net.settle()
    events = [e for e in r.poll() if isinstance(e, ReadCompleted | ReadFailed)]
    assert len(events) == 1 and isinstance(events[0], ReadFailed), events
    assert events[0].read_id == rid
    return events[0].reason


def test_remote_blocks_outside_the_layout_fail_and_copy_nothing() -> None:
    net, _, r, h_id = setup()
    rid = r.read_blocks(h_id, local_blocks=[0, 1], remote_blocks=[0, 4], notify=b"no")
    assert "outside" in failure_of(net, r, rid)
    assert r.read_block(0, 0) == bytes(BLOCK)  # validated before any byte moved


def test_local_mistakes_raise_at_once() -> None:
    _, _, r, h_id = setup()
    with pytest.raises(MemoryNotRegistered):
        r.read_blocks(h_id, local_blocks=[4], remote_blocks=[0])
    with pytest.raises(LocalProtocolError):
        r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0, 1])
    with pytest.raises(FrameTooLarge):
        r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0], notify=b"x" * 5000)
    with pytest.raises(LocalProtocolError):
        r.read_blocks(
            h_id, local_blocks=[0], remote_blocks=[0], local_slice=BlockSlice(index=0, parts=3)
        )


def test_read_from_unregistered_crashed_or_partitioned_holder_fails() -> None:
    net = LoopbackNetwork()
    h, r = net.endpoint("H"), net.endpoint("R")
    r.register_blocks(r.allocate_layout(1, BLOCK, 2))
    h_id = r.add_peer(h.metadata())
    assert "registered no memory" in failure_of(
        net, r, r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0])
    )
    h.register_blocks(h.allocate_layout(1, BLOCK, 2))
    net.partition("H", "R")
    assert "partitioned" in failure_of(
        net, r, r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0])
    )
    net.heal("H", "R")
    rid = r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0])
    net.crash("H")  # in flight
    assert "dead" in failure_of(net, r, rid)


def test_zero_block_read_completes_and_notifies_without_memory() -> None:
    net = LoopbackNetwork()
    h, r = net.endpoint("H"), net.endpoint("R")
    rid = r.read_blocks(
        r.add_peer(h.metadata()), local_blocks=[], remote_blocks=[], notify=b"full prefix hit"
    )
    net.settle()
    assert r.poll() == [ReadCompleted(read_id=rid)]
    assert h.poll() == [Received(peer="R#1", payload=b"full prefix hit")]


def test_notify_of_a_read_is_subject_to_the_links_faults() -> None:
    net, h, r, h_id = setup()
    net.set_link("R", "H", LinkFaults(drop=1.0))
    rid = r.read_blocks(h_id, local_blocks=[0], remote_blocks=[0], notify=b"lost done")
    net.settle()
    assert r.poll() == [ReadCompleted(read_id=rid)]
    assert h.poll() == []


def test_register_accepts_any_layout_and_backs_it_lazily() -> None:
    net = LoopbackNetwork()
    h = net.endpoint("H")
    huge = BlockLayout(
        region_addrs=(0x1000, 0x9000_0000), block_lens=(1 << 20, 1 << 20), num_blocks=100_000
    )
    h.register_blocks(huge)  # 200 GB of address space; only touched blocks cost memory
    h.write_block(1, 99_999, b"\x07" * 8, offset=16)
    assert h.read_block(1, 99_999)[16:24] == b"\x07" * 8
    with pytest.raises(MemoryNotRegistered):
        h.write_block(2, 0, b"x")
