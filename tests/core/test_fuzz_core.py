"""Parser fuzz properties through the state machines: random bytes, mutated valid frames
and random well-formed messages into Holder.handle_frame and Reader.handle_frame. They
never raise; input the parsers refuse changes no lease, request or session."""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvproto import legacy, wire
from kvproto.config import LeaseConfig, LeaseParams
from kvproto.errors import RemoteProtocolError
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket, claim_proof

from .net import Net

CONFIG = LeaseConfig(rate_limit_per_s=1e9, rate_limit_burst=1e9)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def opened(config: LeaseConfig = CONFIG) -> tuple[Net, list[LeaseTicket], list[bytes]]:
    """P0 and D0 with two leases held and one read in flight; D's frames so far."""
    net = Net(config)
    net.add_holder("P0")
    net.add_reader("D0")
    tickets = [net.grant("P0", f"p{i}") for i in range(3)]
    for i, t in enumerate(tickets):
        net.track("D0", f"r{i}", t)
    net.run_until(6.0)
    net.start_read("D0", "r0", duration=100.0)  # its done is still to come
    net.run_until(6.0)
    return net, tickets, [d.payload for d in net.delivered]


NET, TICKETS, FRAMES = opened()


def holder_snapshot(h: Holder, tickets: list[LeaseTicket]) -> Any:
    leases = []
    for t in tickets:
        state = h.lease_state(t.lease)
        deadline = h.deadline(t.lease) if state is not None and not state.terminal else None
        leases.append((state, deadline))
    snap = h.stats_snapshot()
    return leases, h.get_timer(), snap["sessions"], snap["leases_granted"], snap["leases_held"]


def reader_snapshot(r: Reader) -> Any:
    return (
        {rid: r.state(rid) for rid in ("r0", "r1", "r2")},
        r.session_state("P", 0),
        r.get_timer(),
        [r.deadline_bound(6.0, rid) for rid in ("r0", "r1", "r2")],
    )


def fresh() -> tuple[Holder, Reader]:
    """Independent copies of the opened pair."""
    return copy.deepcopy(NET.holder("P0")), copy.deepcopy(NET.reader("D0"))


def parses(data: bytes, key: bytes | None = None) -> bool:
    try:
        wire.decode(data, key)
    except RemoteProtocolError:
        return False
    return True


def mutate(frame: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(frame)
    for pos, value in flips:
        data[pos % len(data)] = value
    return bytes(data[: len(data) - cut] if cut < len(data) else data)


@FUZZ
@given(st.binary(max_size=300))
@example(b"")
@example(b"\x8bK\x02\x00\x96\x01\xa1\x80\x00\x01\x00\xc4\x10" + bytes(16))  # bad UTF-8 Hello
@example(b"x:" + b"9" * 5000)
def test_random_bytes_never_raise_or_change_state(data: bytes) -> None:
    h, r = fresh()
    before_h, before_r = holder_snapshot(h, TICKETS), reader_snapshot(r)
    for peer in ("D0", "stranger"):
        h.handle_frame(6.0, peer, data)
    r.handle_frame(6.0, "P0", data)
    if not parses(data):
        assert holder_snapshot(h, TICKETS) == before_h
        assert reader_snapshot(r) == before_r


@FUZZ
@given(
    st.sampled_from(range(len(FRAMES))),
    st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), min_size=1, max_size=3),
    st.integers(0, 3),
)
def test_mutated_frames_never_raise_and_invalid_ones_change_nothing(
    index: int, flips: list[tuple[int, int]], cut: int
) -> None:
    data = mutate(FRAMES[index], flips, cut)
    h, r = fresh()
    before_h, before_r = holder_snapshot(h, TICKETS), reader_snapshot(r)
    h.handle_frame(6.0, "D0", data)
    h.handle_frame(6.0, "stranger", data)
    r.handle_frame(6.0, "P0", data)
    if not parses(data):
        assert holder_snapshot(h, TICKETS) == before_h
        assert reader_snapshot(r) == before_r


