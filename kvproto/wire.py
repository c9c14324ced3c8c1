"""The kvproto wire format: versioned, framed, binary (msgpack via msgspec).

Frame layout (spec/wire-format.md has the byte-by-byte version)::

    0      2        3       4                        n-16 (or n)   n
    +------+--------+-------+------------------------+-------------+
    | 8B 4B| version| flags | msgpack body           | MAC (flag 1)|
    +------+--------+-------+------------------------+-------------+

* The magic ``0x8B 0x4B`` starts with a byte that is never the first byte of
  UTF-8 text, so a kvproto frame can never be mistaken for a stock vLLM text
  notification (``HB:...`` or ``id:n``) and vice versa.
* ``version`` is :data:`VERSION`; a frame of another version is refused.
* ``flags`` bit 0 says a 16-byte keyed BLAKE2b MAC over everything before it
  follows the body. Other bits must be zero. Every frame after a Hello is
  signed with its session's key (:mod:`kvproto.auth`), with no configuration;
  a Hello proves a ticket's token instead (its ``anchor``).
* The body is a msgpack array ``[tag, field, ...]``: one of the message
  structs below, tagged by a small integer.

Every decoder here is total: it returns a message or raises
:class:`~kvproto.errors.RemoteProtocolError`, never another exception.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from kvproto.config import LeaseParams
from kvproto.errors import RemoteProtocolError

MAGIC = b"\x8bK"
VERSION = 2
"""2: session MACs by default (Hello anchors, signed Welcome and DoneAck proofs)."""
FLAG_MAC = 0x01
MAC_LEN = 16
HEADER_LEN = 4
MAX_U64 = 2**64 - 1
MAX_HELLO_AHEAD = 2**16
"""Largest forward jump of a session's Hello ``attempt`` a holder accepts."""


class Claim(msgspec.Struct, frozen=True, array_like=True):
    """Proof that the sender holds a lease's capability token."""

    lease: int
    """Lease id (compact, assigned by the holder at grant)."""
    proof: bytes
    """``claim_proof(token, reader_engine, lease)``: 16 bytes."""


