"""One lease, many readers: several requests of one reader rank on one ticket (parallel
sampling's children), at exact times over tests/core/net.py.

Defaults: lease 30 s, heartbeat every 5 s, ack_timeout 5 s; links without delay, so a
frame arrives when it leaves and "at the next pump" is the time of the input itself.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.events import ReadDeclined, ReadGo
from kvproto.states import LeaseState, ReadState
from kvproto_transports.loopback import LinkFaults

from .net import Net


def pair() -> Net:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    return net


def heartbeats(net: Net, src: str = "D0", dst: str = "P0") -> list[tuple[float, wire.Heartbeat]]:
    out = []
    for d in net.delivered:
        if d.src == src and d.dst == dst:
            try:
                msg = wire.decode(d.payload)
            except Exception:
                continue
            if isinstance(msg, wire.Heartbeat):
                out.append((d.arrived, msg))
    return out


def one_done_confirms(net: Net, when: float, lease: int, rids: list[str], *, timeouts: int) -> None:
    """The lease's one done arrived at ``when``, freed it and confirmed ``rids`` then;
    ``timeouts`` dones had been held back until ``ack_timeout`` ran out."""
    assert net.arrivals("D0", "P0", wire.Done) == [when]
    assert net.freed_leases() == [(when, lease, "DONE")]
    assert sorted((t, rid) for t, _, rid in net.confirmed) == [(when, rid) for rid in rids]
    assert net.reader("D0").stats.fanout_done_timeouts == timeouts
    net.check_no_silent_overlap()


def track_two(net: Net) -> int:
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket)  # vLLM: "0_<parent>" and "1_<parent>", one ticket
    net.track("D0", "c1", ticket)
    return ticket.lease


def test_two_readers_of_one_ticket_both_confirmed_holder_frees_at_the_later_done() -> None:
    net = pair()
    lease = track_two(net)
    net.run_until(1.0)
    go0 = net.start_read("D0", "c0", duration=1.0)  # lands at 2.0
    assert isinstance(go0, ReadGo) and go0.orders[0].notify == b""  # c1 still to read
    net.run_until(1.5)
    go1 = net.start_read("D0", "c1", duration=1.0)  # lands at 2.5
    assert isinstance(go1, ReadGo) and go1.orders[0].notify == b""  # c0 still reading
    net.run_until(10.0)
    # One done, when the later read landed; it frees the lease and confirms both.
    assert net.arrivals("D0", "P0", wire.Done) == [2.5]
    assert net.freed_leases() == [(2.5, lease, "DONE")]
    assert sorted((t, rid) for t, _, rid in net.confirmed) == [(2.5, "c0"), (2.5, "c1")]
    assert net.failures() == []
    # One claim for both (the lease set holds the lease once).
    claims = [c.lease for _, hb in heartbeats(net) for c in hb.claims]
    assert claims == [lease]
    assert net.reader("D0").stats.fanout_joins == 1
    net.check_no_silent_overlap()


def test_sequential_reads_the_done_rides_the_last() -> None:
    net = pair()
    lease = track_two(net)
    net.run_until(1.0)
    net.start_read("D0", "c0", duration=1.0)  # lands at 2.0, its done held back
    net.run_until(3.0)
    assert net.reader("D0").state("c0") == {0: ReadState.AWAITING_ACK}
    assert net.holder("P0").lease_state(lease) is LeaseState.HELD
    go1 = net.start_read("D0", "c1", duration=1.0)
    assert isinstance(go1, ReadGo) and go1.orders[0].notify != b""  # the last read: the done
    net.run_until(10.0)
    assert net.arrivals("D0", "P0", wire.Done) == [4.0]
    assert net.freed_leases() == [(4.0, lease, "DONE")]
    assert sorted((t, rid) for t, _, rid in net.confirmed) == [(4.0, "c0"), (4.0, "c1")]
    net.check_no_silent_overlap()


def test_a_sibling_finishing_unread_frees_at_the_others_done_not_by_expiry() -> None:
    net = pair()
    lease = track_two(net)
    net.run_until(2.0)
    net.finish("D0", "c0")  # given up before reading: no abort, c1 still reads
    net.run_until(3.0)
    assert [t for t, hb in heartbeats(net) if hb.aborts] == []
    net.start_read("D0", "c1", duration=1.0)
    net.run_until(40.0)
    assert net.freed_leases() == [(4.0, lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(4.0, "c1")]
    assert net.failures() == []


def test_a_sibling_leaving_unread_after_the_others_read_sends_the_done_at_once() -> None:
    net = pair()
    lease = track_two(net)
    net.run_until(1.0)
    net.start_read("D0", "c1", duration=1.0)  # lands at 2.0; c0 has not begun
    net.run_until(3.0)
    assert net.freed_leases() == []
    net.finish("D0", "c0")
    net.run_until(40.0)
    assert net.arrivals("D0", "P0", wire.Done) == [3.0]
    assert net.freed_leases() == [(3.0, lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(3.0, "c1")]


def test_a_sibling_that_does_not_begin_is_waited_for_ack_timeout_then_declined() -> None:
    """Its blocks may wait for the landed sibling's (vLLM under block pressure): the done
    is held back at most ack_timeout, and a read begun after it went is not trusted."""
    net = pair()
    lease = track_two(net)
    net.run_until(1.0)
    net.start_read("D0", "c1", duration=1.0)  # lands at 2.0
    net.run_until(10.0)
    assert net.arrivals("D0", "P0", wire.Done) == [7.0]  # 2.0 + ack_timeout
    assert net.freed_leases() == [(7.0, lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(7.0, "c1")]
    late = net.start_read("D0", "c0")
    assert late == ReadDeclined(reason=late.reason) and late.reason.name == "LEASE_LOST"
    assert net.reader("D0").stats.fanout_late_reads == 1
    assert net.reader("D0").stats.fanout_done_timeouts == 1
    assert net.arrivals("D0", "P0", wire.Done) == [7.0]  # the declined read sent nothing


def test_a_sibling_tracked_after_a_lone_read_began_is_declined_not_vouched_for() -> None:
    """vLLM hands the scheduler each child in its own message: the first can be scheduled
    and read alone, its done riding its read, before the next arrives. That done frees
    the blocks; a read the sibling began later must not take its verdict."""
    net = pair()
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket)
    net.run_until(1.0)
    go0 = net.start_read("D0", "c0", duration=0.5)  # lands at 1.5 with the done
    assert isinstance(go0, ReadGo) and go0.orders[0].notify != b""
    net.run_until(1.2)
    net.track("D0", "c1", ticket)  # declined at once: nothing waits for a timer
    net.run_until(1.3)
    late = net.start_read("D0", "c1", duration=1.0)
    assert isinstance(late, ReadDeclined) and late.reason.name == "LEASE_LOST"
    net.run_until(40.0)
    assert net.freed_leases() == [(1.5, ticket.lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(1.5, "c0")]
    assert net.failures() == [(1.2, "c1", "LEASE_LOST")]
    assert net.arrivals("D0", "P0", wire.Done) == [1.5]
    assert net.reader("D0").stats.fanout_late_reads == 1
    net.check_no_silent_overlap()


def test_expected_readers_keep_the_first_reads_done_until_a_late_sibling_read() -> None:
    """The holder's count of readers (the children it prefilled) rides every child's
    track: the first child's landed read waits for the sibling not yet tracked."""
    net = pair()
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket, readers=2)
    net.run_until(1.0)
    go0 = net.start_read("D0", "c0", duration=0.5)  # lands at 1.5, its done held back
    assert isinstance(go0, ReadGo) and go0.orders[0].notify == b""
    net.run_until(1.7)
    assert net.freed_leases() == []
    net.track("D0", "c1", ticket, readers=2)
    go1 = net.start_read("D0", "c1", duration=1.0)  # the last read: the done rides it
    assert isinstance(go1, ReadGo) and go1.orders[0].notify != b""
    net.run_until(40.0)
    one_done_confirms(net, 2.7, ticket.lease, ["c0", "c1"], timeouts=0)
    assert net.failures() == []
    claims = [c.lease for _, hb in heartbeats(net) for c in hb.claims]
    assert claims == [ticket.lease]  # the first track claimed; the sibling joined it


