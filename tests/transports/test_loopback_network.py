"""Loopback network: exact-time delivery, seeded reproducibility, each fault kind."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.transport import (
    BadMetadata,
    FrameTooLarge,
    PeerLost,
    PeerUnreachable,
    Received,
    Transport,
    TransportClosed,
    UnknownPeer,
)
from kvproto_transports.loopback import LinkFaults, LoopbackNetwork, LoopbackTransport


def pair(
    net: LoopbackNetwork, a: str = "A", b: str = "B"
) -> tuple[LoopbackTransport, LoopbackTransport, str, str]:
    """Two endpoints that added each other; returns (a, b, b's id at a, a's id at b)."""
    ea, eb = net.endpoint(a), net.endpoint(b)
    return ea, eb, ea.add_peer(eb.metadata()), eb.add_peer(ea.metadata())


def trace(seed: int, faults: LinkFaults, n: int = 200) -> list[tuple[float, bytes]]:
    """(delivery time, payload) of n messages A -> B under ``faults``."""
    net = LoopbackNetwork(seed)
    a, b, to_b, _ = pair(net)
    net.set_link("A", "B", faults)
    for k in range(n):
        a.send(to_b, b"%d" % k)
        net.advance(net.now + 0.0005)
    out: list[tuple[float, bytes]] = []
    while (t := net.next_event_time()) is not None:
        net.advance(t)
        out += [(t, e.payload) for e in b.poll() if isinstance(e, Received)]
    return out


def test_endpoint_implements_the_transport_protocol() -> None:
    net = LoopbackNetwork()
    ep = net.endpoint("A")
    assert isinstance(ep, Transport)
    assert ep.name == "loopback"
    assert ep.local_peer == "A#1"


def test_delivery_happens_exactly_at_the_link_delay() -> None:
    net = LoopbackNetwork()
    a, b, to_b, _ = pair(net)
    net.set_link("A", "B", LinkFaults(delay=0.25))
    net.advance(1.0)
    a.send(to_b, b"x")
    assert net.next_event_time() == 1.25
    net.advance(1.2499)
    assert b.poll() == []
    net.advance(1.25)
    assert b.poll() == [Received(peer="A#1", payload=b"x")]
    assert net.next_event_time() is None
    assert net.now == 1.25


def test_time_never_runs_backwards_and_nothing_reads_a_real_clock() -> None:
    net = LoopbackNetwork(start=5.0)
    assert net.now == 5.0
    with pytest.raises(ValueError, match="forward"):
        net.advance(4.0)
    a, b, to_b, _ = pair(net)
    a.send(to_b, b"now")  # perfect link: due at net.now, not at any wall time
    assert b.poll() == []
    net.advance(5.0)
    assert [e.payload for e in b.poll() if isinstance(e, Received)] == [b"now"]


def test_jitter_alone_keeps_fifo_order() -> None:
    got = trace(3, LinkFaults(delay=0.001, jitter=0.01))
    assert [p for _, p in got] == [b"%d" % k for k in range(200)]
    assert [t for t, _ in got] == sorted(t for t, _ in got)


def test_same_seed_same_trace_and_another_seed_another() -> None:
    faults = LinkFaults(delay=0.001, jitter=0.002, drop=0.2, duplicate=0.2, reorder=0.2)
    assert trace(11, faults) == trace(11, faults)
    assert trace(11, faults) != trace(12, faults)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    drop=st.floats(0, 1),
    dup=st.floats(0, 1),
    reorder=st.floats(0, 1),
    jitter=st.floats(0, 0.01),
)
def test_any_faults_replay_identically(
    seed: int, drop: float, dup: float, reorder: float, jitter: float
) -> None:
    faults = LinkFaults(drop=drop, duplicate=dup, reorder=reorder, jitter=jitter, delay=0.001)
    first = trace(seed, faults, n=50)
    assert first == trace(seed, faults, n=50)
    assert {p for _, p in first} <= {b"%d" % k for k in range(50)}


def test_traffic_on_another_link_does_not_change_this_links_fate() -> None:
    def fates(extra_traffic: bool) -> list[bytes]:
        net = LoopbackNetwork(5, default_link=LinkFaults(drop=0.5))
        a, b, to_b, _ = pair(net)
        c = net.endpoint("C")
        to_c = a.add_peer(c.metadata())
        for k in range(100):
            a.send(to_b, b"%d" % k)
            if extra_traffic:
                a.send(to_c, b"noise")
        net.settle()
        return [e.payload for e in b.poll() if isinstance(e, Received)]

    assert fates(False) == fates(True)


def test_drop_loses_the_configured_fraction_and_counts_it() -> None:
    net = LoopbackNetwork(1)
    a, b, to_b, _ = pair(net)
    net.set_link("A", "B", LinkFaults(drop=0.3))
    for k in range(2000):
        a.send(to_b, b"%d" % k)
    net.settle()
    delivered = len(b.poll())
    assert 1300 < delivered < 1500
    assert net.stats.notifications_sent == 2000
    assert net.stats.dropped == 2000 - delivered
    assert net.stats.delivered == delivered
    assert a.stats.dropped == 2000 - delivered
    assert b.stats.delivered == delivered


def test_duplicate_delivers_twice_back_to_back() -> None:
    net = LoopbackNetwork()
    a, b, to_b, _ = pair(net)
    net.set_link("A", "B", LinkFaults(duplicate=1.0))
    a.send(to_b, b"1")
    a.send(to_b, b"2")
    net.settle()
    assert [e.payload for e in b.poll() if isinstance(e, Received)] == [b"1", b"1", b"2", b"2"]
    assert net.stats.duplicated == 2
    assert b.capabilities.may_duplicate and a.capabilities.may_duplicate


def test_reorder_lets_later_messages_overtake_and_is_declared() -> None:
    net = LoopbackNetwork(2)
    a, b, to_b, _ = pair(net)
    assert a.capabilities.ordered
    net.set_link("A", "B", LinkFaults(delay=0.001, reorder=0.3, reorder_window=0.01))
    assert not a.capabilities.ordered
    for k in range(100):
        a.send(to_b, b"%03d" % k)
        net.advance(net.now + 0.001)
    net.settle()
    got = [e.payload for e in b.poll() if isinstance(e, Received)]
    assert sorted(got) == [b"%03d" % k for k in range(100)]
    assert got != sorted(got)
    assert net.stats.reordered > 0


def test_partition_drops_both_ways_including_in_flight_until_healed() -> None:
    net = LoopbackNetwork(default_link=LinkFaults(delay=0.1))
    a, b, to_b, to_a = pair(net)
    a.send(to_b, b"in-flight")
    net.partition("A", "B")
    assert net.partitioned("B", "A")
    a.send(to_b, b"cut")
    b.send(to_a, b"cut")
    net.settle()
    assert b.poll() == [] and a.poll() == []
    assert net.stats.dropped == 3
    net.heal("A", "B")
    a.send(to_b, b"healed")
    net.settle()
    assert [e.payload for e in b.poll() if isinstance(e, Received)] == [b"healed"]
    assert a.poll() == []  # a partition alone is not a death: no PeerLost


def test_crash_reports_peer_lost_after_the_detection_delay_then_refuses_sends() -> None:
    net = LoopbackNetwork(detection_delay=0.5)
    a, b, to_b, _ = pair(net)
    net.advance(1.0)
    net.crash("B")
    a.send(to_b, b"into the void")  # not yet detected: accepted and lost
    net.advance(1.4999)
    assert a.poll() == []
    net.advance(1.5)
    assert a.poll() == [PeerLost(peer="B#1", reason="crashed")]
    with pytest.raises(PeerUnreachable):
        a.send(to_b, b"after detection")
    assert net.stats.peers_lost == 1
    assert net.stats.dropped == 1
    for call in (b.poll, b.metadata, lambda: b.send(to_b, b"x")):
        with pytest.raises(TransportClosed):
            call()


def test_messages_already_sent_by_a_crashed_endpoint_still_arrive() -> None:
    net = LoopbackNetwork(default_link=LinkFaults(delay=0.1))
    a, b, to_b, _ = pair(net)
    a.send(to_b, b"last words")
    net.crash("A")
    net.settle()
    assert [e.payload for e in b.poll() if isinstance(e, Received)] == [b"last words"]


def test_close_is_reported_like_a_death_with_reason_closed() -> None:
    net = LoopbackNetwork(detection_delay=0.2)
    a, b, _, _ = pair(net)
    b.close()
    b.close()
    net.settle()
    assert a.poll() == [PeerLost(peer="B#1", reason="closed")]


def test_restart_is_a_new_incarnation_and_faults_stay_on_the_link() -> None:
    net = LoopbackNetwork(detection_delay=0.3)
    a, _, to_b, _ = pair(net)
    net.set_link("A", "B", LinkFaults(delay=0.05))
    b2 = net.restart("B")
    assert (b2.local_peer, b2.incarnation, b2.base_name) == ("B#2", 2, "B")
    assert net.current("B") is b2
    assert b2.layout is None
    to_b2 = a.add_peer(b2.metadata())
    assert to_b2 == "B#2" != to_b
    a.send(to_b2, b"hi")
    assert net.next_event_time() == pytest.approx(0.05)
    net.settle()
    assert [e.payload for e in b2.poll() if isinstance(e, Received)] == [b"hi"]
    assert PeerLost(peer="B#1", reason="crashed") in a.poll()


def test_adding_a_dead_incarnation_reports_it_lost() -> None:
    net = LoopbackNetwork(detection_delay=0.3)
    a = net.endpoint("A")
    b = net.endpoint("B")
    stale = b.metadata()
    net.crash("B")
    assert a.add_peer(stale) == "B#1"
    net.settle()
    assert [type(e) for e in a.poll()] == [PeerLost]


def test_endpoint_names_and_incarnations_are_never_reused() -> None:
    net = LoopbackNetwork()
    net.endpoint("A")
    with pytest.raises(ValueError, match="exists"):
        net.endpoint("A")
    with pytest.raises(ValueError, match="'#'"):
        net.endpoint("A#2")
    net.crash("A")
    with pytest.raises(ValueError, match="already used"):
        net.endpoint("A", incarnation=1)
    assert net.endpoint("A", incarnation=7).local_peer == "A#7"
    assert net.names == ["A"]


def test_metadata_of_another_network_or_garbage_is_bad_metadata() -> None:
    net, other = LoopbackNetwork(), LoopbackNetwork()
    a = net.endpoint("A")
    foreign = other.endpoint("B").metadata()
    for blob in (foreign, b"", b"\xff", b'{"transport":"loopback"}'):
        with pytest.raises(BadMetadata):
            a.add_peer(blob)


def test_send_limits_and_unknown_peers() -> None:
    net = LoopbackNetwork()
    a = net.endpoint("A", max_notification_size=8)
    b = net.endpoint("B", max_notification_size=None)
    to_b = a.add_peer(b.metadata())
    to_a = b.add_peer(a.metadata())
    a.send(to_b, b"12345678")
    with pytest.raises(FrameTooLarge):
        a.send(to_b, b"123456789")
    b.send(to_a, b"x" * 1_000_000)  # unbounded
    with pytest.raises(UnknownPeer):
        a.send("C#1", b"x")
    assert a.capabilities.max_notification_size == 8
    assert b.capabilities.max_notification_size is None
    assert net.stats.notifications_sent == 2


def test_payload_is_copied_at_send() -> None:
    net = LoopbackNetwork()
    a, b, to_b, _ = pair(net)
    buf = bytearray(b"before")
    a.send(to_b, bytes(buf))
    buf[:] = b"after!"
    a.send(to_b, buf)  # type: ignore[arg-type]  # a bytearray is accepted and copied
    buf[:] = b"later!"
    net.settle()
    assert [e.payload for e in b.poll() if isinstance(e, Received)] == [b"before", b"after!"]


def test_a_crash_may_be_noticed_sooner_or_later_than_the_default() -> None:
    net = LoopbackNetwork(detection_delay=1.0)
    a, _, _, _ = pair(net)
    c = net.endpoint("C")
    a.add_peer(c.metadata())
    net.crash("B", detection_delay=0.1)
    net.crash("C")
    net.crash("C", detection_delay=0.0)  # already dead: no second report
    events = []
    while (t := net.next_event_time()) is not None:
        net.advance(t)
        events += [(t, e) for e in a.poll()]
    assert events == [
        (0.1, PeerLost(peer="B#1", reason="crashed")),
        (1.0, PeerLost(peer="C#1", reason="crashed")),
    ]
