"""Attacks on the holder: forged, replayed, late, oversized and flooding frames
are refused and counted, the honest reader is unaffected; authentication; owner binding."""

from __future__ import annotations

from typing import Any

import pytest

from kvproto import auth, legacy, wire
from kvproto.config import LeaseConfig
from kvproto.events import FreeBlocks, SendFrame
from kvproto.holder import Holder
from kvproto.states import LeaseState, SessionState
from kvproto.ticket import LeaseTicket, claim_proof
from kvproto_transports.loopback import LinkFaults

from .net import Net

SECRET = b"s" * 32


class Attacker:
    """A second reader engine that speaks raw frames to the holder as peer ``name``.

    A malicious peer engine, not an off-path stranger: it holds a ticket of its own
    (``x-own``, granted by P like any customer's), anchors its Hello on it, and signs
    its frames with the session key that Hello earns. What it then tries against D's
    lease is refused by the per-lease proofs and owner binding: a session key does not
    stand for a ticket.
    """

    def __init__(self, net: Net, name: str = "X0", engine: str = "X", key: bytes | None = None):
        self.net, self.name, self.engine, self.key = net, name, engine, key
        self.seq = 0
        self.attempt = 0
        self.inbox: list[wire.Message] = []

    def send(self, msg: wire.Message, *, key: bytes | None = None) -> None:
        self.raw(wire.encode(msg, key if key is not None else self.key))

    def raw(self, data: bytes) -> None:
        h = self.net.holder("P0")
        h.handle_frame(self.net.local("P0"), self.name, data)
        keep = []
        for out in h.drain():
            if isinstance(out, SendFrame) and out.peer == self.name:
                self.inbox.append(wire.decode(out.payload))
            else:
                keep.append(out)
        for out in keep:  # give the honest traffic back to the network
            self.net._route(self.net.nodes["P0"], out)
        self.net.collect()

    def hello(
        self,
        engine: str | None = None,
        *,
        anchor: LeaseTicket | None = None,
        secret: bytes | None = None,
    ) -> None:
        engine = engine or self.engine
        if anchor is None:
            anchor = self.net.grant("P0", f"x-own-{self.name}-{self.attempt}")
        self.attempt += 1
        nonce = bytes(16)
        proof = auth.hello_proof(
            anchor.token,
            reader_engine=engine,
            reader_rank=0,
            reader_tp=1,
            reader_incarnation=66,
            holder_rank=0,
            lease=anchor.lease,
            attempt=self.attempt,
            nonce=nonce,
        )
        hello = wire.Hello(
            engine=engine,
            rank=0,
            tp_size=1,
            incarnation=66,
            nonce=nonce,
            attempt=self.attempt,
            anchor=wire.Claim(lease=anchor.lease, proof=proof),
        )
        self.send(hello, key=secret)
        welcome = next((m for m in reversed(self.inbox) if isinstance(m, wire.Welcome)), None)
        if welcome is not None and welcome.nonce == nonce:
            self.key, _ = auth.session_keys(
                anchor.token,
                reader_engine=engine,
                reader_rank=0,
                reader_incarnation=66,
                holder_engine=welcome.engine,
                holder_rank=welcome.rank,
                holder_incarnation=welcome.incarnation,
                nonce=nonce,
                server_nonce=welcome.server_nonce,
                secret=secret,
            )

    def heartbeat(self, *, claims=(), aborts=(), full=None) -> None:  # type: ignore[no-untyped-def]
        self.seq += 1
        self.send(
            wire.Heartbeat(
                seq=self.seq, claims=list(claims), aborts=list(aborts), count=0, digest=0, full=full
            )
        )


def honest(config: LeaseConfig | None = None) -> tuple[Net, LeaseTicket]:
    net = Net(config)
    net.add_holder("P0")
    net.add_reader("D0")
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.run_until(6.0)
    return net, ticket


def snapshot(net: Net, ticket: LeaseTicket) -> tuple[Any, ...]:
    h = net.holder("P0")
    state = h.lease_state(ticket.lease)
    return state, (h.deadline(ticket.lease) if state and not state.terminal else None)


def honest_read_succeeds(net: Net, ticket: LeaseTicket, at: float = 12.0) -> None:
    net.run_until(at)
    net.start_read("D0", "r")
    net.run_until(at + 1)
    assert (at, ticket.lease, "DONE") in net.freed_leases()
    assert [rid for _, _, rid in net.confirmed] == ["r"]
    assert net.failures() == []


