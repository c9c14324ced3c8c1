"""Heterogeneous TP (several holder or reader ranks) and turn-2 leases across skewed clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import ReadDeclined, ReadDeferred, ReadGo
from kvproto.states import LeaseState
from kvproto.tpmath import BlockSlice
from kvproto_transports.loopback import LinkFaults

from .net import Net


def test_holder_tp1_reader_tp2_needs_two_distinct_ranks() -> None:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.track("D1", "r", ticket)
    net.run_until(3.0)
    go0 = net.start_read("D0", "r")
    assert isinstance(go0, ReadGo)
    # Each reader rank reads its half of every holder block.
    assert [(o.holder_rank, o.local_slice, o.remote_slice) for o in go0.orders] == [
        (0, BlockSlice.FULL, BlockSlice(index=0, parts=2))
    ]
    net.run_until(4.0)
    h = net.holder("P0")
    assert h.lease_state(ticket.lease) is LeaseState.HELD  # one of two consumers
    assert [rid for _, r, rid in net.confirmed if r == "D0"] == ["r"]  # its half is valid
    go1 = net.start_read("D1", "r")
    assert isinstance(go1, ReadGo)
    assert go1.orders[0].remote_slice == BlockSlice(index=1, parts=2)
    net.run_until(5.0)
    assert net.freed_leases() == [(4.0, ticket.lease, "DONE")]
    assert sorted(r for _, r, _ in net.confirmed) == ["D0", "D1"]


def test_one_reader_rank_crashing_after_its_peer_read_expires_the_lease() -> None:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.track("D1", "r", ticket)
    net.run_until(12.0)
    net.start_read("D0", "r")
    net.run_until(13.0)
    net.crash("D1")  # last heartbeat from D1 arrived at 10
    net.run_until(100.0)
    assert net.freed_leases() == [(30.0, ticket.lease, "EXPIRED")]


def holder_tp2(net: Net) -> None:
    net.add_holder("P0", rank=0, tp_size=2)
    net.add_holder("P1", rank=1, tp_size=2)


def test_holder_tp2_reader_tp1_reads_from_both_holder_ranks() -> None:
    net = Net()
    holder_tp2(net)
    net.add_reader("D0")
    ticket = net.grant("P0", "p-r")  # minted once (vLLM: the scheduler) ...
    net.adopt("P1", ticket)  # ... adopted by every holder rank
    net.track("D0", "r", ticket)
    assert [(c.engine, c.rank) for _, _, c in net.connects] == [("P", 0), ("P", 1)]
    net.run_until(11.0)
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [0.0, 5.0, 10.0]
    assert net.arrivals("D0", "P1", wire.Heartbeat) == [0.0, 5.0, 10.0]
    go = net.start_read("D0", "r", duration=0.5)
    assert isinstance(go, ReadGo)
    assert sorted((o.holder_rank, o.peer, o.local_slice, o.remote_slice) for o in go.orders) == [
        (0, "P0", BlockSlice(index=0, parts=2), BlockSlice.FULL),
        (1, "P1", BlockSlice(index=1, parts=2), BlockSlice.FULL),
    ]
    net.run_until(12.0)
    assert sorted(net.freed_leases(h) for h in ("P0", "P1")) == [
        [(11.5, ticket.lease, "DONE")],
        [(11.5, ticket.lease, "DONE")],
    ]
    assert [rid for _, _, rid in net.confirmed] == ["r"]
    net.check_no_silent_overlap()


def test_confirmation_needs_every_holder_rank() -> None:
    """P1 never hears the heartbeats: its copy lapses; the read is fenced although P0 said HELD."""
    net = Net()
    holder_tp2(net)
    net.add_reader("D0")
    ticket = net.grant("P0", "p-r")
    net.adopt("P1", ticket)
    net.track("D0", "r", ticket)
    net.run_until(1.0)
    net.set_link("D0", "P1", LinkFaults(drop=1.0))
    net.run_until(12.0)
    go = net.start_read("D0", "r", duration=10.0)  # ends at 22; P1's copy ended at 20
    assert isinstance(go, ReadGo)
    net.run_until(60.0)
    assert (20.0, ticket.lease, "EXPIRED") in net.freed_leases("P1")  # claim at 0 + 20
    assert net.confirmed == []
    assert net.failures("D0")[0][1:] == ("r", "FENCED_LATE")
    net.check_no_silent_overlap()


def test_holder_tp2_reader_tp4_counts_two_consumers_per_holder_rank() -> None:
    net = Net()
    holder_tp2(net)
    for rank in range(4):
        net.add_reader(f"D{rank}", rank=rank, tp_size=4)
    ticket = net.grant("P0", "p-r")
    net.adopt("P1", ticket)
    for rank in range(4):
        net.track(f"D{rank}", "r", ticket)
    net.run_until(2.0)
    for rank in (0, 2):  # one reader of each holder rank
        net.start_read(f"D{rank}", "r")
    net.run_until(3.0)
    assert net.freed == []
    net.start_read("D1", "r")
    net.run_until(4.0)
    assert [h for _, h, _ in net.freed] == ["P0"]
    net.start_read("D3", "r")
    net.run_until(5.0)
    assert sorted(h for _, h, _ in net.freed) == ["P0", "P1"]
    assert len(net.confirmed) == 4


def test_replicated_kv_reader_tp2_reads_whole_blocks_from_one_holder_rank() -> None:
    """MLA, P TP 1 -> D TP 2: each reader rank reads the whole latent block; P waits for both."""
    net = Net()
    net.add_holder("P0")
    for rank in range(2):
        net.add_reader(f"D{rank}", rank=rank, tp_size=2, replicated_kv=True)
    ticket = net.grant("P0", "p-r")
    for rank in range(2):
        net.track(f"D{rank}", "r", ticket)
    net.run_until(3.0)
    go0 = net.start_read("D0", "r", duration=0.5)
    assert isinstance(go0, ReadGo)
    assert [(o.holder_rank, o.local_slice, o.remote_slice, o.carries_data) for o in go0.orders] == [
        (0, BlockSlice.FULL, BlockSlice.FULL, True)
    ]
    net.run_until(4.0)
    assert net.freed == []  # one of its two consumers
    assert net.holder("P0").lease_state(ticket.lease) is LeaseState.HELD
    go1 = net.start_read("D1", "r", duration=0.5)
    assert isinstance(go1, ReadGo)
    assert go1.orders[0].remote_slice == BlockSlice.FULL
    net.run_until(5.0)
    assert net.freed_leases() == [(4.5, ticket.lease, "DONE")]
    assert sorted(r for _, r, _ in net.confirmed) == ["D0", "D1"]


def test_replicated_kv_holder_tp2_reads_one_rank_and_sends_the_other_its_done() -> None:
    """MLA, P TP 2 -> D TP 1: the data comes from P0 alone; P1, read from by nobody, still
    gets its done with the read and frees at the same instant (no lease left to lapse)."""
    net = Net()
    holder_tp2(net)
    net.add_reader("D0", replicated_kv=True)
    ticket = net.grant("P0", "p-r")
    net.adopt("P1", ticket)
    net.track("D0", "r", ticket)
    net.run_until(11.0)
    go = net.start_read("D0", "r", duration=0.5)
    assert isinstance(go, ReadGo)
    assert sorted(
        (o.holder_rank, o.carries_data, o.local_slice, o.remote_slice) for o in go.orders
    ) == [
        (0, True, BlockSlice.FULL, BlockSlice.FULL),
        (1, False, BlockSlice.FULL, BlockSlice.FULL),
    ]
    net.run_until(12.0)
    assert [net.freed_leases(h) for h in ("P0", "P1")] == [
        [(11.5, ticket.lease, "DONE")],
        [(11.5, ticket.lease, "DONE")],
    ]
    assert [rid for _, _, rid in net.confirmed] == ["r"]


def test_replicated_kv_holder_tp4_reader_tp2_spreads_ranks_as_stock() -> None:
    """Reader rank r reads from holder rank r * 4 // 2 (stock's choice); the others: done only."""
    net = Net()
    for rank in range(4):
        net.add_holder(f"P{rank}", rank=rank, tp_size=4)
    for rank in range(2):
        net.add_reader(f"D{rank}", rank=rank, tp_size=2, replicated_kv=True)
    ticket = net.grant("P0", "p-r")
    for rank in range(1, 4):
        net.adopt(f"P{rank}", ticket)
    for rank in range(2):
        net.track(f"D{rank}", "r", ticket)
    net.run_until(2.0)
    read_from = {}
    for rank in range(2):
        go = net.start_read(f"D{rank}", "r")
        assert isinstance(go, ReadGo)
        read_from[rank] = sorted(o.holder_rank for o in go.orders if o.carries_data)
    assert read_from == {0: [0], 1: [2]}
    net.run_until(3.0)
    assert sorted(h for _, h, _ in net.freed) == ["P0", "P1", "P2", "P3"]
    assert len(net.confirmed) == 2


