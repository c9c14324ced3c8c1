"""How long a grant waits for its first claim (``LeaseConfig.claim_window``).

A request the router drops between the prefill's answer and any decoder is never
tracked: nobody will claim its lease, and its blocks are held until the grant lapses.
The grant's own deadline is the claim window (the ticket's ``expires_in``), by default
the lease extension; a claim inside it keeps the lease as any heartbeat does, a claim
after it is answered "lost" and the request recomputes without reading. Exact times
(30 s lease, 5 s interval, 20 s extension, 5 s read margin).
"""

from __future__ import annotations

import pytest

from kvproto import wire
from kvproto.config import ConfigError, LeaseConfig
from kvproto.events import ReadGo
from kvproto.holder import Holder
from kvproto.states import LeaseState

from .net import LinkFaults, Net

WINDOW = 5.0


def pair(config: LeaseConfig | None = None) -> Net:
    net = Net(config)
    net.add_holder("P0")
    net.add_reader("D0")
    return net


def test_a_grant_nobody_claims_is_freed_at_the_default_window_the_extension() -> None:
    config = LeaseConfig()
    assert config.grant_ttl == config.lease_extension == 20.0
    net = pair()
    ticket = net.grant("P0", "p-dropped")  # the router drops it: never tracked
    assert ticket.expires_in == 20.0 and ticket.deadline == 20.0
    net.run_until(60.0)
    assert net.freed_leases() == [(20.0, ticket.lease, "EXPIRED")]


def test_a_shorter_window_frees_a_dropped_grant_sooner_and_readers_keep_theirs() -> None:
    net = pair(LeaseConfig(claim_window=WINDOW))
    dropped = net.grant("P0", "p-dropped")
    ticket = net.grant("P0", "p-r")
    net.run_until(4.0)
    net.track("D0", "r", ticket)  # claimed at 4: held until 4 + extension, renewed on
    net.run_until(30.0)
    holder = net.holder("P0")
    assert net.freed_leases() == [(WINDOW, dropped.lease, "EXPIRED")]
    assert holder.lease_state(ticket.lease) is LeaseState.HELD
    assert holder.deadline(ticket.lease) == 29.0 + 20.0  # the tick at 29 renewed it
    go = net.start_read("D0", "r", duration=0.5)
    assert isinstance(go, ReadGo)
    net.run_until(40.0)
    assert net.freed_leases()[1:] == [(30.5, ticket.lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(30.5, "r")]
    net.check_no_silent_overlap()


def test_a_first_claim_after_the_window_fails_the_request_without_a_read() -> None:
    """The reader tracks at 4.9, its first request to this holder: the Hello anchored on
    the ticket reaches the holder at 5.05, after the grant lapsed at 5, and no answer can
    be signed with a token the holder dropped. The reader fails the request once the
    ticket's lease is surely over by its own clock (tracked + 5 s, drift included), at
    the next Hello retry; it never had an open session to read on."""
    net = pair(LeaseConfig(claim_window=WINDOW))
    net.links.default = LinkFaults(delay=0.15)
    ticket = net.grant("P0", "p-r")
    net.run_until(4.9)
    net.track("D0", "r", ticket)
    net.run_until(40.0)
    assert net.freed_leases() == [(WINDOW, ticket.lease, "EXPIRED")]
    assert [round(t, 6) for t in net.arrivals("D0", "P0", wire.Hello)] == [5.05, 10.05]
    assert [(round(t, 6), rid, reason) for t, rid, reason in net.failures()] == [
        (14.9, "r", "LEASE_LOST")
    ]
    assert net.confirmed == [] and net.transfers == []


def test_a_claim_after_the_window_on_an_open_session_is_answered_lost() -> None:
    net = pair(LeaseConfig(claim_window=WINDOW))
    first = net.grant("P0", "p-first")
    net.track("D0", "first", first)  # opens the session: its clock sample is known
    net.run_until(1.0)
    ticket = net.grant("P0", "p-r")  # due at 6
    net.run_until(5.9)
    net.links.default = LinkFaults(delay=0.2)
    net.track("D0", "r", ticket)  # claim leaves at 5.9, arrives at 6.1: too late
    net.run_until(10.0)
    assert (6.0, ticket.lease, "EXPIRED") in net.freed_leases()
    acks = [
        (d.arrived, msg.lost)
        for d in net.delivered
        if d.src == "P0" and isinstance(msg := wire.decode(d.payload), wire.HeartbeatAck)
    ]
    assert [(round(t, 6), lost) for t, lost in acks if lost] == [(6.3, [ticket.lease])]
    assert [(rid, reason) for _, rid, reason in net.failures()] == [("r", "LEASE_LOST")]
    assert net.confirmed == [] and net.transfers == []


def test_stock_decoders_get_the_whole_lease_to_claim() -> None:
    """With ``accept_legacy`` stock readers, which never see the ticket, may hold it: they
    assume vLLM's initial lease."""
    config = LeaseConfig(accept_legacy=True)
    assert config.grant_ttl == config.kv_lease_duration
    ticket = Holder(config, engine="P", incarnation=1).grant(0.0, request_id="r")
    assert ticket.expires_in == 30.0
    assert LeaseConfig(accept_legacy=True, claim_window=8.0).grant_ttl == 8.0


@pytest.mark.parametrize("window", [0.0, 30.5, -1.0, float("nan")])
def test_a_window_outside_the_lease_is_refused(window: float) -> None:
    with pytest.raises(ConfigError):
        LeaseConfig(claim_window=window)
