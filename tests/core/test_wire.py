"""The binary wire format: round trips, header and MAC checks, range validation, totality."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.config import LeaseParams
from kvproto.errors import RemoteProtocolError

KEY = b"k" * 32
PROOF = bytes(range(16))
NONCE = bytes(16)
PARAMS = LeaseParams(duration=30, interval=5, extension=20)

SAMPLES: list[wire.Message] = [
    wire.Hello(engine="D", rank=1, tp_size=2, incarnation=9, nonce=NONCE),
    wire.Welcome(
        engine="P",
        rank=0,
        tp_size=1,
        incarnation=7,
        nonce=NONCE,
        server_nonce=NONCE,
        params=PARAMS,
        clock=12.5,
    ),
    wire.Heartbeat(seq=1, claims=[], aborts=[], count=0, digest=0),
    wire.Heartbeat(
        seq=2**64 - 1,
        claims=[wire.Claim(lease=1, proof=PROOF), wire.Claim(lease=2**64 - 1, proof=PROOF)],
        aborts=[wire.Claim(lease=3, proof=PROOF)],
        count=2,
        digest=wire.digest([1, 2]),
        full=wire.delta_encode([1, 2]),
    ),
    wire.HeartbeatAck(seq=3, clock=1.5, held=[(1, 19.5)], lost=[4], resync=True),
    wire.Done(claim=wire.Claim(lease=1, proof=PROOF)),
    wire.DoneAck(lease=1, verdict=wire.DoneVerdict.LATE),
    wire.Revoke(leases=[1, 2], reason=4),
    wire.Reject(reason=wire.RejectReason.NO_SESSION, seq=5),
    wire.Arm(claim=wire.Claim(lease=7, proof=PROOF)),
    wire.ArmAck(lease=7, armed=True, left=12.25),
    wire.ArmAck(lease=8, armed=False),
]


def encoded_size(msg: wire.Message, authenticated: bool) -> int:
    """A frame's bytes as spec/wire-format.md lays them out: header, msgpack body, MAC."""
    return (
        wire.HEADER_LEN + len(msgspec.msgpack.encode(msg)) + (wire.MAC_LEN if authenticated else 0)
    )


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_plain_and_signed(msg: wire.Message) -> None:
    plain = wire.encode(msg)
    assert plain[:2] == b"\x8bK" and plain[2] == wire.VERSION and plain[3] == 0
    assert wire.decode(plain) == msg
    assert encoded_size(msg, authenticated=False) == len(plain)
    signed = wire.encode(msg, KEY)
    assert signed[3] == wire.FLAG_MAC and len(signed) == len(plain) + wire.MAC_LEN
    assert wire.decode(signed, KEY) == msg
    assert encoded_size(msg, authenticated=True) == len(signed)


def test_heartbeat_is_small_and_does_not_grow_with_request_ids() -> None:
    # A steady-state keep-alive (no changes) is a dozen bytes whatever the lease count.
    many = wire.Heartbeat(seq=1000, claims=[], aborts=[], count=50_000, digest=2**63 + 5)
    assert len(wire.encode(many)) <= 24
    # A dense resync list costs about one byte per lease.
    full = wire.Heartbeat(
        seq=1, claims=[], aborts=[], count=1000, digest=0, full=wire.delta_encode(range(1, 1001))
    )
    assert len(wire.encode(full)) <= 1000 + 40