@pytest.mark.parametrize("holder_offset", [3600.0, -3600.0, 0.0])
def test_turn2_lease_across_skewed_clocks(holder_offset: float) -> None:
    """Turn 2: D holds 480 s blocks, P reads them after the client's next turn. The
    holder's clock is an hour off; the reader's bound must stay at or below the truth."""
    net = Net()
    net.add_holder("H", offset=holder_offset)
    net.add_reader("R")
    net.set_link("R", "H", LinkFaults(delay=0.03))
    net.set_link("H", "R", LinkFaults(delay=0.01))
    ticket = net.grant("H", "turn2", ttl=480.0)
    assert ticket.deadline == holder_offset + 480.0
    net.run_until(100.0)  # the ticket waits at the client
    net.track("R", "t2", ticket)
    reader = net.reader("R")
    for t in [100.04, 100.5, 150.0, 300.0, 470.0]:
        net.run_until(t)
        bound = reader.deadline_bound(net.local("R"), "t2")
        true_deadline = net.holder("H").deadline(ticket.lease) - holder_offset
        assert bound <= true_deadline
        assert bound >= true_deadline - 1.0  # and not uselessly pessimistic
    assert isinstance(net.start_read("R", "t2", duration=0.2), ReadGo)
    net.run_until(480.0)
    assert [rid for _, _, rid in net.confirmed] == ["t2"]


