"""A real Holder and Reader brought to the steady state with N live leases.

Everything goes through the public core API, as a binding would drive it:
the holder grants, the reader tracks each ticket, the reader's ``Connect``
is answered, and heartbeat ticks are delivered until a tick's heartbeat no
longer carries claims. Each tick is delivered as a transport would: all the
reader's frames of the tick reach the holder, then all the holder's answers
reach the reader. What that claim phase cost (ticks, bytes both ways, holder
time) is recorded, because the steady state alone would flatter kvproto.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvproto import auth, wire
from kvproto.config import LeaseConfig
from kvproto.events import Connect, SendFrame
from kvproto.holder import Holder
from kvproto.leaseset import digest_add
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket, claim_proof
from kvproto_tools.bench.timing import no_gc

HOLDER_PEER = "P#1"
READER_PEER = "D#1"
_MAX_CLAIM_TICKS = 64


def vllm_request_ids(n: int, seed: int = 0) -> list[str]:
    """Request ids shaped like vLLM 0.32's internal ones: 48 characters (49 B with the comma)."""
    base = uuid.UUID(int=seed * 2**64 + 1).hex
    return [f"cmpl-{base[:24]}{i:08x}-0-{i * 2654435761 % 2**32:08x}" for i in range(n)]


def bench_config(n: int) -> LeaseConfig:
    """Defaults, except that one reader session may hold all ``n`` leases.

    The default cap (100,000 per session) is a safety bound, not a cost; the
    scaling curve puts every lease in one session because that is the worst
    case for the text heartbeat it is compared against.
    """
    default = LeaseConfig()
    return LeaseConfig(max_leases_per_session=max(n, default.max_leases_per_session))


@dataclass(slots=True)
class ClaimPhase:
    """What it cost to get from 'tracked' to 'steady' for all N leases."""

    ticks: int = 0
    """Heartbeat ticks whose frames still carried claims (or a resync list)."""
    frames: int = 0
    """Reader → holder heartbeat frames in those ticks."""
    heartbeat_bytes: int = 0
    """Their total size."""
    ack_bytes: int = 0
    """Holder → reader acknowledgement bytes in those ticks."""
    holder_ns: int = 0
    """Holder time spent in ``handle_frame`` + ``drain`` for those frames."""
    resyncs: int = 0
    """Resyncs the holder asked for during the phase."""


@dataclass(slots=True)
class HolderFixture:
    """A holder with ``n`` leases, all held by one reader session that is in sync."""

    n: int
    request_ids: list[str]
    """The holder-side request ids (the anchor holds the same ones)."""
    holder: Holder
    reader: Reader | None
    """The real reader (None for :func:`build_holder_direct`)."""
    tickets: list[LeaseTicket]
    now: float
    """Time of the last delivered tick."""
    claim: ClaimPhase = field(default_factory=ClaimPhase)
    source: WireReader | None = None
    """Frame source used instead of a Reader (:func:`build_holder_direct`)."""

    def steady_frames(self, count: int) -> list[bytes]:
        """The next ``count`` heartbeat frames the reader sends, one per tick, acks withheld.

        Without acks the frames are exactly what a reader in sync sends: no
        claims, only sequence number, count and digest.
        """
        if self.source is not None:
            return [self.source.steady() for _ in range(count)]
        assert self.reader is not None
        frames: list[bytes] = []
        at = self.now
        interval = self.holder.config.heartbeat_interval
        for _ in range(count):
            at += interval
            self.reader.handle_timer(at)
            out = [o.payload for o in self.reader.drain() if isinstance(o, SendFrame)]
            if len(out) != 1:
                raise RuntimeError(f"steady tick sent {len(out)} frames, expected 1")
            frames.append(out[0])
        return frames

    def session_key(self) -> bytes:
        """The reader → holder session key the steady frames are signed with."""
        if self.source is not None:
            return self.source.key
        assert self.reader is not None
        return self.reader._sessions[("P", 0)].up  # the bench reads its own fixture

    def idle_time(self) -> float:
        """A time at which nothing is due at the holder."""
        due = self.holder.get_timer()
        if due is None or due <= self.now:
            raise RuntimeError(f"holder has work due at {due} (now {self.now})")
        return self.now


