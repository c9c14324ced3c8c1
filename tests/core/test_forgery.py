"""In the DEFAULT configuration (no ``auth_secret``) no frame without proof
changes a lease, and no forged frame starves the genuine reader.

The attacker here is off-path or on-path but holds no ticket of D's: it sends under
D's own transport name ``D0`` (over NIXL a sender's name is what it claims), forges
heartbeats (no claims, ``count=0, digest=0``, huge ``seq``), dones and aborts with
D's sniffed claim proofs, replays D's frames, and forges the holder's answers to D.
Each attack is also run with ``auth_secret`` set (the operator's extra layer).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import SendFrame
from kvproto.holder import Holder
from kvproto.states import LeaseState, SessionState
from kvproto.ticket import LeaseTicket, claim_proof

from .net import Net
from .rawsession import open_session
from .test_hardening import Attacker, forged, honest, honest_read_succeeds, snapshot

CONFIGS = {"default": LeaseConfig(), "auth_secret": LeaseConfig(auth_secret=b"s" * 32)}
GUESSED_KEY = b"g" * 16


def d_frames(net: Net, kind: type) -> list[bytes]:
    return [
        d.payload
        for d in net.delivered
        if d.src == "D0" and d.dst == "P0" and isinstance(wire.decode(d.payload), kind)
    ]


def _hb(seq: int, **kw: object) -> wire.Heartbeat:
    fields: dict[str, object] = {"claims": [], "aborts": [], "count": 0, "digest": 0}
    fields.update(kw)
    return wire.Heartbeat(seq=seq, **fields)  # type: ignore[arg-type]


def attack_empty_heartbeat(x: Attacker, t: LeaseTicket) -> None:
    x.send(_hb(10**6))  # the frame: no claims, no proof
    x.send(_hb(10**6 + 1), key=GUESSED_KEY)


def attack_seq_jump(x: Attacker, t: LeaseTicket) -> None:
    x.send(_hb(2**62))
    x.send(_hb(2**62), key=GUESSED_KEY)


def attack_forged_done(x: Attacker, t: LeaseTicket) -> None:
    proof = claim_proof(t.token, "D", t.lease)  # sniffed from D's frames
    x.send(wire.Done(claim=forged(t.lease, proof)))
    x.send(wire.Done(claim=forged(t.lease, proof)), key=GUESSED_KEY)


def attack_forged_abort(x: Attacker, t: LeaseTicket) -> None:
    proof = claim_proof(t.token, "D", t.lease)
    x.send(_hb(10**6, aborts=[forged(t.lease, proof)]))
    x.send(_hb(10**6 + 1, aborts=[forged(t.lease, proof)]), key=GUESSED_KEY)


def attack_forged_resync(x: Attacker, t: LeaseTicket) -> None:
    x.send(_hb(10**6, full=[]))  # "I hold nothing": would detach D's leases


def attack_hello_without_anchor(x: Attacker, t: LeaseTicket) -> None:
    # A new incarnation of D would end D's leases (PEER_LOST): needs a ticket now.
    x.send(wire.Hello(engine="D", rank=0, tp_size=1, incarnation=99, nonce=bytes(16)))
    bogus = wire.Claim(lease=t.lease, proof=bytes(16))
    x.send(wire.Hello(engine="D", rank=0, tp_size=1, incarnation=99, nonce=bytes(16), anchor=bogus))


def attack_replay(x: Attacker, t: LeaseTicket) -> None:
    for kind in (wire.Hello, wire.Heartbeat, wire.Done):
        for payload in d_frames(x.net, kind):
            x.raw(payload)


ATTACKS: dict[str, Callable[[Attacker, LeaseTicket], None]] = {
    "empty_heartbeat": attack_empty_heartbeat,
    "seq_2**62": attack_seq_jump,
    "forged_done": attack_forged_done,
    "forged_abort": attack_forged_abort,
    "forged_resync": attack_forged_resync,
    "hello_no_anchor": attack_hello_without_anchor,
    "replay_d_frames": attack_replay,
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_forged_frames_under_ds_name_change_nothing(attack: str, config_name: str) -> None:
    net, ticket = honest(CONFIGS[config_name])
    h = net.holder("P0")
    before = snapshot(net, ticket)
    applied = (h.stats.heartbeats, h.stats.done_frames, h.stats.claims)
    x = Attacker(net, name="D0", engine="D")  # D's own transport name
    ATTACKS[attack](x, ticket)
    assert snapshot(net, ticket) == before  # state and deadline: not renewed, not ended
    assert (h.stats.heartbeats, h.stats.done_frames, h.stats.claims) == applied
    assert net.freed == [] and net.failures() == []
    assert net.reader("D0").session_state("P", 0) is SessionState.OPEN
    # Whatever the attacker did, every later genuine frame of D still counts.
    honest_read_succeeds(net, ticket, at=40.0)
    assert h.stats.implausible_seq == 0


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_a_flood_under_ds_name_does_not_starve_d(config_name: str) -> None:
    """3000 forged frames a second under D's name for 60 s, against a 2000/s limit: D's
    heartbeats draw on its session's own budget and every one of them is applied."""
    config = CONFIGS[config_name]
    net, ticket = honest(config)
    h = net.holder("P0")
    x = Attacker(net, name="D0", engine="D")
    beats = h.stats.heartbeats
    seq = 2**62
    for step in range(600):
        net.run_until(6.0 + step * 0.1)
        for _ in range(300):
            seq += 1
            x.send(_hb(seq), key=GUESSED_KEY)
    allowed = config.rate_limit_burst + config.rate_limit_per_s * 60
    assert h.stats.bad_mac <= allowed < 180_000
    assert h.stats.rate_limited + h.stats.bad_mac == 180_000
    # D heartbeats at 10, 15, ... 65 s: every one applied (the deadline follows them).
    assert h.stats.heartbeats - beats == 12
    assert h.deadline(ticket.lease) == 65.0 + config.lease_extension
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert net.freed == [] and net.failures() == []
    honest_read_succeeds(net, ticket, at=67.0)