@pytest.mark.parametrize(
    "data",
    [b"", b"\x8b", b"\x8bK\x01", b"HB:a", b"a:1", b"\x8bL\x01\x00\x91\x01"],
)
def test_not_a_frame(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        wire.decode(data)


def test_version_and_flags_are_checked() -> None:
    frame = bytearray(wire.encode(SAMPLES[0]))
    frame[2] = wire.VERSION + 1
    with pytest.raises(RemoteProtocolError, match="version"):
        wire.decode(bytes(frame))
    frame[2] = wire.VERSION
    frame[3] = 0x02
    with pytest.raises(RemoteProtocolError, match="flags"):
        wire.decode(bytes(frame))


def test_mac_is_required_checked_and_bound_to_the_key() -> None:
    msg = SAMPLES[5]
    with pytest.raises(RemoteProtocolError, match="unsigned"):
        wire.decode(wire.encode(msg), KEY)
    with pytest.raises(RemoteProtocolError, match="MAC"):
        wire.decode(wire.encode(msg, b"x" * 32), KEY)
    signed = bytearray(wire.encode(msg, KEY))
    signed[-1] ^= 1
    with pytest.raises(RemoteProtocolError, match="MAC"):
        wire.decode(bytes(signed), KEY)
    signed = bytearray(wire.encode(msg, KEY))
    signed[5] ^= 1  # body tampered
    with pytest.raises(RemoteProtocolError):
        wire.decode(bytes(signed), KEY)
    with pytest.raises(RemoteProtocolError, match="short"):
        wire.decode(wire.MAGIC + bytes((wire.VERSION, 1)) + b"\x00" * 10, KEY)


def body(*fields: object) -> bytes:
    return wire.MAGIC + bytes((wire.VERSION, 0)) + msgspec.msgpack.encode(list(fields))


@pytest.mark.parametrize(
    "data",
    [
        body(99),  # unknown tag
        body(1, "D", 2, 2, 9, NONCE),  # rank outside tp
        body(1, "D", 0, 0, 9, NONCE),  # tp 0
        body(1, "D", -1, 2, 9, NONCE),  # negative rank
        body(1, "D", 0, 1, 9, b"short"),  # nonce length
        body(1, "D", 0, 1, -9, NONCE),  # negative incarnation
        body(2, "P", 0, 1, 7, NONCE, NONCE, [30, 5, 5], 1.0),  # interval == extension
        body(2, "P", 0, 1, 7, NONCE, NONCE, [30, 0, 20], 1.0),
        body(2, "P", 0, 1, 7, NONCE, NONCE, [30, 5, 20], math.nan),
        body(2, "P", 0, 1, 7, NONCE, NONCE, [30, 5, math.inf], 1.0),
        body(2, "P", 0, 1, 7, NONCE, b"x", [30, 5, 20], 1.0),
        body(3, -1, [], [], 0, 0),  # negative seq
        body(3, 1, [[1, b"short"]], [], 1, 0),  # proof length
        body(3, 1, [[-5, PROOF]], [], 1, 0),
        body(3, 1, [], [], 0, 0, [-1]),
        body(3, 1, [], [], 0, 0, [2**64 - 1, 2**64 - 1]),  # full ids sum beyond uint64
        body(3, 1, [], [], 0, -(2**63)),  # negative digest (msgpack cannot say > 2**64-1)
        body(4, 1, math.inf, [], []),
        body(4, 1, 0.0, [[1, math.nan]], []),
        body(4, 1, 0.0, [], [-1]),
        body(5, [1, PROOF[:8]]),
        body(5, [-1, PROOF]),
        body(6, 1),  # missing verdict
        body(6, 1, -1),
        body(7, [-1], 1),
        body(8, -1),
        body(3, "1", [], [], 0, 0),  # wrong type
        b"\x8bK\x02\x00" + b"\x93\x03",  # truncated msgpack
        b"\x8bK\x02\x00" + msgspec.msgpack.encode([5, [1, PROOF]]) + b"\x00",  # trailing byte
    ],
)
def test_invalid_bodies_are_remote_protocol_errors(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        wire.decode(data)


def test_invalid_utf8_in_a_string_field_is_a_remote_protocol_error() -> None:
    frame = bytearray(wire.encode(SAMPLES[0]))
    frame[frame.index(b"D")] = 0x80  # the engine id is no longer UTF-8
    with pytest.raises(RemoteProtocolError):
        wire.decode(bytes(frame))


def test_extra_trailing_fields_are_ignored_for_forward_compatibility() -> None:
    # msgspec's array_like structs accept (and drop) trailing elements: a newer
    # peer may append fields. Documented here so a change is deliberate.
    assert wire.decode(body(6, 1, 0, b"", "future")) == wire.DoneAck(lease=1, verdict=0)


def test_delta_codec_and_digest() -> None:
    ids = [7, 3, 1000, 4]
    assert wire.delta_encode(ids) == [3, 1, 3, 993]
    assert wire.delta_decode(wire.delta_encode(ids)) == sorted(ids)
    assert wire.digest(ids) == wire.digest(reversed(ids))
    assert wire.digest([]) == 0
    # Incremental update by add/subtract of id_hash, as both sides keep it.
    d = wire.digest([1, 2])
    assert (d + wire.id_hash(3)) & wire.MAX_U64 == wire.digest([1, 2, 3])
    assert (d - wire.id_hash(2)) & wire.MAX_U64 == wire.digest([1])


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 2**64 - 1), max_size=50))
def test_delta_round_trip_property(ids: set[int]) -> None:
    assert wire.delta_decode(wire.delta_encode(ids)) == sorted(ids)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
