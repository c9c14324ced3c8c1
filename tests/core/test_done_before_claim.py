"""A done that reaches the holder before the heartbeat carrying the lease's claim.

Over NIXL after a partition heals, the heartbeat with a lease's first claim can be
lost or overtaken by the READ's done frame. The done carries the same proof as the
claim (``wire.Done.claim``) on the same authenticated session, so it claims: the
holder records the claimer (engine, TP layout, expected consumer count) and counts
the done, exactly as if the claim had come first. What it never does: count a done
without a valid proof, from another TP layout than the lease's first claimer, or for
a lease that had already ended (that read is fenced LATE, as after a claim).

Default config: 30 s lease, 5 s interval, 20 s extension, 5 s read margin; an unclaimed
grant lives 20 s (the claim window).
"""

from __future__ import annotations

from collections.abc import Callable

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import ReadGo, SendFrame
from kvproto.holder import Holder
from kvproto.states import LeaseState, ReadState
from kvproto.ticket import LeaseTicket, claim_proof
from kvproto_transports.loopback import LinkFaults

from .net import Net
from .rawsession import open_session

GRANT_TTL = LeaseConfig().grant_ttl
HELD, LATE, REFUSED = wire.DoneVerdict.HELD, wire.DoneVerdict.LATE, wire.DoneVerdict.REFUSED


def _claims(payload: bytes) -> list[int]:
    """Leases claimed by a heartbeat frame (empty for any other frame)."""
    msg = wire.decode(payload)
    return [c.lease for c in msg.claims] if isinstance(msg, wire.Heartbeat) else []


def drop_claims_from(reader: str) -> Callable[[str, str, bytes], bool]:
    """A frame filter that loses every heartbeat of ``reader`` that carries a claim."""
    return lambda src, dst, payload: not (src == reader and _claims(payload))


def one_pair() -> tuple[Net, LeaseTicket]:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    net.frame_filter = drop_claims_from("D0")
    ticket = net.grant("P0", "p-r1")
    net.track("D0", "r1", ticket)
    return net, ticket


def done_acks(net: Net, reader: str = "D0") -> list[tuple[float, int]]:
    """(arrival, verdict) of every DoneAck the holder sent ``reader``."""
    out = []
    for d in net.delivered:
        if d.src == "P0" and d.dst == reader:
            msg = wire.decode(d.payload)
            if isinstance(msg, wire.DoneAck):
                out.append((d.arrived, msg.verdict))
    return out


def test_done_whose_claim_heartbeat_was_lost_counts_as_claim_and_done() -> None:
    net, ticket = one_pair()
    net.run_until(12.0)
    holder, reader = net.holder("P0"), net.reader("D0")
    # Every claim was lost: the lease lives on its own deadline, the reader never
    # heard it was held, yet its session is open and heartbeating.
    claimed = [t for t, src, _, p in net.sent if src == "D0" and ticket.lease in _claims(p)]
    assert claimed == [0.0, 5.0, 10.0]
    assert holder.lease_state(ticket.lease) is LeaseState.GRANTED
    assert holder.deadline(ticket.lease) == GRANT_TTL
    assert reader.state("r1") == {0: ReadState.TRACKED}
    go = net.start_read("D0", "r1", duration=0.5)
    assert isinstance(go, ReadGo)
    net.run_until(20.0)
    # The done claimed and was the last expected one: freed at its arrival, HELD.
    assert net.freed_leases() == [(12.5, ticket.lease, "DONE")]
    assert done_acks(net) == [(12.5, HELD)]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(12.5, "r1")]
    assert net.failures() == []
    assert reader.state("r1") == {0: ReadState.CONFIRMED}
    stats = holder.stats_snapshot()
    assert stats["claims"] == 1 and stats["released_done"] == 1
    assert stats["bad_rank_done"] == stats["late_done"] == stats["bad_proof"] == 0
    net.check_no_silent_overlap()