def build_holder(n: int, request_ids: list[str] | None = None) -> HolderFixture:
    """Grant, track, connect and claim ``n`` leases; stop at the first steady tick.

    Each tick is delivered as a transport does (all the reader's frames, then
    all the holder's answers), so the claim phase recorded is the real one.
    """
    config = bench_config(n)
    holder = Holder(config, engine="P", incarnation=1)
    reader = Reader(config, engine="D", incarnation=2)
    ids = request_ids if request_ids is not None else vllm_request_ids(n)
    with no_gc():
        tickets = [holder.grant(0.0, request_id=rid) for rid in ids]
        for i, ticket in enumerate(tickets):
            reader.track(0.0, request_id=f"d-{i}", ticket=ticket)
        fixture = HolderFixture(
            n=n, request_ids=ids, holder=holder, reader=reader, tickets=tickets, now=0.0
        )
        _claim(fixture)
    return fixture


def _claim(fx: HolderFixture) -> None:
    """Deliver ticks until one carries no claims; record the claim phase."""
    assert fx.reader is not None
    now = 0.0
    outputs = list(fx.reader.drain())
    for o in outputs:
        if isinstance(o, Connect):
            fx.reader.connected(now, engine=o.engine, rank=o.rank, peer=HOLDER_PEER)
    _exchange(fx, now, [o.payload for o in fx.reader.drain() if isinstance(o, SendFrame)])
    interval = fx.holder.config.heartbeat_interval
    for _ in range(_MAX_CLAIM_TICKS):
        frames = [o.payload for o in fx.reader.drain() if isinstance(o, SendFrame)]
        if frames and not _carries_changes(frames):
            # Not delivered: the steady frames are produced fresh by steady_frames().
            fx.now = now
            return
        if frames:
            fx.claim.ticks += 1
            _exchange(fx, now, frames)
            continue
        now += interval
        fx.reader.handle_timer(now)
    raise RuntimeError(f"no steady heartbeat after {_MAX_CLAIM_TICKS} ticks")


def _exchange(fx: HolderFixture, now: float, frames: list[bytes]) -> None:
    """One tick on the wire: Hello/heartbeats to the holder, then its answers back."""
    assert fx.reader is not None
    answers: list[bytes] = []
    before = fx.holder.stats.resyncs
    for payload in frames:
        start = time.perf_counter_ns()
        fx.holder.handle_frame(now, READER_PEER, payload)
        out = fx.holder.drain()
        fx.claim.holder_ns += time.perf_counter_ns() - start
        if isinstance(_decode(payload), wire.Heartbeat):
            fx.claim.frames += 1
            fx.claim.heartbeat_bytes += len(payload)
            fx.claim.ack_bytes += sum(len(o.payload) for o in out if isinstance(o, SendFrame))
        answers.extend(o.payload for o in out if isinstance(o, SendFrame))
    fx.claim.resyncs += fx.holder.stats.resyncs - before
    _answer(fx, now, answers)


def _answer(fx: HolderFixture, now: float, answers: list[bytes]) -> None:
    assert fx.reader is not None
    for payload in answers:
        fx.reader.handle_frame(now, HOLDER_PEER, payload)
    answers.clear()


def _decode(payload: bytes) -> wire.Message:
    return wire.decode(payload)


def _carries_changes(frames: list[bytes]) -> bool:
    for payload in frames:
        msg = _decode(payload)
        if not isinstance(msg, wire.Heartbeat):
            return True
        if msg.claims or msg.aborts or msg.full is not None:
            return True
    return False


