"""When a newly tracked lease's claim leaves: at the reader's next pump, not at the next tick.

Until the holder has the claim, the lease is not tied to the reader, so a reader that
dies before claiming is noticed only when the lease expires. Sending the claim at once
shrinks that window from one heartbeat interval (5 s by default) to one engine step.
Exact times with the default config (30 s lease, 5 s interval, 20 s extension).
"""

from __future__ import annotations

from kvproto import wire
from kvproto.states import LeaseState

from .net import Net

INTERVAL = 5.0


def _pair() -> Net:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    return net


def _tracked(net: Net, rid: str) -> int:
    ticket = net.grant("P0", "p-" + rid)
    net.track("D0", rid, ticket)
    return ticket.lease


def test_claim_of_a_lease_tracked_between_ticks_leaves_at_once() -> None:
    net = _pair()
    _tracked(net, "a")
    net.run_until(2.3)
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [0.0]
    lease_b = _tracked(net, "b")
    net.run_until(2.3)
    # The claim went out in the same pump as the track; the tick restarts from it.
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [0.0, 2.3]
    assert net.holder("P0").lease_state(lease_b) is LeaseState.HELD
    net.run_until(12.4)
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [
        0.0,
        2.3,
        2.3 + INTERVAL,
        2.3 + 2 * INTERVAL,
    ]


def test_tracks_of_one_step_share_one_heartbeat() -> None:
    net = _pair()
    _tracked(net, "a")
    net.run_until(1.0)
    reader = net.reader("D0")
    tickets = [net.grant("P0", f"p-{i}") for i in range(3)]
    for i, ticket in enumerate(tickets):  # one engine step tracks three requests
        reader.track(1.0, request_id=f"r{i}", ticket=ticket)
    net.collect()
    net.run_until(1.0)
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [0.0, 1.0]
    assert all(net.holder("P0").lease_state(t.lease) is LeaseState.HELD for t in tickets)


def test_reader_lost_right_after_a_track_frees_that_lease_peer_lost() -> None:
    net = _pair()
    _tracked(net, "a")
    net.run_until(3.0)
    lease_b = _tracked(net, "b")
    net.run_until(3.0)
    # The reader dies in the step after it tracked b: b's claim has already left,
    # so the transport's loss report frees b at once instead of at its expiry (30 s).
    net.crash("D0", detect_after=0.5)
    net.run_until(3.5)
    assert (3.5, lease_b, "PEER_LOST") in net.freed_leases()