def test_claim_heartbeat_delayed_past_the_done_leaves_the_read_confirmed() -> None:
    """The claim arrives after the done freed the lease: answered "lost", which a
    confirmed read ignores (no recompute)."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    held_back: list[bytes] = []

    def delay_first_claim(src: str, dst: str, payload: bytes) -> bool:
        if src == "D0" and _claims(payload) and not held_back:
            held_back.append(payload)
            net.at(3.0, lambda: net._arrive(src, dst, payload, 0.0))
            return False
        return True

    net.frame_filter = delay_first_claim
    ticket = net.grant("P0", "p-r1")
    net.track("D0", "r1", ticket)
    net.run_until(1.0)
    assert held_back and net.holder("P0").lease_state(ticket.lease) is LeaseState.GRANTED
    assert isinstance(net.start_read("D0", "r1", duration=0.5), ReadGo)
    net.run_until(10.0)
    assert net.freed_leases() == [(1.5, ticket.lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(1.5, "r1")]
    lost = [
        (d.arrived, msg.lost)
        for d in net.delivered
        if d.src == "P0"
        and isinstance(msg := wire.decode(d.payload), wire.HeartbeatAck)
        and msg.lost
    ]
    assert lost == [(3.0, [ticket.lease])]
    assert net.failures() == []
    assert net.reader("D0").state("r1") == {0: ReadState.CONFIRMED}
    net.check_no_silent_overlap()


def test_done_after_an_unclaimed_lease_expired_is_late() -> None:
    """The only done that finds no claimer recorded is one for a lease that ended
    before any claim: it is LATE (S1, S3), not a rank of another TP layout."""
    net, ticket = one_pair()
    net.run_until(14.0)
    # The bound (the ticket's 20 s unclaimed, less the 5 s margin) allows a read at 14 ...
    assert isinstance(net.start_read("D0", "r1", duration=8.0), ReadGo)
    net.run_until(40.0)
    # ... which outlives the lease: freed by expiry at 20, the done at 22 is late.
    assert net.freed_leases() == [(GRANT_TTL, ticket.lease, "EXPIRED")]
    assert done_acks(net) == [(22.0, LATE)]
    assert net.failures("D0") == [(22.0, "r1", "FENCED_LATE")]
    assert net.confirmed == []
    stats = net.holder("P0").stats_snapshot()
    assert stats["late_done"] == 1 and stats["bad_rank_done"] == 0 and stats["claims"] == 0


def _done(holder: Holder, key: bytes, *, now: float, lease: int, proof: bytes, peer: str) -> int:
    """Send one signed done; the verdict of the one DoneAck it draws."""
    holder.handle_frame(now, peer, wire.encode(wire.Done(claim=wire.Claim(lease, proof)), key))
    acks = [wire.decode(o.payload) for o in holder.drain() if isinstance(o, SendFrame)]
    assert len(acks) == 1 and isinstance(acks[0], wire.DoneAck)
    return acks[0].verdict


def test_done_first_with_a_wrong_proof_never_counts_nor_claims() -> None:
    holder = Holder(LeaseConfig(), engine="P", incarnation=1)
    ticket = holder.grant(0.0, request_id="p")
    other = holder.grant(0.0, request_id="q")
    lease = ticket.lease
    key = open_session(holder, ticket, "D0", now=1.0)
    assert key is not None
    wrong = [
        claim_proof(ticket.token, "E", ticket.lease),  # another engine's proof
        claim_proof(other.token, "D", ticket.lease),  # another lease's token
        claim_proof(ticket.token, "D", other.lease),  # the proof of another lease id
        bytes(16),
    ]
    for i, proof in enumerate(wrong):
        assert _done(holder, key, now=2.0 + i, lease=lease, proof=proof, peer="D0") == REFUSED
    assert holder.stats.bad_proof == len(wrong)
    assert holder.stats.claims == 0
    assert holder.lease_state(ticket.lease) is LeaseState.GRANTED
    assert holder.deadline(ticket.lease) == GRANT_TTL  # nothing renewed either
    # No owner was bound by them: the genuine done still claims and frees.
    right = claim_proof(ticket.token, "D", ticket.lease)
    assert _done(holder, key, now=9.0, lease=lease, proof=right, peer="D0") == HELD
    assert holder.lease_state(ticket.lease) is LeaseState.RELEASED
    assert holder.stats.claims == 1 and holder.stats.released_done == 1


def test_done_first_binds_the_layout_and_a_rank_outside_it_never_counts() -> None:
    """Holder rank 0 of TP 2, reader TP 4: ranks 0 and 1 read from it, ranks 2 and 3
    from rank 1. Rank 0's done arrives before any claim and fixes the layout."""
    holder = Holder(LeaseConfig(), engine="P", incarnation=1, rank=0, tp_size=2)
    ticket = holder.grant(0.0, request_id="p")
    lease = ticket.lease
    proof = claim_proof(ticket.token, "D", lease)
    assert open_session(holder, ticket, "D2", now=1.0, rank=2, tp=4) is None  # WRONG_RANK
    keys = {r: open_session(holder, ticket, f"D{r}", now=1.0, rank=r, tp=4) for r in (0, 1)}
    odd = open_session(holder, ticket, "X", now=1.0, rank=0, tp=2, incarnation=3)
    assert None not in keys.values() and odd is not None
    k0, k1 = keys[0], keys[1]
    assert k0 is not None and k1 is not None
    assert _done(holder, k0, now=2.0, lease=lease, proof=proof, peer="D0") == HELD
    assert holder.stats.claims == 1
    assert holder.lease_state(ticket.lease) is LeaseState.HELD  # one of two consumers
    # A session of another TP layout (same engine, valid proof) is not in the set.
    assert _done(holder, odd, now=3.0, lease=lease, proof=proof, peer="X") == REFUSED
    assert holder.stats.bad_rank_done == 1
    # A duplicate of rank 0 does not make a second consumer.
    assert _done(holder, k0, now=4.0, lease=lease, proof=proof, peer="D0") == HELD
    assert holder.lease_state(ticket.lease) is LeaseState.HELD
    assert holder.stats.duplicate_done == 1 and holder.stats.released_done == 0
    assert _done(holder, k1, now=5.0, lease=lease, proof=proof, peer="D1") == HELD
    assert holder.lease_state(ticket.lease) is LeaseState.RELEASED
    assert holder.stats.released_done == 1