def forged(lease: int, proof: bytes = b"\x00" * 16) -> wire.Claim:
    return wire.Claim(lease=lease, proof=proof)


@pytest.mark.parametrize(
    "proof_kind", ["zeros", "readers_proof", "own_engine_guess", "wrong_lease_proof"]
)
def test_forged_heartbeat_done_abort_from_a_second_reader(proof_kind: str) -> None:
    net, ticket = honest()
    d_proof = claim_proof(ticket.token, "D", ticket.lease)
    proof = {
        "zeros": b"\x00" * 16,
        "readers_proof": d_proof,  # sniffed from D's frames: bound to engine D
        "own_engine_guess": claim_proof(b"\x00" * 16, "X", ticket.lease),
        "wrong_lease_proof": claim_proof(ticket.token, "X", ticket.lease + 1),
    }[proof_kind]
    x = Attacker(net)
    x.hello()
    before = snapshot(net, ticket)
    x.heartbeat(claims=[forged(ticket.lease, proof)])
    x.heartbeat(aborts=[forged(ticket.lease, proof)])
    x.send(wire.Done(claim=forged(ticket.lease, proof)))
    assert snapshot(net, ticket) == before
    h = net.holder("P0")
    assert h.stats.owner_mismatch == 3  # D claimed it first: X is refused outright
    acks = [m for m in x.inbox if isinstance(m, (wire.HeartbeatAck, wire.DoneAck))]
    assert wire.DoneAck(lease=ticket.lease, verdict=wire.DoneVerdict.REFUSED) in acks
    assert any(isinstance(m, wire.HeartbeatAck) and m.lost == [ticket.lease] for m in acks)
    honest_read_succeeds(net, ticket)


def test_forged_frames_for_an_unclaimed_lease_need_the_token() -> None:
    net = Net()
    net.add_holder("P0")
    ticket = net.grant("P0", "p-r")
    x = Attacker(net)
    x.hello()
    x.heartbeat(claims=[forged(ticket.lease)])  # right lease id, no token
    x.heartbeat(aborts=[forged(ticket.lease)])
    x.send(wire.Done(claim=forged(ticket.lease)))
    h = net.holder("P0")
    assert h.stats.bad_proof == 3
    assert h.lease_state(ticket.lease) is LeaseState.GRANTED
    assert net.freed == []
    x.heartbeat(claims=[forged(ticket.lease + 100)])
    assert h.stats.unknown_lease == 1
    net.run_until(40.0)
    # X renewed nothing: D's lease and X's own anchor lease (never claimed) both lapse
    # at the end of the claim window.
    grant_ttl = LeaseConfig().grant_ttl
    assert net.freed_leases() == [
        (grant_ttl, ticket.lease, "EXPIRED"),
        (grant_ttl, ticket.lease + 1, "EXPIRED"),
    ]