def test_turn2_read_declined_near_the_deadline_with_skew() -> None:
    net = Net()
    net.add_holder("H", offset=3600.0)
    net.add_reader("R")
    net.links.default = LinkFaults(delay=0.02)
    ticket = net.grant("H", "turn2", ttl=480.0)
    net.run_until(10.0)
    net.track("R", "t2", ticket)
    net.run_until(440.0)
    net.pause("R", 476.0)  # stalled: no heartbeat pushed the deadline past 480 yet
    net.run_until(476.0)
    # The lease is not known to end (a heartbeat arriving before 480 renews it to 496): the
    # reader defers instead of declining, and reads once the heartbeat is acknowledged.
    result = net.start_read("R", "t2")
    assert isinstance(result, ReadDeferred)
    net.run_until(476.1)
    assert isinstance(net.start_read("R", "t2"), ReadGo)


def test_turn2_read_declined_past_max_hold_with_skew() -> None:
    net = Net()
    net.add_holder("H", offset=3600.0, config=LeaseConfig(max_hold=480.0))
    net.add_reader("R", config=LeaseConfig(max_hold=480.0))
    net.links.default = LinkFaults(delay=0.02)
    ticket = net.grant("H", "turn2", ttl=480.0)
    net.run_until(10.0)
    net.track("R", "t2", ticket)
    net.run_until(440.0)
    net.pause("R", 476.0)
    net.run_until(476.0)
    result = net.start_read("R", "t2")  # the hard cap at 480: renewing cannot help
    assert result == ReadDeclined(reason=result.reason) and isinstance(result, ReadDeclined)


@settings(max_examples=25, deadline=None)
@given(
    holder_offset=st.floats(-1e5, 1e5),
    reader_offset=st.floats(-1e5, 1e5),
    up=st.floats(0.0, 0.5),
    down=st.floats(0.0, 0.5),
    wait=st.floats(0.0, 300.0),
    probes=st.lists(st.floats(0.0, 600.0), min_size=1, max_size=8),
)
def test_reader_bound_never_exceeds_true_deadline(  # noqa: PLR0917
    holder_offset: float,
    reader_offset: float,
    up: float,
    down: float,
    wait: float,
    probes: list[float],
) -> None:
    net = Net()
    net.add_holder("H", offset=holder_offset)
    net.add_reader("R", offset=reader_offset)
    net.set_link("R", "H", LinkFaults(delay=up))
    net.set_link("H", "R", LinkFaults(delay=down))
    ticket = net.grant("H", "t", ttl=480.0)
    net.run_until(wait)
    net.track("R", "t", ticket)
    for t in sorted(wait + p for p in probes):
        net.run_until(t)
        h = net.holder("H")
        if h.lease_state(ticket.lease) is not LeaseState.HELD:
            break
        bound = net.reader("R").deadline_bound(net.local("R"), "t") - reader_offset
        true_deadline = h.deadline(ticket.lease) - holder_offset
        assert bound <= true_deadline + 1e-6 * (1 + abs(holder_offset) + abs(reader_offset))


def test_losing_one_reader_rank_never_moves_the_deadline_earlier() -> None:
    """S2 with two reader ranks: PeerLost of the rank that heartbeated last keeps its
    renewal (the lease lives on through the other rank's session)."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.run_until(2.0)
    net.track("D1", "r", ticket)  # D1 beats at 2, 7, 12 ...
    net.run_until(13.0)
    net.crash("D1")  # silent: its session lives until 12 + 20 = 32
    net.run_until(21.0)  # D0's beat at 20: its session until 40
    h = net.holder("P0")
    assert h.deadline(ticket.lease) == 40.0
    net.crash("D0")  # and the transport reports this one
    h.peer_lost(net.local("P0"), "D0")
    net.collect()
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert h.deadline(ticket.lease) == 40.0  # not 32
    net.run_until(100.0)
    assert net.freed_leases() == [(40.0, ticket.lease, "EXPIRED")]