def tp2_readers(*, d1_latency: float = 0.0) -> tuple[Net, LeaseTicket]:
    """Holder TP 1, reader TP 2 (ratio 2:1: two consumers); D0's claims are lost."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    net.set_link("D1", "P0", LinkFaults(delay=d1_latency))
    net.frame_filter = drop_claims_from("D0")
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.track("D1", "r", ticket)
    return net, ticket


def test_tp_2_to_1_one_ranks_claim_lost_both_reads_count() -> None:
    net, ticket = tp2_readers()
    net.run_until(3.0)
    holder = net.holder("P0")
    assert holder.lease_state(ticket.lease) is LeaseState.HELD  # D1's claim
    assert net.reader("D0").state("r") == {0: ReadState.TRACKED}
    assert isinstance(net.start_read("D0", "r", duration=0.5), ReadGo)
    net.run_until(4.0)
    assert holder.lease_state(ticket.lease) is LeaseState.HELD  # one of two consumers
    assert net.freed_leases() == []
    assert isinstance(net.start_read("D1", "r", duration=0.5), ReadGo)
    net.run_until(10.0)
    assert net.freed_leases() == [(4.5, ticket.lease, "DONE")]
    assert sorted((t, r) for t, r, _ in net.confirmed) == [(3.5, "D0"), (4.5, "D1")]
    assert net.failures() == []
    assert holder.stats.bad_rank_done == 0 and holder.stats.claims == 1
    net.check_no_silent_overlap()


def test_tp_2_to_1_done_before_any_claim_waits_for_the_second_rank() -> None:
    """D0's done is the lease's first proof (D1's frames take 1 s): it fixes two
    expected consumers, so the lease stays held, on its own deadline, for D1."""
    net, ticket = tp2_readers(d1_latency=1.0)
    net.run_until(0.2)
    holder = net.holder("P0")
    assert holder.lease_state(ticket.lease) is LeaseState.GRANTED
    assert isinstance(net.start_read("D0", "r", duration=0.3), ReadGo)
    net.run_until(1.0)
    assert holder.lease_state(ticket.lease) is LeaseState.HELD
    assert holder.stats.claims == 1 and net.freed_leases() == []
    assert holder.deadline(ticket.lease) == GRANT_TTL  # not shortened (S2)
    assert [(t, r) for t, r, _ in net.confirmed] == [(0.5, "D0")]
    # D1's Hello arrives at 1, its heartbeats (the first with the claim) at 2, 7, 12:
    # its session holds the lease from 2 and renews it past the own deadline at 12.
    net.run_until(13.0)
    assert net.arrivals("D1", "P0", wire.Heartbeat) == [2.0, 7.0, 12.0]
    assert holder.deadline(ticket.lease) == 12.0 + LeaseConfig().lease_extension
    assert isinstance(net.start_read("D1", "r", duration=0.5), ReadGo)
    net.run_until(20.0)
    assert net.freed_leases() == [(13.5, ticket.lease, "DONE")]
    assert sorted(r for _, r, _ in net.confirmed) == ["D0", "D1"]
    assert net.failures() == []
    assert holder.stats.bad_rank_done == 0
    net.check_no_silent_overlap()