def test_owner_binding_first_prover_owns() -> None:
    """A leaked ticket: X proves it first and owns the lease; D is refused and recomputes."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    ticket = net.grant("P0", "p-r")
    x = Attacker(net)
    x.hello()
    x.heartbeat(claims=[forged(ticket.lease, claim_proof(ticket.token, "X", ticket.lease))])
    assert net.holder("P0").stats.claims == 1
    net.track("D0", "r", ticket)
    net.run_until(1.0)
    assert net.failures("D0") == [(0.0, "r", "LEASE_LOST")]
    assert net.holder("P0").stats.owner_mismatch >= 1


def test_replayed_frames_change_nothing() -> None:
    net, ticket = honest()
    d_frames = [d.payload for d in net.delivered if d.src == "D0" and d.dst == "P0"]
    hb = [p for p in d_frames if isinstance(wire.decode(p), wire.Heartbeat)]
    h = net.holder("P0")
    before = snapshot(net, ticket)
    for payload in hb:
        h.handle_frame(net.local("P0"), "D0", payload)  # replayed on D's own channel
    assert h.stats.replayed == len(hb)
    assert snapshot(net, ticket) == before
    net.collect()
    honest_read_succeeds(net, ticket)
    done = next(
        d.payload
        for d in net.delivered
        if d.src == "D0" and isinstance(wire.decode(d.payload), wire.Done)
    )
    for _ in range(3):  # replay the done after the release: idempotent, nothing freed twice
        h.handle_frame(net.local("P0"), "D0", done)
    net.collect()
    assert [lease for _, lease, _ in net.freed_leases()] == [ticket.lease]
    assert h.stats.duplicate_done == 3


def test_frames_for_a_freed_lease_are_answered_late_and_change_nothing() -> None:
    net, ticket = honest()
    h = net.holder("P0")
    h.revoke(net.local("P0"), ticket.lease)
    net.run_until(7.0)
    x = Attacker(net, name="D0-replay")
    x.hello(engine="D")
    proof = claim_proof(ticket.token, "D", ticket.lease)
    x.heartbeat(claims=[forged(ticket.lease, proof)])
    x.heartbeat(aborts=[forged(ticket.lease, proof)])
    x.send(wire.Done(claim=forged(ticket.lease, proof)))
    assert h.lease_state(ticket.lease) is LeaseState.REVOKED
    assert wire.DoneAck(lease=ticket.lease, verdict=wire.DoneVerdict.LATE) in x.inbox
    assert any(isinstance(m, wire.HeartbeatAck) and m.lost == [ticket.lease] for m in x.inbox)
    assert h.stats.late_done == 1
    assert [f for _, _, f in net.freed_leases()] == ["REVOKED"]


def test_oversized_frames_are_refused_and_counted() -> None:
    net, ticket = honest(LeaseConfig(max_frame_bytes=1024))
    x = Attacker(net)
    x.raw(b"\x8bK\x02\x00" + b"\x00" * 2000)
    x.raw(b"HB:" + b"a" * 2000)
    h = net.holder("P0")
    assert h.stats.oversize == 2
    x.hello()
    x.heartbeat(claims=[forged(i) for i in range(1, 100)])  # ~2.8 kB
    assert h.stats.oversize == 3
    r = net.reader("D0")
    r.handle_frame(net.local("D0"), "P0", b"\x8bK\x02\x00" + b"\x00" * 2000)
    assert r.stats.unexpected_frames == 1
    honest_read_succeeds(net, ticket)


def test_too_many_ids_in_one_frame_are_refused() -> None:
    net, ticket = honest(LeaseConfig(max_ids_per_frame=10))
    x = Attacker(net)
    x.hello()
    x.heartbeat(claims=[forged(i) for i in range(1, 12)])
    assert net.holder("P0").stats.limit_refusals == 1
    assert net.holder("P0").stats.bad_proof == 0  # not even looked at
    honest_read_succeeds(net, ticket)


def test_flood_from_one_peer_is_rate_limited_while_the_honest_reader_keeps_its_leases() -> None:
    config = LeaseConfig(rate_limit_per_s=100.0, rate_limit_burst=200.0)
    net, ticket = honest(config)
    x = Attacker(net)
    x.hello()
    h = net.holder("P0")
    for step in range(200):  # 20 s of 50 frames every 0.1 s: 500 frames/s against 100/s
        net.run_until(6.0 + step * 0.1)
        for _ in range(50):
            x.heartbeat(claims=[forged(ticket.lease)])
    assert h.stats.rate_limited >= 10_000 - 200 - 100 * 20 - 50
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert net.freed == [] and net.failures() == []
    honest_read_succeeds(net, ticket, at=27.0)


def test_many_sessions_and_leases_are_capped() -> None:
    config = LeaseConfig(max_sessions=2, max_leases_per_session=2)
    net = Net(config)
    net.add_holder("P0")
    net.add_reader("D0")
    tickets = [net.grant("P0", f"p{i}") for i in range(3)]
    for i, t in enumerate(tickets):
        net.track("D0", f"r{i}", t)
    net.run_until(1.0)
    assert net.failures("D0") == [(0.0, "r2", "LEASE_LOST")]  # the third claim: refused
    for i in range(3):  # a flood of sessions: idle ones are evicted, busy ones never
        Attacker(net, name=f"X{i}").hello()
    h = net.holder("P0")
    assert h.stats_snapshot()["sessions"] == 2
    assert h.stats.limit_refusals >= 1
    assert h.lease_state(tickets[0].lease) is LeaseState.HELD


def test_refused_hello_fails_the_readers_requests_instead_of_retrying_forever() -> None:
    net = Net(LeaseConfig(max_sessions=1))
    net.add_holder("P0")
    net.add_reader("D0")
    net.add_reader("E0", engine="E")
    net.track("D0", "a", net.grant("P0", "pa"))
    net.run_until(1.0)
    net.track("E0", "b", net.grant("P0", "pb"))
    net.run_until(100.0)
    assert net.failures("E0") == [(1.0, "b", "CONNECT_FAILED")]
    assert net.reader("E0").session_state("P", 0) is SessionState.BROKEN


def test_legacy_frames_are_refused_unless_enabled() -> None:
    net, ticket = honest()
    x = Attacker(net)
    x.raw(legacy.encode_done("p-r", 1))
    x.raw(legacy.encode_heartbeat(["p-r"]))
    h = net.holder("P0")
    assert h.stats.malformed == 2 and h.stats.legacy_frames == 0
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    honest_read_succeeds(net, ticket)


def test_legacy_frames_cannot_touch_a_lease_a_kvproto_reader_owns() -> None:
    net, ticket = honest(LeaseConfig(accept_legacy=True))
    x = Attacker(net)
    x.raw(legacy.encode_done("p-r", 1))  # stock vLLM's "free it now"
    x.raw(b"\xff\xfe:1")
    h = net.holder("P0")
    assert h.stats.owner_mismatch == 1 and h.stats.malformed == 1
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    honest_read_succeeds(net, ticket)


# ----------------------------------------------------------------- authentication


def test_authenticated_flow_works_end_to_end() -> None:
    net, ticket = honest(LeaseConfig(auth_secret=SECRET))
    assert all(p[3] == wire.FLAG_MAC for _, _, _, p in net.sent)
    honest_read_succeeds(net, ticket)


@pytest.mark.parametrize("signing", ["unsigned", "wrong_secret"])
def test_unsigned_or_wrongly_signed_frames_are_refused(signing: str) -> None:
    net, ticket = honest(LeaseConfig(auth_secret=SECRET))
    key = None if signing == "unsigned" else b"w" * 32
    h = net.holder("P0")
    proof = claim_proof(ticket.token, "D", ticket.lease)
    before = snapshot(net, ticket)
    hello = wire.Hello(engine="D", rank=0, tp_size=1, incarnation=99, nonce=bytes(16))
    frames = [
        wire.encode(hello, key),  # would otherwise replace D's session (new incarnation)
        wire.encode(wire.Done(claim=forged(ticket.lease, proof)), key),
        wire.encode(
            wire.Heartbeat(
                seq=1000, claims=[], aborts=[forged(ticket.lease, proof)], count=0, digest=0
            ),
            key,
        ),
    ]
    for peer in ("X0", "D0"):  # from a stranger, and on D's own channel
        for data in frames:
            h.handle_frame(net.local("P0"), peer, data)
    net.collect()
    # The Hellos fail the secret's MAC; the rest, unsigned by any session key, is
    # answered "no session" from the stranger and refused on D's channel.
    assert (h.stats.bad_mac, h.stats.no_session, h.stats.bad_hello) == (4, 2, 0)
    assert snapshot(net, ticket) == before
    assert net.freed == []
    r = net.reader("D0")
    r.handle_frame(net.local("D0"), "P0", wire.encode(wire.Revoke(leases=[1], reason=4), key))
    assert r.stats.bad_mac == 1
    assert net.failures() == []
    honest_read_succeeds(net, ticket)


def test_duplicated_hello_keeps_the_session_key() -> None:
    """The transport duplicates D's Hello; the holder must not re-key behind D's back."""
    net = Net(LeaseConfig(auth_secret=SECRET))
    net.add_holder("P0")
    net.add_reader("D0")
    net.set_link("D0", "P0", LinkFaults(duplicate=1.0))
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.run_until(60.0)
    assert net.holder("P0").stats.malformed == 0
    assert net.freed == [] and net.failures() == []
    honest_read_succeeds(net, ticket, at=61.0)


def test_crossed_hellos_keep_the_session_key() -> None:
    """D's first Hello is delayed past its retry: the holder answers the retry; the stale
    first Hello carries an older attempt number and is refused as a replay, so it cannot
    re-key the session behind D's back (before attempt numbers it did, and D had to be
    told with a Reject to say Hello a third time)."""
    net = Net(LeaseConfig(auth_secret=SECRET))
    net.add_holder("P0")
    net.add_reader("D0")
    held_back: list[bytes] = []

    def delay_first_hello(src: str, dst: str, payload: bytes) -> bool:
        if not held_back and isinstance(wire.decode(payload), wire.Hello):
            held_back.append(payload)
            net.at(5.5, lambda: net._arrive(src, dst, payload, 0.0))
            return False
        return True

    net.frame_filter = delay_first_hello
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.run_until(60.0)  # Hello#2 at 5.0 answered; the stale Hello#1 lands at 5.5
    h = net.holder("P0")
    assert net.arrivals("D0", "P0", wire.Hello)[:2] == [5.0, 5.5]
    assert net.arrivals("P0", "D0", wire.Reject) == []
    assert (h.stats.replayed, h.stats.bad_mac, h.stats.malformed) == (1, 0, 0)
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert net.freed == [] and net.failures() == []
    honest_read_succeeds(net, ticket, at=61.0)


def test_fenced_late_read_and_decline_are_counted() -> None:
    net, ticket = honest()
    net.pause("D0", 60.0)
    net.run_until(60.0)
    net.start_read("D0", "r")
    assert net.reader("D0").stats.declined == 1
    assert net.freed_leases() == [(25.0, ticket.lease, "EXPIRED")]  # the 5 s beat + 20


def test_holder_answers_no_session_to_strangers_and_keeps_going() -> None:
    net, ticket = honest()
    x = Attacker(net)
    x.send(wire.Done(claim=forged(ticket.lease)))
    x.heartbeat()
    assert [type(m) for m in x.inbox] == [wire.Reject, wire.Reject]
    assert net.holder("P0").stats.no_session == 2
    honest_read_succeeds(net, ticket)


def test_holder_does_not_free_on_a_readers_count_of_consumers() -> None:
    """The expected-consumer count comes from the TP layouts agreed at Hello, not frames."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.track("D1", "r", ticket)
    net.run_until(2.0)
    net.start_read("D0", "r")
    net.run_until(3.0)
    h = net.holder("P0")
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert not any(isinstance(f, FreeBlocks) for _, _, f in net.freed)