def test_an_expected_reader_that_never_comes_is_waited_for_ack_timeout_only() -> None:
    net = pair()
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket, readers=3)
    net.track("D0", "c1", ticket, readers=3)
    net.run_until(1.0)
    net.start_read("D0", "c0", duration=0.5)
    net.start_read("D0", "c1", duration=1.0)  # lands at 2.0; the third never comes
    net.run_until(40.0)
    one_done_confirms(net, 7.0, ticket.lease, ["c0", "c1"], timeouts=1)  # 2.0 + ack_timeout


def test_a_lone_reader_told_it_has_siblings_aborts_unread_as_one() -> None:
    net = pair()
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket, readers=2)
    net.run_until(2.0)
    net.finish("D0", "c0")  # the siblings were never tracked (a whole parent aborted)
    net.run_until(10.0)
    aborts = [(t, [c.lease for c in hb.aborts]) for t, hb in heartbeats(net) if hb.aborts]
    assert aborts == [(2.0, [ticket.lease])]
    assert net.freed_leases() == [(2.0, ticket.lease, "ABORTED")]


def test_all_siblings_unread_abort_at_the_last_finish_and_other_reads_go_on() -> None:
    net = pair()
    lease = track_two(net)
    other = net.grant("P0", "p-other")
    net.track("D0", "r2", other)
    net.run_until(2.0)
    net.finish("D0", "c0")
    net.run_until(3.0)
    assert net.freed_leases() == []
    net.finish("D0", "c1")  # the last reader leaves unread: the abort leaves now
    go = net.start_read("D0", "r2", duration=0.5)  # the same session, the same instant
    assert isinstance(go, ReadGo)
    net.run_until(10.0)
    aborts = [(t, [c.lease for c in hb.aborts]) for t, hb in heartbeats(net) if hb.aborts]
    assert aborts == [(3.0, [lease])]
    assert net.freed_leases() == [(3.0, lease, "ABORTED"), (3.5, other.lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(3.5, "r2")]


def test_claims_leave_at_the_next_pump_and_a_sibling_adds_none() -> None:
    net = pair()
    first = net.grant("P0", "p-first")
    net.track("D0", "r0", first)  # opens the session
    net.run_until(0.3)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "c0", ticket)
    net.run_until(0.6)
    net.track("D0", "c1", ticket)
    net.run_until(6.0)
    claims = [(t, [c.lease for c in hb.claims]) for t, hb in heartbeats(net) if hb.claims]
    assert claims == [(0.0, [first.lease]), (0.3, [ticket.lease])]
    assert [t for t, _ in heartbeats(net)] == [0.0, 0.3, 5.3]


