"""One reader session's life cycle: Hello, Welcome, keys, holder incarnations, what lapsed.

A :class:`Session` is the reader's side of its link to one holder rank. It
owns the session's state (:class:`~kvproto.states.SessionState`, moved only
through :func:`~kvproto.states.session_next`), the Hello's anchor and nonce,
the keys a Welcome proves, the holder incarnations known to be gone, the
clock-offset estimate and the heartbeat side (:class:`~kvproto.beats.Beats`).
Its decisions are pure: which ticket anchors the next Hello, whether a
Welcome is genuine, which requests a Welcome or a silent holder ends.
:class:`~kvproto.reader_peers.HolderSessions` acts on the answers (sends
frames, sets timers, has the :class:`~kvproto.reader.Reader`, which keeps the
requests, fail them); this module sees requests only through the
:class:`Tracked` protocol.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvproto import auth, bounds, wire
from kvproto.beats import Beats
from kvproto.clock import SkewEstimator, SkewSample
from kvproto.config import LeaseConfig, LeaseParams
from kvproto.events import FailReason
from kvproto.states import SESSION_TRANSITIONS, SessionInput, SessionState, session_next
from kvproto.ticket import LeaseTicket
from kvproto.transport import PeerId

_BROKEN = SessionState.BROKEN
_HELLO_SENT = SessionState.HELLO_SENT
_IDLE = SessionState.IDLE
_OPEN = SessionState.OPEN
_ON_NEED = SessionInput.NEED  # read on every track: a global, not an Enum descriptor
_STALE_KEEP = 16
NEED_KEEPS_STATE = tuple(
    state
    for (state, event), after in SESSION_TRANSITIONS.items()
    if event is _ON_NEED and after is state
)
"""The states whose NEED row leaves them as they are, read off the table at import:
every track needs its sessions, and in these states :meth:`Session.need` would
change nothing and ask for no connection, so the reader skips the call. A tuple, not
a frozenset: a tuple finds a member by identity, where a set would hash it through
Enum's Python-level ``__hash__`` on every track."""
_T = TypeVar("_T")


class Tracked(Protocol):
    """What the session reads of a request the reader tracks."""

    @property
    def ticket(self) -> LeaseTicket:
        """The request's lease ticket."""

    @property
    def tracked_at(self) -> float:
        """When the reader started tracking it (local clock)."""

    @property
    def failed(self) -> bool:
        """The request failed already."""

    def claim_acked(self, rank: int) -> bool:
        """The holder rank ``rank`` acknowledged the request's claim."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderSide:
    """Who the reader is: the same for all its sessions."""

    engine: str
    """The reader's engine id."""
    rank: int
    """The reader's TP rank."""
    tp_size: int
    """The reader's TP size."""
    incarnation: int
    """The reader process's incarnation."""
    config: LeaseConfig
    """The reader's configuration (secret, drift, intervals)."""


@dataclass(slots=True, eq=False)
class Fanout:
    """The requests of this reader rank that read one lease (one ticket, several requests).

    vLLM's parallel sampling gives every child of a request the parent's ticket, and
    any fan-out may do the same. The lease is claimed, heartbeated and aborted once for
    all of them (the session's lease set names one of them, :attr:`members` ``[0]``),
    and its done goes to each holder rank once, when no member still reads from it: the
    holder counts one done per reader rank, and answers a repeated one as it answered
    the first, so a done sent while a sibling still reads would free blocks that
    sibling's read is taking while vouching for it. Made when a second request joins,
    or at the first one's track when it says more will read: a lease read by one
    request has none.
    """

    members: list[str]
    """The request ids reading the lease, in track order (the first is the one the
    session's lease set and ``by_lease`` name)."""
    done_sent: set[int] = field(default_factory=set)
    """Holder ranks the lease's done went to: a request that begins its read later is
    not covered by that done's verdict, and is declined."""
    expected: int = 1
    """How many requests the tracks said would read the lease: the done waits until
    that many joined (held back at most ``ack_timeout``, like a landed read's done)."""
    joined: int = 1
    """How many requests joined, those that left since included."""