def test_a_forged_hello_with_a_new_incarnation_from_a_stranger_cannot_end_d_leases() -> None:
    net, ticket = honest()
    x = Attacker(net)  # a different transport peer: it cannot speak for D0
    x.hello(engine="D")
    assert net.holder("P0").lease_state(ticket.lease) is LeaseState.HELD
    honest_read_succeeds(net, ticket)


def test_holder_never_raises_on_any_attack_frame() -> None:
    h = Holder(LeaseConfig(accept_legacy=True), engine="P", incarnation=1)
    ticket = h.grant(0.0, request_id="x")
    attacks = [
        b"",
        b"\x8bK",
        b"\x8bK\x02\x00\xc1",
        b"\x8bK\x02\x01" + b"\x00" * 16,
        legacy.encode_done("x", 65536),
        b"x:" + b"9" * 10_000,
        b"HB:" + b",".join([b"x"] * 10_000),
        wire.encode(wire.DoneAck(lease=ticket.lease, verdict=0)),
        wire.encode(wire.Revoke(leases=[ticket.lease], reason=4)),
    ]
    for i, data in enumerate(attacks):
        h.handle_frame(float(i), "evil", data)
    assert h.lease_state(ticket.lease) in (LeaseState.GRANTED, LeaseState.HELD)