def test_holder_tp2_siblings_one_done_per_holder_rank() -> None:
    net = Net()
    net.add_holder("P0", rank=0, tp_size=2)
    net.add_holder("P1", rank=1, tp_size=2)
    net.add_reader("D0")
    ticket = net.grant("P0", "p-r")
    net.adopt("P1", ticket)
    net.track("D0", "c0", ticket)
    net.track("D0", "c1", ticket)
    net.run_until(1.0)
    net.start_read("D0", "c0", duration=0.5)
    net.start_read("D0", "c1", duration=1.0)
    net.run_until(10.0)
    for holder in ("P0", "P1"):
        assert net.arrivals("D0", holder, wire.Done) == [2.0]
        assert net.freed_leases(holder) == [(2.0, ticket.lease, "DONE")]
    assert sorted(rid for _, _, rid in net.confirmed) == ["c0", "c1"]
    net.check_no_silent_overlap()


def test_reader_tp2_each_rank_counts_once_for_its_siblings() -> None:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    for reader in ("D0", "D1"):
        net.track(reader, "c0", ticket)
        net.track(reader, "c1", ticket)
    net.run_until(1.0)
    for reader in ("D0", "D1"):
        net.start_read(reader, "c0", duration=0.5)
    net.run_until(2.0)
    assert net.freed_leases() == []  # the siblings c1 still read on both ranks
    for reader in ("D0", "D1"):
        net.start_read(reader, "c1", duration=0.5)
    net.run_until(10.0)
    assert net.freed_leases() == [(2.5, ticket.lease, "DONE")]
    assert len(net.confirmed) == 4
    net.check_no_silent_overlap()


