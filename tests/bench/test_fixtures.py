"""The benchmark's fixtures are what they claim to be.

The 10^6 scaling point and the memory figure feed the holder frames built by
:class:`WireReader` instead of a real Reader; these tests pin those frames
byte for byte to a real Reader's, so the shortcut cannot drift from the core.
"""

from __future__ import annotations

from kvproto import wire
from kvproto.events import Connect, SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto_tools.bench.fixtures import (
    HOLDER_PEER,
    READER_PEER,
    WireReader,
    bench_config,
    build_holder,
    build_holder_direct,
    vllm_request_ids,
)


def _reader_claim_frames(n: int) -> tuple[list[bytes], WireReader, list[object]]:
    config = bench_config(n)
    holder = Holder(config, engine="P", incarnation=1)
    reader = Reader(config, engine="D", incarnation=2)
    tickets = [holder.grant(0.0, request_id=rid) for rid in vllm_request_ids(n)]
    for i, ticket in enumerate(tickets):
        reader.track(0.0, request_id=f"d-{i}", ticket=ticket)
    (connect,) = [o for o in reader.drain() if isinstance(o, Connect)]
    reader.connected(0.0, engine=connect.engine, rank=connect.rank, peer=HOLDER_PEER)
    (hello,) = [o.payload for o in reader.drain() if isinstance(o, SendFrame)]
    holder.handle_frame(0.0, READER_PEER, hello)
    (welcome,) = [o.payload for o in holder.drain() if isinstance(o, SendFrame)]
    reader.handle_frame(0.0, HOLDER_PEER, welcome)
    frames = [o.payload for o in reader.drain() if isinstance(o, SendFrame)]
    # The same session as the Reader's: its anchor (the newest ticket) and nonce.
    source = WireReader(config)
    msg = wire.decode(hello)
    assert isinstance(msg, wire.Hello) and msg.anchor is not None
    assert msg.anchor.lease == tickets[-1].lease
    assert source.hello(tickets[-1], msg.nonce) == hello
    source.welcomed(welcome)
    return frames, source, list(tickets)


def test_wire_reader_claims_are_the_readers_bytes_across_a_split() -> None:
    n = 3000  # more than one 64 KiB frame of claims
    frames, source, tickets = _reader_claim_frames(n)
    assert len(frames) == 2
    assert source.claims(tickets) == frames  # type: ignore[arg-type]


def test_wire_reader_steady_frame_is_the_readers() -> None:
    fx = build_holder(500)
    (frame,) = fx.steady_frames(1)
    msg = wire.decode(frame)
    assert isinstance(msg, wire.Heartbeat) and not msg.claims and msg.count == 500
    source = WireReader(fx.holder.config)
    assert fx.reader is not None
    source.key = fx.reader._sessions[("P", 0)].up  # the Reader's session key
    source.claims(fx.tickets)
    source.seq = msg.seq - 1
    assert source.steady() == frame


def test_direct_fixture_reaches_the_same_holder_state() -> None:
    ids = vllm_request_ids(2500)
    real = build_holder(2500, ids).holder.stats_snapshot()
    direct = build_holder_direct(2500, ids).holder.stats_snapshot()
    for key in ("grants", "claims", "leases_granted", "leases_held", "sessions", "resyncs"):
        assert real[key] == direct[key], key
    assert direct["leases_held"] == 2500 and direct["sessions"] == 1


def test_real_fixture_is_steady_and_idle() -> None:
    fx = build_holder(1000)
    assert fx.claim.ticks >= 1 and fx.claim.heartbeat_bytes > 1000 * 16  # a proof per lease
    at = fx.idle_time()
    fx.holder.handle_timer(at)
    assert fx.holder.drain() == []
    assert all(len(f) < 64 for f in fx.steady_frames(3))