class WireReader:
    """The frames a reader session in sync sends, built directly (no Reader object).

    Used where a real :class:`Reader` would cost more than the measurement
    (the 10^6 scaling point, the tracemalloc figure). The frames are the ones
    :class:`Reader` produces for one session: Hello; claims split to the
    frame budget, each frame stating the set the holder holds after it; then
    count-and-digest heartbeats. ``tests/bench`` checks them byte for byte
    against a real Reader.
    """

    def __init__(self, config: LeaseConfig, engine: str = "D", incarnation: int = 2) -> None:
        self.config = config
        self.engine = engine
        self.incarnation = incarnation
        self.seq = 0
        self.count = 0
        self.digest = 0
        self.attempt = 0
        self.nonce = b""
        self.anchor: LeaseTicket | None = None
        self.key = b""
        """Session key (reader → holder), from :meth:`welcomed`."""

    def hello(self, anchor: LeaseTicket, nonce: bytes = b"\x01" * 16) -> bytes:
        """The session-opening frame, anchored on ``anchor`` (a Reader takes its newest ticket)."""
        self.attempt += 1
        self.nonce, self.anchor = nonce, anchor
        proof = auth.hello_proof(
            anchor.token,
            reader_engine=self.engine,
            reader_rank=0,
            reader_tp=1,
            reader_incarnation=self.incarnation,
            holder_rank=0,
            lease=anchor.lease,
            attempt=self.attempt,
            nonce=nonce,
        )
        return wire.encode(
            wire.Hello(
                engine=self.engine,
                rank=0,
                tp_size=1,
                incarnation=self.incarnation,
                nonce=nonce,
                attempt=self.attempt,
                anchor=wire.Claim(lease=anchor.lease, proof=proof),
            )
        )

    def welcomed(self, payload: bytes) -> None:
        """Derive the session key from the holder's Welcome to :meth:`hello`."""
        welcome = wire.decode(payload)
        if not isinstance(welcome, wire.Welcome) or self.anchor is None:
            raise RuntimeError(f"expected a Welcome, got {welcome!r}")
        self.key, _ = auth.session_keys(
            self.anchor.token,
            reader_engine=self.engine,
            reader_rank=0,
            reader_incarnation=self.incarnation,
            holder_engine=welcome.engine,
            holder_rank=welcome.rank,
            holder_incarnation=welcome.incarnation,
            nonce=self.nonce,
            server_nonce=welcome.server_nonce,
            secret=self.config.auth_secret,
        )

    def claims(self, tickets: list[LeaseTicket]) -> list[bytes]:
        """One tick's heartbeats claiming every ticket, split to the frame budget."""
        room = wire.frame_room(self.config.frame_budget, wire.CLAIM_BYTES)
        frames = []
        for start in range(0, len(tickets), room):
            part = [
                wire.Claim(lease=t.lease, proof=claim_proof(t.token, self.engine, t.lease))
                for t in tickets[start : start + room]
            ]
            for c in part:
                self.count += 1
                self.digest = digest_add(self.digest, c.lease)
            frames.append(self._heartbeat(part))
        return frames

    def steady(self) -> bytes:
        """One in-sync heartbeat: no claims, the session's count and digest."""
        return self._heartbeat([])

    def _heartbeat(self, claims: list[wire.Claim]) -> bytes:
        self.seq += 1
        return wire.encode(
            wire.Heartbeat(
                seq=self.seq, claims=claims, aborts=[], count=self.count, digest=self.digest
            ),
            self.key,
        )


def build_holder_direct(n: int, request_ids: list[str] | None = None) -> HolderFixture:
    """A holder in the same steady state as :func:`build_holder`, fed by :class:`WireReader`.

    No claim phase is recorded (it is not the Reader's), and ``reader`` is None.
    """
    config = bench_config(n)
    holder = Holder(config, engine="P", incarnation=1)
    ids = request_ids if request_ids is not None else vllm_request_ids(n)
    source = WireReader(config)
    with no_gc():
        tickets = [holder.grant(0.0, request_id=rid) for rid in ids]
        holder.handle_frame(0.0, READER_PEER, source.hello(tickets[-1]))
        (welcome,) = [o.payload for o in holder.drain() if isinstance(o, SendFrame)]
        source.welcomed(welcome)
        for frame in source.claims(tickets):
            holder.handle_frame(0.0, READER_PEER, frame)
            holder.drain()
        holder.drain()
    if holder.stats_snapshot()["leases_held"] != n or holder.stats.resyncs:
        raise RuntimeError(f"direct claims did not settle: {holder.stats_snapshot()}")
    return HolderFixture(
        n=n, request_ids=ids, holder=holder, reader=None, tickets=tickets, now=0.0, source=source
    )