u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 8)
lease_ids = st.one_of(st.sampled_from([t.lease for t in TICKETS]), u64)
nonce = st.binary(min_size=16, max_size=16)
proofs = st.one_of(nonce, st.sampled_from([claim_proof(t.token, "D", t.lease) for t in TICKETS]))
claims = st.builds(wire.Claim, lease=lease_ids, proof=proofs)
finite = st.floats(-1e9, 1e9)
params = st.builds(LeaseParams, duration=finite, interval=finite, extension=finite)
messages = st.one_of(
    st.builds(wire.Hello, engine=st.sampled_from(["D", "X", ""]), rank=small, tp_size=small,
              incarnation=u64, nonce=nonce),
    st.builds(wire.Welcome, engine=st.sampled_from(["P", "Q"]), rank=small, tp_size=small,
              incarnation=st.sampled_from([7, 8]), nonce=nonce, server_nonce=nonce,
              params=params, clock=finite),
    st.builds(wire.Heartbeat, seq=u64, claims=st.lists(claims, max_size=4),
              aborts=st.lists(claims, max_size=4), count=u64, digest=u64,
              full=st.none() | st.lists(st.integers(0, 2**40), max_size=5)),
    st.builds(wire.HeartbeatAck, seq=st.integers(0, 20), clock=finite,
              held=st.lists(st.tuples(lease_ids, finite), max_size=3),
              lost=st.lists(lease_ids, max_size=3), resync=st.booleans()),
    st.builds(wire.Done, claim=claims),
    st.builds(wire.DoneAck, lease=lease_ids, verdict=st.integers(0, 5)),
    st.builds(wire.Revoke, leases=st.lists(lease_ids, max_size=3), reason=st.integers(0, 9)),
    st.builds(wire.Reject, reason=st.integers(0, 5), seq=u64),
)  # fmt: skip


@FUZZ
@given(st.lists(messages, min_size=1, max_size=6), st.sampled_from(["D0", "stranger"]))
def test_random_well_formed_messages_never_raise(msgs: list[wire.Message], peer: str) -> None:
    h, r = fresh()
    for i, msg in enumerate(msgs):
        data = wire.encode(msg)
        h.handle_frame(6.0 + i, peer, data)
        r.handle_frame(6.0 + i, "P0", data)
        h.handle_timer(6.0 + i)
        r.handle_timer(6.0 + i)
        h.drain()
        r.drain()
    # Whatever was accepted, the holder's books still balance.
    states = [h.lease_state(t.lease) for t in TICKETS]
    assert h.live_leases() == sum(s is not None and not s.terminal for s in states)
    t = r.get_timer()
    assert t is None or not math.isnan(t)


@FUZZ
@given(st.binary(max_size=120))
def test_legacy_mode_holder_never_raises(data: bytes) -> None:
    h = Holder(LeaseConfig(accept_legacy=True), engine="P", incarnation=1)
    ticket = h.grant(0.0, request_id="req")
    h.handle_frame(1.0, "stock-vllm", data)
    try:
        legacy.parse(data)
    except RemoteProtocolError:
        assert h.lease_state(ticket.lease) is not None
        assert h.deadline(ticket.lease) == 30.0


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=40),
    st.lists(st.floats(), max_size=4),
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=10),
    st.sampled_from(sorted(TICKETS[0].to_params())),
)
def test_ticket_from_params_is_total_and_its_tickets_are_safe(
    junk: dict[str, Any], replace: str
) -> None:
    base = TICKETS[0].to_params()
    for candidate in (junk, {**base, **junk}, {**base, replace: junk.get(replace)}):
        try:
            ticket = LeaseTicket.from_params(candidate)
        except RemoteProtocolError:
            continue
        r = Reader(CONFIG, engine="D", incarnation=1)
        r.track(0.0, request_id="x", ticket=ticket)  # never raises
        r.handle_timer(100.0)
        r.drain()