class Hello(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """Reader → holder: open a lease session for one reader rank."""

    engine: str
    """Reader engine id (owner identity for the leases it claims)."""
    rank: int
    """Reader TP rank."""
    tp_size: int
    """Reader TP size; the holder derives expected consumers from it."""
    incarnation: int
    """Random id of this reader process's life; a restart is a new incarnation."""
    nonce: bytes
    """16 random bytes; with the Welcome's, keys the session MAC."""
    attempt: int = 0
    """Hello number within this reader incarnation and holder rank; a replayed
    older Hello cannot re-key the session."""
    anchor: Claim | None = None
    """A lease of this holder the reader tracks, with
    :func:`~kvproto.auth.hello_proof` as proof: the token keys the session.
    A Hello without a valid anchor opens nothing."""


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """Holder → reader: the session is open."""

    engine: str
    """Holder engine id."""
    rank: int
    """Holder TP rank."""
    tp_size: int
    """Holder TP size."""
    incarnation: int
    """Random id of this holder process's life (tickets name it)."""
    nonce: bytes
    """Echo of the reader's nonce (binds the answer to the question)."""
    server_nonce: bytes
    """Holder's 16 random bytes for the session key."""
    params: LeaseParams
    """The holder's lease timing; the reader paces itself by it."""
    clock: float
    """Holder's monotonic clock when it answered (clock-skew sample)."""


class Heartbeat(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """Reader → holder, once per tick: keep every lease of this session alive.

    The session keep-alive renews all leases the session holds, so the frame
    does not grow with the number of leases; it carries only changes.
    """

    seq: int
    """Per-session sequence number, strictly increasing (replay window)."""
    claims: list[Claim]
    """Leases this session newly holds; repeated until acknowledged."""
    aborts: list[Claim]
    """Leases no longer wanted by the reader's request (free now); repeated until acknowledged."""
    count: int
    """How many leases the reader believes this session holds after this frame."""
    digest: int
    """:func:`digest` of those lease ids (with ``count``, detects divergence)."""
    full: list[int] | None = None
    """On resync: every held lease id, delta-encoded ascending; replaces the holder's view."""


class HeartbeatAck(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """Holder → reader: what a heartbeat achieved."""

    seq: int
    """The acknowledged heartbeat's sequence number."""
    clock: float
    """Holder's monotonic clock when it applied the heartbeat."""
    held: list[tuple[int, float]]
    """For each lease claimed in that heartbeat: (lease id, seconds the lease had left)."""
    lost: list[int]
    """Leases named in that heartbeat that the holder does not hold for this session."""
    resync: bool = False
    """Count or digest disagreed: send ``full`` in the next heartbeat."""


class Done(msgspec.Struct, frozen=True, array_like=True, tag=5):
    """Reader → holder, attached to the READ: this rank has the blocks."""

    claim: Claim
    """The lease and the proof (a done also claims)."""


class DoneAck(msgspec.Struct, frozen=True, array_like=True, tag=6):
    """Holder → reader: was the lease held when the done arrived?"""

    lease: int
    """Lease id."""
    verdict: int
    """:class:`DoneVerdict` value."""
    proof: bytes = b""
    """HELD only: :func:`~kvproto.auth.verdict_proof` under the lease's token
    (16 bytes); a HELD without it is not believed. Empty for LATE and REFUSED,
    which only make the reader recompute."""


class Revoke(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """Holder → reader: these leases ended early; do not read, recompute."""

    leases: list[int]
    """Lease ids."""
    reason: int
    """:class:`~kvproto.events.ReleaseReason` value."""


class Reject(msgspec.Struct, frozen=True, array_like=True, tag=8):
    """Holder → reader: the frame was refused as a whole."""

    reason: int
    """:class:`RejectReason` value."""
    seq: int = 0
    """The refused heartbeat's sequence number, if it was one."""


class Arm(msgspec.Struct, frozen=True, array_like=True, tag=9):
    """Writer → holder (push mode): about to WRITE this lease's blocks; arm the write fence.

    Only a session that holds the lease (claimed it) is armed; from then on the holder
    lets the blocks go only once that session's done or abort arrives or its peer is
    lost (spec/push-mode.md)."""

    claim: Claim
    """The lease and the proof."""


class ArmAck(msgspec.Struct, frozen=True, array_like=True, tag=10):
    """Holder → writer: whether the Arm armed the session; write only if it did."""

    lease: int
    """Lease id."""
    armed: bool
    """True: the lease was live and held by the session, which is armed now."""
    left: float = 0.0
    """Armed only: seconds the lease had left when the Arm was applied."""


Message = (
    Hello | Welcome | Heartbeat | HeartbeatAck | Done | DoneAck | Revoke | Reject | Arm | ArmAck
)


class DoneVerdict(enum.IntEnum):
    """Values of :attr:`DoneAck.verdict`."""

    HELD = 0
    """The lease was live when the done arrived: the data read is valid."""
    LATE = 1
    """The lease had already ended: the read may have overlapped a free; recompute."""
    REFUSED = 2
    """Unknown lease, bad proof or another owner: recompute."""


class RejectReason(enum.IntEnum):
    """Values of :attr:`Reject.reason`."""

    NO_SESSION = 1
    """No session for this peer: send Hello again."""
    TOO_MANY = 2
    """A holder limit (sessions, leases per session) was hit."""
    BAD_MAC = 3
    """Authentication failed (no longer sent: a frame that fails its MAC is not answered)."""
    WRONG_RANK = 4
    """The reader rank does not read from this holder rank (TP layouts), or they do not divide."""


def _tag(cls: type[msgspec.Struct]) -> int:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, int)
    return tag


TO_HOLDER_TAGS = frozenset(_tag(c) for c in (Hello, Heartbeat, Done, Arm))
"""Tags of the messages a reader sends (a holder's input)."""
TO_READER_TAGS = frozenset(
    _tag(c) for c in (Welcome, HeartbeatAck, DoneAck, Revoke, Reject, ArmAck)
)
"""Tags of the messages a holder sends (a reader's input)."""
_FIXARRAY = range(0x90, 0xA0)
"""msgpack fixarray first bytes: every message body is a short array, its tag first."""

# Upper bounds of one list item's msgpack size, used to split frames to a byte
# budget without re-encoding: a uint64 is at most 9 bytes, a float 9, a 16-byte
# bin 18, and a short array's header 1.
ID_BYTES = 9
"""One lease id (a uint64)."""
CLAIM_BYTES = 1 + ID_BYTES + 2 + MAC_LEN
"""One :class:`Claim`: array header, lease id, 16-byte proof."""
HELD_BYTES = 1 + ID_BYTES + 9
"""One ``HeartbeatAck.held`` item: array header, lease id, float."""
FRAME_OVERHEAD = 64
"""Everything in a frame but its lists: header, tag, scalar fields, MAC."""


def frame_room(budget: int, item_bytes: int) -> int:
    """How many list items of ``item_bytes`` fit in one frame of ``budget`` bytes (at least 1)."""
    return max(1, (budget - FRAME_OVERHEAD) // item_bytes)


def frame_slices(count: int, room: int) -> list[slice]:
    """``count`` list items cut into frames of at most ``room``; one empty frame if none."""
    if count == 0:
        return [slice(0, 0)]
    return [slice(start, start + room) for start in range(0, count, room)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


@functools.lru_cache(maxsize=1024)
def _keyed(key: bytes) -> hashlib.blake2b:
    """A BLAKE2b state with ``key`` absorbed; copying it skips the key setup (~2x faster)."""
    return hashlib.blake2b(key=key, digest_size=MAC_LEN)


def mac(key: bytes, data: bytes) -> bytes:
    """16-byte keyed BLAKE2b MAC (the same bytes as ``blake2b(data, key=key)``)."""
    h = _keyed(key[:64]).copy()
    h.update(data)
    return h.digest()


def signed(data: bytes) -> bool:
    """True if ``data`` is a kvproto frame whose flags say a MAC follows."""
    return len(data) >= HEADER_LEN + MAC_LEN and data[:2] == MAGIC and data[3] == FLAG_MAC


def verify(key: bytes, data: bytes) -> bool:
    """True if ``data`` is a signed frame whose MAC ``key`` produces (one BLAKE2b)."""
    if not signed(data):
        return False
    body_end = len(data) - MAC_LEN
    return hmac.compare_digest(mac(key, data[:body_end]), data[body_end:])


def encode(msg: Message, key: bytes | None = None) -> bytes:
    """Frame one message; with ``key`` the frame carries a MAC."""
    header = MAGIC + bytes((VERSION, FLAG_MAC if key is not None else 0))
    framed = header + _encoder.encode(msg)
    return framed + mac(key, framed) if key is not None else framed


def peek_tag(data: bytes) -> int | None:
    """The message tag of a native frame, read without decoding; None for anything else.

    Routes a frame to the holder or the reader (:data:`TO_HOLDER_TAGS`,
    :data:`TO_READER_TAGS`); it checks neither version nor MAC, so the
    frame's own decoder still judges it.
    """
    if len(data) > HEADER_LEN + 1 and data[:2] == MAGIC and data[HEADER_LEN] in _FIXARRAY:
        return data[HEADER_LEN + 1]
    return None


def is_kvproto_frame(data: bytes) -> bool:
    """True if ``data`` starts with the kvproto magic (else it may be a legacy text frame)."""
    return data[:2] == MAGIC


def decode(data: bytes, key: bytes | None = None) -> Message:
    """Parse one frame. With ``key`` an unsigned or badly signed frame is refused.

    Raises :class:`RemoteProtocolError` for anything that is not a valid frame.
    """
    if len(data) < HEADER_LEN or data[:2] != MAGIC:
        raise RemoteProtocolError("not a kvproto frame")
    if data[2] != VERSION:
        raise RemoteProtocolError(f"unsupported version {data[2]}")
    flags = data[3]
    if flags & ~FLAG_MAC:
        raise RemoteProtocolError(f"unknown flags {flags:#x}")
    body_end = len(data)
    if flags & FLAG_MAC:
        body_end -= MAC_LEN
        if body_end < HEADER_LEN:
            raise RemoteProtocolError("frame too short for its MAC")
        if key is not None and not hmac.compare_digest(mac(key, data[:body_end]), data[body_end:]):
            raise RemoteProtocolError("bad MAC")
    elif key is not None:
        raise RemoteProtocolError("unsigned frame where a MAC is required")
    try:
        msg: Message = _decoder.decode(data[HEADER_LEN:body_end])
    except (msgspec.DecodeError, ValueError) as exc:
        # ValueError: msgspec raises UnicodeDecodeError (not a DecodeError) for a
        # str field holding invalid UTF-8.
        raise RemoteProtocolError(f"malformed body: {exc}") from None
    _validate(msg)
    return msg


def _validate(msg: Message) -> None:
    """Range checks msgspec's types cannot express: the message's own, then its integers'."""
    for value in _CHECKS[type(msg)](msg):
        if not 0 <= value <= MAX_U64:
            raise RemoteProtocolError(f"integer {value} out of range")


def _hello(msg: Hello) -> list[int]:
    ints = [msg.rank, msg.tp_size, msg.incarnation, msg.attempt]
    if msg.anchor is not None:
        _check_proof(msg.anchor)
        ints.append(msg.anchor.lease)
    _check_session(msg)
    return ints


def _welcome(msg: Welcome) -> list[int]:
    _check_session(msg)
    _check_nonce(msg.server_nonce)
    p = msg.params
    _check_finite(msg.clock, p.duration, p.interval, p.extension)
    if p.max_hold is not None:
        _check_finite(p.max_hold)
    if not 0 < p.interval < p.extension:
        raise RemoteProtocolError("advertised lease parameters are nonsense")
    return [msg.rank, msg.tp_size, msg.incarnation]


def _heartbeat(msg: Heartbeat) -> list[int]:
    ints = [msg.seq, msg.count, msg.digest]
    for c in msg.claims:
        _check_proof(c)
        ints.append(c.lease)
    for c in msg.aborts:
        _check_proof(c)
        ints.append(c.lease)
    if msg.full is not None:
        ints.extend(msg.full)
        ints.append(sum(msg.full))  # the largest id it decodes to must be a uint64 too
    return ints


def _heartbeat_ack(msg: HeartbeatAck) -> list[int]:
    ints = [msg.seq, *msg.lost]
    times = [msg.clock]
    for lease, left in msg.held:
        ints.append(lease)
        times.append(left)
    _check_finite(*times)
    return ints


def _done(msg: Done) -> list[int]:
    _check_proof(msg.claim)
    return [msg.claim.lease]


def _done_ack(msg: DoneAck) -> list[int]:
    if len(msg.proof) not in (0, MAC_LEN):
        raise RemoteProtocolError("verdict proof must be empty or 16 bytes")
    return [msg.lease, msg.verdict]


def _arm(msg: Arm) -> list[int]:
    _check_proof(msg.claim)
    return [msg.claim.lease]


def _arm_ack(msg: ArmAck) -> list[int]:
    _check_finite(msg.left)
    return [msg.lease]


def _revoke(msg: Revoke) -> list[int]:
    return [msg.reason, *msg.leases]


def _reject(msg: Reject) -> list[int]:
    return [msg.reason, msg.seq]


_CHECKS: dict[type[Message], Callable[[Any], list[int]]] = {
    Hello: _hello,
    Welcome: _welcome,
    Heartbeat: _heartbeat,
    HeartbeatAck: _heartbeat_ack,
    Done: _done,
    DoneAck: _done_ack,
    Revoke: _revoke,
    Reject: _reject,
    Arm: _arm,
    ArmAck: _arm_ack,
}
"""Message type -> its own checks (raising :class:`RemoteProtocolError`), returning the
integers that must be uint64s; the decoder yields exactly these types."""


def _check_session(msg: Hello | Welcome) -> None:
    if msg.tp_size < 1 or msg.rank >= msg.tp_size:
        raise RemoteProtocolError("rank outside TP size")
    _check_nonce(msg.nonce)


def _check_nonce(nonce: bytes) -> None:
    if len(nonce) != 16:
        raise RemoteProtocolError("nonce must be 16 bytes")


def _check_finite(*values: float) -> None:
    for v in values:
        if not math.isfinite(v):
            raise RemoteProtocolError("non-finite time value")


def _check_proof(claim: Claim) -> None:
    if len(claim.proof) != MAC_LEN:
        raise RemoteProtocolError("claim proof must be 16 bytes")


def delta_encode(ids: Iterable[int]) -> list[int]:
    """Sorted ids as first value then gaps: small numbers, one msgpack byte each when dense."""
    out: list[int] = []
    prev = 0
    for value in sorted(ids):
        out.append(value - prev)
        prev = value
    return out


def delta_decode(deltas: Sequence[int]) -> list[int]:
    """Inverse of :func:`delta_encode`."""
    out: list[int] = []
    total = 0
    for d in deltas:
        total += d
        out.append(total)
    return out


def id_hash(lease: int) -> int:
    """Scatter a lease id over 64 bits (Fibonacci hashing) before summing into a digest."""
    return (lease * 0x9E3779B97F4A7C15) & MAX_U64


def digest(ids: Iterable[int]) -> int:
    """Order-independent, incrementally updatable digest of a lease-id set."""
    return sum(id_hash(i) for i in ids) & MAX_U64