def test_a_late_verdict_fences_every_sibling() -> None:
    net = pair()
    lease = track_two(net)
    net.run_until(1.0)
    net.set_link("D0", "P0", LinkFaults(drop=1.0))  # no heartbeat reaches P from now on
    net.start_read("D0", "c0", duration=29.0)
    net.start_read("D0", "c1", duration=29.5)  # lands after the lease lapsed (at 20)
    net.run_until(30.2)
    net.set_link("D0", "P0", LinkFaults())
    net.run_until(60.0)
    assert (20.0, lease, "EXPIRED") in net.freed_leases()  # the claim at 0 + extension
    assert net.confirmed == []
    assert sorted(rid for _, rid, _ in net.failures()) == ["c0", "c1"]
    net.check_no_silent_overlap()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=4),
    plan=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=4.0),
            st.floats(min_value=0.5, max_value=12.0),
            st.booleans(),
            st.booleans(),
        ),
        min_size=4,
        max_size=4,
    ),
    told=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**16),
    lossy=st.booleans(),
)
def test_property_siblings_never_trust_a_read_overlapping_a_free(
    n: int, plan: list[tuple[float, float, bool, bool]], told: bool, seed: int, lossy: bool
) -> None:
    """Siblings are tracked at any time (with or without the count of readers), begin,
    finish or never read, in any order, over a link that drops, duplicates and
    reorders: no confirmed read overlapped a free, every request ends confirmed, failed
    or finished, and the holder frees the lease once."""
    net = Net(seed=seed)
    net.add_holder("P0")
    net.add_reader("D0")
    if lossy:
        faults = LinkFaults(drop=0.1, duplicate=0.1, reorder=0.1, reorder_window=0.05, jitter=0.05)
        net.set_link("D0", "P0", faults)
        net.set_link("P0", "D0", faults)
    ticket = net.grant("P0", "p-r")
    ids = [f"c{i}" for i in range(n)]
    reader = net.reader("D0")
    for rid, (track_at, after, reads, leaves) in zip(ids, plan, strict=False):

        def track(rid: str = rid) -> None:
            net.track("D0", rid, ticket, readers=n if told else 1)

        def act(rid: str = rid, reads: bool = reads, leaves: bool = leaves) -> None:
            if not reader.is_tracked(rid):
                return
            if reads and reader.ready_to_read(rid):
                net.start_read("D0", rid, duration=0.5)
            elif leaves:
                net.finish("D0", rid)

        net.at(track_at, track)
        net.at(track_at + after, act)
    # vLLM finishes every request in the end (after its read's verdict, or unread).
    net.at(20.0, lambda: [net.finish("D0", rid) for rid in ids])
    net.run_until(80.0)
    net.check_no_silent_overlap()
    assert len(net.freed_leases()) == 1
    confirmed = {rid for _, _, rid in net.confirmed}
    failed = {rid for _, rid, _ in net.failures()}
    assert not confirmed & failed
    if not lossy and confirmed:
        assert net.freed_leases()[0][2] == "DONE"