def test_a_burst_of_rejects_after_a_holder_restart_costs_one_hello() -> None:
    """A split batch meets a restarted holder: every frame is rejected; the reader says
    Hello once, not once per Reject (each new Hello would void the Welcome in flight)."""
    net = Net(LeaseConfig(max_notification_size=256))
    net.add_holder("P0")
    net.add_reader("D0")
    net.links.default = LinkFaults(delay=0.1)
    for i in range(3):
        net.track("D0", f"r{i}", net.grant("P0", f"p{i}"))
    net.run_until(6.0)
    for i in range(3, 30):  # a burst: the next heartbeat is split into several frames
        net.track("D0", f"r{i}", net.grant("P0", f"p{i}"))
    net.nodes["P0"].core = Holder(net.config, engine="P", incarnation=8)  # restarts
    net.run_until(20.0)
    assert len(net.arrivals("P0", "D0", wire.Reject)) >= 3
    # The first Hello, one after the burst, then only the retry timer's: the new
    # process knows none of D's tickets, so nothing can key a Welcome until a ticket
    # of its own arrives.
    hellos = net.arrivals("D0", "P0", wire.Hello)
    assert len([t for t in hellos if t < 11.0]) == 2
    assert net.reader("D0").session_state("P", 0) is SessionState.HELLO_SENT
    net.track("D0", "new", net.grant("P0", "p-new"))  # parked: keys a retry within two
    net.run_until(31.0)
    assert net.reader("D0").session_state("P", 0) is SessionState.OPEN