def test_forged_answers_to_the_reader_change_nothing() -> None:
    """The holder's side of the channel forged: a HELD for a read that was never
    vouched for, a revoke, "no session" floods. D trusts none of them."""
    net, ticket = honest()
    r = net.reader("D0")
    now = net.local("D0")
    go = net.start_read("D0", "r", duration=1.0)
    assert go is not None
    held = wire.DoneAck(lease=ticket.lease, verdict=wire.DoneVerdict.HELD)
    for key in (None, GUESSED_KEY):
        r.handle_frame(now, "P0", wire.encode(held, key))
        r.handle_frame(now, "P0", wire.encode(wire.Revoke(leases=[ticket.lease], reason=4), key))
        r.handle_frame(now, "P0", wire.encode(wire.Reject(reason=wire.RejectReason.TOO_MANY), key))
    assert r.stats.bad_mac == 6
    assert net.failures() == [] and net.confirmed == []
    # "No session" can only be unsigned (a holder without our session has no key):
    # it is heeded at most once a heartbeat interval, and only for an unanswered seq.
    hellos = len(net.arrivals("D0", "P0", wire.Hello))
    for seq in range(1, 200):
        r.handle_frame(now, "P0", wire.encode(wire.Reject(reason=1, seq=seq)))
    net.collect()
    net.run_until(30.0)
    assert len(net.arrivals("D0", "P0", wire.Hello)) - hellos <= 1
    assert net.failures() == []
    assert [rid for _, _, rid in net.confirmed] == ["r"]  # the genuine HELD, with its proof


def _open(holder: Holder, ticket: LeaseTicket, peer: str, rank: int, tp: int) -> bytes | None:
    holder.drain()
    return open_session(holder, ticket, peer, now=1.0, rank=rank, tp=tp, incarnation=5)


def test_a_done_from_a_rank_outside_the_expected_set_never_counts() -> None:
    """Holder TP 2, reader TP 4: holder rank 0 serves reader ranks 0 and 1 only."""
    holder = Holder(LeaseConfig(), engine="P", incarnation=1, rank=0, tp_size=2)
    ticket = holder.grant(0.0, request_id="p")
    done = wire.Done(claim=wire.Claim(lease=ticket.lease, proof=claim_proof(ticket.token, "D", 1)))
    # Reader rank 2 reads holder rank 1: its Hello to rank 0 is refused outright.
    assert _open(holder, ticket, "D2", 2, 4) is None
    assert holder.stats_snapshot()["sessions"] == 0
    # Rank 0 of TP 4 claims; then "rank 1 of TP 2" (same engine name, another layout:
    # expected one consumer) reports done. It is not in the lease's expected set.
    key0 = _open(holder, ticket, "D0", 0, 4)
    assert key0 is not None
    claim = wire.Claim(lease=ticket.lease, proof=claim_proof(ticket.token, "D", ticket.lease))
    holder.handle_frame(1.0, "D0", wire.encode(_hb(1, claims=[claim], count=1), key0))
    holder.drain()
    key1 = _open(holder, ticket, "D1", 0, 2)
    assert key1 is not None
    holder.handle_frame(2.0, "D1", wire.encode(done, key1))
    acks = [wire.decode(o.payload) for o in holder.drain() if isinstance(o, SendFrame)]
    assert acks == [wire.DoneAck(lease=ticket.lease, verdict=wire.DoneVerdict.REFUSED)]
    assert holder.stats.bad_rank_done == 1
    assert holder.lease_state(ticket.lease) is LeaseState.HELD
    # Rank 0's own done counts (one of two expected): the lease waits for rank 1.
    holder.handle_frame(3.0, "D0", wire.encode(done, key0))
    assert holder.lease_state(ticket.lease) is LeaseState.HELD
    assert holder.stats.released_done == 0


def test_a_reader_with_nothing_to_prove_sends_no_hellos_and_recovers_later() -> None:
    """After a holder restart the old tickets fail by lapse; the idle session then sends
    nothing (attempt numbers count only Hellos sent, so days of idling cannot push them
    past the holder's 2**16 bound), and a new ticket opens it again."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    net.track("D0", "old", net.grant("P0", "p-old"))
    net.run_until(7.0)
    net.nodes["P0"].core = Holder(net.config, engine="P", incarnation=8)
    net.run_until(50.0)
    assert [(rid, why) for _, rid, why in net.failures("D0")] == [("old", "LEASE_LOST")]
    hellos = len(net.arrivals("D0", "P0", wire.Hello))
    net.run_until(86_400.0)
    assert len(net.arrivals("D0", "P0", wire.Hello)) == hellos
    net.track("D0", "new", net.grant("P0", "p-new"))
    net.run_until(86_400.0 + 6.0)
    assert net.reader("D0").session_state("P", 0) is SessionState.OPEN
    assert net.failures("D0")[1:] == []