@example(b"\x8bK\x01\x00")
@example(b"\x8bK\x01\x01")
@example(b"\x8bK\x01\x00\xdd\xff\xff\xff\xff")  # array32 header claiming 4G items
@example(b"\x8bK\x01\x00" + b"\x91" * 5000 + b"\x01")  # deep nesting
def test_decode_is_total_on_random_bytes(data: bytes) -> None:
    for key in (None, KEY):
        try:
            msg = wire.decode(data, key)
        except RemoteProtocolError:
            continue
        assert isinstance(msg, wire.Message.__args__)  # type: ignore[attr-defined]
        assert wire.decode(wire.encode(msg)) == msg  # what is accepted can be re-framed


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(SAMPLES),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(-3, 3),
)
def test_decode_is_total_on_mutated_frames(
    msg: wire.Message, signed: bool, flips: list[tuple[int, int]], resize: int
) -> None:
    key = KEY if signed else None
    data = bytearray(wire.encode(msg, key))
    for pos, value in flips:
        data[pos % len(data)] = value
    if resize > 0:
        data.extend(b"\x00" * resize)
    elif resize < 0:
        del data[resize:]
    try:
        out = wire.decode(bytes(data), key)
    except RemoteProtocolError:
        return
    assert wire.decode(wire.encode(out)) == out


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_peek_tag_names_the_message_and_its_direction(msg: wire.Message) -> None:
    tag = wire.peek_tag(wire.encode(msg, KEY))
    assert tag == type(msg).__struct_config__.tag
    to_holder = isinstance(msg, (wire.Hello, wire.Heartbeat, wire.Done, wire.Arm))
    assert (tag in wire.TO_HOLDER_TAGS) is to_holder
    assert (tag in wire.TO_READER_TAGS) is not to_holder


@given(st.binary(max_size=8))
def test_peek_tag_is_none_for_text_and_junk(data: bytes) -> None:
    if not (data[:2] == wire.MAGIC and len(data) > 5 and 0x90 <= data[4] <= 0x9F):
        assert wire.peek_tag(data) is None
    assert wire.peek_tag(b"HB:a,b") is None


def test_frame_size_bounds_hold_for_the_largest_items() -> None:
    big = wire.Claim(lease=wire.MAX_U64, proof=PROOF)
    encoder = msgspec.msgpack.Encoder()
    assert len(encoder.encode(big)) <= wire.CLAIM_BYTES
    assert len(encoder.encode((wire.MAX_U64, -1e300))) <= wire.HELD_BYTES
    assert len(encoder.encode(wire.MAX_U64)) <= wire.ID_BYTES


@given(st.integers(0, 500), st.integers(1, 64))
def test_frame_slices_cover_every_item_once_within_room(count: int, room: int) -> None:
    parts = wire.frame_slices(count, room)
    items = list(range(count))
    assert [i for p in parts for i in items[p]] == items
    assert all(len(items[p]) <= room for p in parts)
    assert len(parts) == max(1, -(-count // room))


def test_frame_room_is_at_least_one() -> None:
    assert wire.frame_room(0, wire.CLAIM_BYTES) == 1
    assert wire.frame_room(wire.FRAME_OVERHEAD + 10 * wire.CLAIM_BYTES, wire.CLAIM_BYTES) == 10


def test_verdicts_and_reasons_are_int_enums_with_their_wire_values() -> None:
    assert [int(v) for v in wire.DoneVerdict] == [0, 1, 2]
    assert [int(r) for r in wire.RejectReason] == [1, 2, 3, 4]
    ack = wire.encode(wire.DoneAck(lease=1, verdict=wire.DoneVerdict.LATE))
    assert ack == wire.encode(wire.DoneAck(lease=1, verdict=1))