class WelcomeProblem(enum.Enum):
    """Why a Welcome was not taken."""

    UNEXPECTED = "unexpected"
    """Not an answer to our last Hello (state, nonce, holder or anchor do not match)."""
    BAD_MAC = "bad-mac"
    """Not signed with the keys our anchor's token derives."""


@dataclass(slots=True, eq=False)
class Session:
    """The reader's session with one holder rank. See the module docstring."""

    side: ReaderSide
    """The reader this session belongs to."""
    engine: str
    """The holder's engine id."""
    rank: int
    """The holder's TP rank."""
    serial: int
    """Creation order: due sessions are served in it."""
    state: SessionState = SessionState.IDLE
    peer: PeerId = ""
    """The transport's name for the holder once connected ("" before)."""
    nonce: bytes = b""
    """Our last Hello's nonce: its Welcome must echo it."""
    hello_sent: float = -math.inf
    """When our last Hello left (local clock): the Welcome's clock sample starts there."""
    up: bytes = b""
    """Session key, reader → holder (kvproto.auth); empty before a Welcome."""
    down: bytes = b""
    """Session key, holder → reader."""
    prev_down: bytes = b""
    """The key before the last re-key: acks already on their way still count."""
    attempt: int = 0
    """Hellos sent in this incarnation (the holder refuses older ones)."""
    anchor_turn: int = 0
    """Hellos since the last Welcome: unanswered retries try the next anchor."""
    anchor_token: bytes = b""
    """Token of the last Hello's anchor lease: keys its Welcome or refusal."""
    unsigned_rehello: float = -math.inf
    """When an unauthenticated "no session" last made us say Hello (once an interval)."""
    params: LeaseParams | None = None
    """The holder's lease parameters, from its last Welcome (None before one)."""
    incarnation: int | None = None
    """The holder incarnation that welcomed us last (None before a Welcome)."""
    beats: Beats = field(default_factory=Beats)
    """The heartbeat side (kvproto.beats)."""
    skew: SkewEstimator = field(init=False)
    """Clock-offset estimate towards this holder incarnation."""
    stale_incarnations: set[int] = field(default_factory=set)
    """Holder incarnations a Welcome proved gone (their tickets fail at once)."""
    parked: list[str] = field(default_factory=list)
    """Requests whose ticket names an incarnation not yet met: held back until the
    Welcome says whether it is the holder's (lease ids repeat across incarnations)."""
    by_lease: dict[int, str] = field(default_factory=dict)
    """Lease id → the request whose lease it is, for every session of this holder engine:
    one dict they share (:class:`~kvproto.reader_peers.HolderSessions` hands it over),
    so a frame naming a lease finds its request with no (engine, lease) key to build."""
    fanout: dict[int, Fanout] = field(default_factory=dict)
    """Lease id → the requests reading it, for a lease several requests read (shared by
    the engine's sessions like :attr:`by_lease`; empty while every lease has one)."""

    def __post_init__(self) -> None:
        self.skew = SkewEstimator(max_drift_ppm=self.side.config.max_drift_ppm)

    # ------------------------------------------------------------ transitions

    def need(self) -> bool:
        """Requests want this session; True when the binding must (re)connect it."""
        before = self.state
        self.state = session_next(before, _ON_NEED)
        return before in (_IDLE, _BROKEN)

    def connected(self) -> bool:
        """The binding reached the holder; False when the session broke meanwhile."""
        self.state = session_next(self.state, SessionInput.CONNECTED)
        return self.state is not _BROKEN

    def rejected(self, proof_of: Callable[[str], bytes]) -> None:
        """The holder does not know this session (any more): every lease is claimed again."""
        self.state = session_next(self.state, SessionInput.REJECTED)
        self.beats.reclaim_all(proof_of)

    def lost(self) -> list[str]:
        """The session broke: forget keys and heartbeats; the requests it held or parked."""
        self.state = session_next(self.state, SessionInput.LOST)
        self.beats.reset()
        self.up = self.down = self.prev_down = b""
        return list({*self.readers(), *self.parked})

    def readers(self) -> list[str]:
        """Every request whose lease the session heartbeats (all of a lease's readers)."""
        owners = list(self.beats.leases.owners())
        fanout = self.fanout
        if not fanout:
            return owners
        out: list[str] = []
        for lease in self.beats.leases:
            group = fanout.get(lease)
            if group is None:
                owner = self.beats.leases.owner(lease)
                if owner is not None:
                    out.append(owner)
            else:
                out.extend(group.members)
        return out

    # ------------------------------------------------------------ handshake

    def anchor(self, requests: Mapping[str, Tracked]) -> Tracked | None:
        """A request whose ticket keys the next Hello; they take turns on retries.

        Parked tickets on every other turn (they name an incarnation the holder
        may have become); otherwise leases the holder acknowledged for this session
        first (a live session is re-keyed only by a lease it holds), then the rest.
        """
        parked = [requests[rid] for rid in reversed(self.parked) if rid in requests]
        acked: list[Tracked] = []
        other: list[Tracked] = []
        for rid in self.beats.leases.owners(newest_first=True):
            req = requests.get(rid)
            if req is not None:
                (acked if req.claim_acked(self.rank) else other).append(req)
        return _take_turn(parked, acked + other, self.anchor_turn)

    def hello(self, now: float, nonce: bytes, anchor: Tracked | None) -> bytes | None:
        """Start a Hello anchored on ``anchor``'s ticket: its payload, or None without one.

        Without an anchor there is no ticket to prove and nothing to heartbeat; the
        reader's retry timer runs on, so a request tracked later gets its Hello.
        Attempt numbers count only Hellos sent (the holder refuses a jump of more
        than 2**16).
        """
        self.nonce = nonce
        self.hello_sent = now
        if anchor is None:
            self.anchor_token = b""
            return None
        self.attempt += 1
        self.anchor_turn += 1
        ticket = anchor.ticket
        self.anchor_token = ticket.token
        side = self.side
        proof = auth.hello_proof(
            ticket.token,
            reader_engine=side.engine,
            reader_rank=side.rank,
            reader_tp=side.tp_size,
            reader_incarnation=side.incarnation,
            holder_rank=self.rank,
            lease=ticket.lease,
            attempt=self.attempt,
            nonce=nonce,
        )
        hello = wire.Hello(
            engine=side.engine,
            rank=side.rank,
            tp_size=side.tp_size,
            incarnation=side.incarnation,
            nonce=nonce,
            attempt=self.attempt,
            anchor=wire.Claim(lease=ticket.lease, proof=proof),
        )
        return wire.encode(hello, side.config.auth_secret)

    def welcome(self, now: float, msg: wire.Welcome, data: bytes) -> WelcomeProblem | None:
        """Take the holder's Welcome (None), or say why not and change nothing.

        Only the holder of our anchor's token can sign it. A new holder
        incarnation makes the old one stale and restarts the clock estimate:
        its clock need not have anything to do with the old process's.
        """
        if (
            self.state is not _HELLO_SENT
            or msg.nonce != self.nonce
            or msg.engine != self.engine
            or msg.rank != self.rank
            or not self.anchor_token
        ):
            return WelcomeProblem.UNEXPECTED
        side = self.side
        up, down = auth.session_keys(
            self.anchor_token,
            reader_engine=side.engine,
            reader_rank=side.rank,
            reader_incarnation=side.incarnation,
            holder_engine=msg.engine,
            holder_rank=msg.rank,
            holder_incarnation=msg.incarnation,
            nonce=msg.nonce,
            server_nonce=msg.server_nonce,
            secret=side.config.auth_secret,
        )
        if not wire.verify(down, data):
            return WelcomeProblem.BAD_MAC
        self.prev_down = self.down
        self.up, self.down = up, down
        self.anchor_turn = 0
        self.state = session_next(self.state, SessionInput.WELCOME)
        if self.incarnation is not None and self.incarnation != msg.incarnation:
            self.mark_stale(self.incarnation)
            self.skew = SkewEstimator(max_drift_ppm=side.config.max_drift_ppm)
        self.skew.add(SkewSample(sent=self.hello_sent, peer=msg.clock, received=now))
        self.params = msg.params
        self.incarnation = msg.incarnation
        return None

    def welcomed_verdict(self, now: float, ticket: LeaseTicket) -> FailReason | None:
        """Once welcomed, why ``ticket``'s request fails now (None: it lives on here).

        A ticket of another holder incarnation names a process that is gone (and
        that incarnation becomes stale); one whose deadline passed is lost.
        """
        if ticket.holder_incarnation != self.incarnation:
            self.mark_stale(ticket.holder_incarnation)
            return FailReason.HOLDER_RESTARTED
        if bounds.ticket_bound(self.skew, ticket, now) <= now:
            return FailReason.LEASE_LOST
        return None

    def mark_stale(self, incarnation: int) -> None:
        """``incarnation`` of the holder is gone (a bounded record: tickets are peer data)."""
        if len(self.stale_incarnations) >= _STALE_KEEP:
            self.stale_incarnations.pop()
        self.stale_incarnations.add(incarnation)

    def interval(self, requests: Mapping[str, Tracked]) -> float:
        """The heartbeat interval: the holder's advertised one; before a Welcome a held
        ticket's, else the reader's own."""
        params = self.params
        if params is not None:
            return params.interval
        for rid in self.beats.leases.owners():
            return requests[rid].ticket.params.interval
        return self.side.config.heartbeat_interval

    # ------------------------------------------------------------ frames

    def authentic(self, data: bytes) -> bool:
        """Signed with the session's holder → reader key (or the one before a re-key)."""
        return bool(self.down) and (
            wire.verify(self.down, data)
            or (bool(self.prev_down) and wire.verify(self.prev_down, data))
        )

    def refusal_authentic(self, data: bytes) -> bool:
        """A refusal of our Hello signed with our anchor's token (a forged one would
        fail every request of the session)."""
        key = auth.refusal_key(self.anchor_token, self.nonce, self.side.config.auth_secret)
        return bool(self.anchor_token) and wire.verify(key, data)

    def heed_unsigned_no_session(
        self, now: float, seq: int, requests: Mapping[str, Tracked]
    ) -> bool:
        """Whether an unsigned "no session" naming heartbeat ``seq`` makes us say Hello.

        A holder without our session cannot sign its "no session"; anyone could
        send one. Heeded only for a heartbeat we still wait on, and at most once a
        heartbeat interval: a forger can then cost one handshake an interval, and
        the Welcome is followed by a heartbeat at once, so the leases stay renewed.
        """
        beat = self.beats.inflight.get(seq)
        if (
            self.state is not _OPEN
            or beat is None
            or beat.acked_at is not None
            or now < self.unsigned_rehello + self.interval(requests)
        ):
            return False
        self.unsigned_rehello = now
        return True

    # ------------------------------------------------------------ lapses

    def lapsed(self, now: float, requests: Mapping[str, Tracked]) -> list[str]:
        """Unwelcomed: the requests whose lease has lapsed by our own record.

        A holder that restarted knows none of the old tokens, so it cannot sign
        any answer to a Hello anchored on them, and an unsigned "holder
        restarted" would let anyone fail our requests. Without a Welcome a
        request fails once the lease is surely over
        (:func:`kvproto.bounds.surely_lapsed_at`): at most the ticket's lease, or
        one extension past the last acknowledged heartbeat. A newer ticket of
        the new incarnation, if any, keys a Welcome at once and tells sooner.
        """
        config = self.side.config
        drift = config.drift
        lapsed = []
        for rid in {*self.readers(), *self.parked}:
            req = requests.get(rid)
            if req is None or req.failed:
                continue
            lapse = bounds.surely_lapsed_at(
                tracked_at=req.tracked_at,
                ticket=req.ticket,
                extension=(self.params or req.ticket.params).extension,
                beats=self.beats.inflight.values(),
                drift=drift,
                ack_timeout=config.ack_timeout,
            )
            if now >= lapse:
                lapsed.append(rid)
        return lapsed


def _take_turn(parked: Sequence[_T], rest: Sequence[_T], turn: int) -> _T | None:
    """Hello ``turn``'s anchor: parked and the rest alternate when both exist."""
    if parked and (not rest or turn % 2 == 0):
        return parked[turn // 2 % len(parked) if rest else turn % len(parked)]
    return rest[turn // 2 % len(rest) if parked else turn % len(rest)] if rest else None
