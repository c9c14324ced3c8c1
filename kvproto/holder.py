"""The holder: keeps KV blocks alive exactly as long as a reader may still read them.

Sans-I/O, in the manner of aioquic's ``QuicConnection``: every input carries
``now``; :meth:`Holder.get_timer` says when the holder next needs
:meth:`Holder.handle_timer`; :meth:`Holder.drain` returns what the binding
must do (send these frames, free these blocks). The life cycle and the
session keep-alive are explained in :mod:`kvproto.states`.

Cost model (the reason for the data structures):

* A heartbeat is O(1 + changes it carries): it renews its *session*, and a
  lease is live while any session holding it is.
* Expiry uses two lazy min-queues (leases on their own or hard deadline, in
  :class:`~kvproto.holder_timers.DeadlineQueue`; sessions on their keep-alive
  deadline, in a heap). Each lease and session has at most one canonical
  entry, so a call costs O(ended · log n) and an idle call O(log n) at most —
  whatever order leases were renewed in (vLLM #58222 stopped at the first
  live entry of an insertion-ordered dict and stranded expired ones).
* A lease is a slot of :class:`~kvproto.holder_leases.LeaseTable` (columns,
  nothing GC-tracked per lease); sessions are named in it by serial, and each
  session's leases are links through the slots
  (:class:`~kvproto.holder_members.Memberships`), not a set per session.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from kvproto import auth, legacy, wire
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError, RemoteProtocolError
from kvproto.events import FreeBlocks, HolderOutput, ReleaseReason, SendFrame, WriteFenced
from kvproto.holder_claimers import UNCLAIMED
from kvproto.holder_leases import (
    GRANTED,
    HELD,
    NEXT_STATE,
    NO_ROW,
    STATES,
    TERMINAL,
    UNSCHEDULED,
    LeaseTable,
)
from kvproto.holder_members import NOBODY, SEVERAL, SessionLeases
from kvproto.holder_timers import DeadlineQueue
from kvproto.holder_writes import WriteFence
from kvproto.ratelimit import ReplayWindow, TokenBucket
from kvproto.states import (
    LeaseInput,
    LeaseState,
    PeerSessionInput,
    PeerSessionState,
    WriteState,
    done_verdict,
    lease_next,
    peer_session_next,
)
from kvproto.stats import HolderStats, counts_of
from kvproto.ticket import (
    PROOF_BYTES,
    TOKEN_BYTES,
    LeaseMint,
    LeaseTicket,
    claim_message,
    ticket_problem,
)
from kvproto.tpmath import expected_consumers, target_remote_ranks
from kvproto.transport import PeerId
from kvproto.wire import DoneVerdict, RejectReason

_END_STATE_COUNTER = {
    ReleaseReason.DONE: "released_done",
    ReleaseReason.EXPIRED: "expired",
    ReleaseReason.ABORTED: "aborted",
    ReleaseReason.REVOKED: "revoked",
    ReleaseReason.MAX_HOLD: "max_hold",
    ReleaseReason.PEER_LOST: "peer_lost",
}

# Enum members the per-lease paths (claim, done, expiry, abort, loss) use, read once:
# reading a member off its class goes through EnumType's ``__getattr__`` hook (~1k
# instructions), more than the rest of a transition.
_IN_CLAIM = LeaseInput.CLAIM
_IN_DEADLINE = LeaseInput.DEADLINE
_IN_ABORT = LeaseInput.ABORT
_IN_DONE = LeaseInput.DONE
_IN_LAST_DONE = LeaseInput.LAST_DONE
_IN_FOREIGN_DONE = LeaseInput.FOREIGN_DONE
_IN_DUPLICATE_DONE = LeaseInput.DUPLICATE_DONE
_IN_PEER_LOST = LeaseInput.PEER_LOST
_FREED_DONE = ReleaseReason.DONE
_FREED_EXPIRED = ReleaseReason.EXPIRED
_FREED_MAX_HOLD = ReleaseReason.MAX_HOLD
_FREED_ABORTED = ReleaseReason.ABORTED
_FREED_PEER_LOST = ReleaseReason.PEER_LOST
_VERDICT_HELD = DoneVerdict.HELD
_VERDICT_LATE = DoneVerdict.LATE
_VERDICT_REFUSED = DoneVerdict.REFUSED

_CLAIM_ROW = NEXT_STATE[_IN_CLAIM._value_]
"""The CLAIM input's row of :data:`~kvproto.holder_leases.NEXT_STATE`."""

_NEVER_RENEWED = -math.inf
"""A session's deadline before its first heartbeat."""


class _Session:
    __slots__ = (
        "attempt",
        "bucket",
        "claim_message",
        "deadline",
        "down",
        "engine",
        "expected",
        "heap_due",
        "hello_nonce",
        "incarnation",
        "leases",
        "peer",
        "prev_up",
        "rank",
        "serial",
        "server_nonce",
        "tp_size",
        "up",
        "verdict_prover",
        "window",
    )

    def __init__(
        self,
        serial: int,
        peer: PeerId,
        hello: wire.Hello,
        bucket: TokenBucket,
        leases: SessionLeases,
    ) -> None:
        self.serial = serial
        self.peer = peer
        self.engine = hello.engine
        self.rank = hello.rank
        self.tp_size = hello.tp_size
        self.expected = 0
        self.incarnation = hello.incarnation
        self.attempt = hello.attempt
        # Directional session keys (kvproto.auth); the previous reader key stays
        # valid so a done riding a READ that crossed a re-key is not lost.
        self.up = b""
        self.down = b""
        self.prev_up = b""
        self.bucket = bucket
        self.hello_nonce = hello.nonce
        self.server_nonce = b""
        self.deadline = _NEVER_RENEWED
        self.heap_due: float | None = None
        self.window = ReplayWindow()
        self.leases = leases
        # The session's claim proofs' message and its verdict proofs, each packed per
        # lease: the engine and rank never change for a session (a Hello naming others
        # is refused).
        self.claim_message = claim_message(hello.engine)
        self.verdict_prover = auth.verdict_prover(hello.engine, hello.rank)


class Holder:
    """Lease state for one holder rank. See the module docstring."""

    def __init__(
        self,
        config: LeaseConfig,
        *,
        engine: str,
        incarnation: int,
        rank: int = 0,
        tp_size: int = 1,
        entropy: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        if not 0 <= rank < tp_size:
            raise LocalProtocolError(f"rank {rank} outside TP size {tp_size}")
        self.config = config
        # Read on every heartbeat; the config is frozen, and these are computed from it.
        self._extension = config.lease_extension
        self._ack_room = wire.frame_room(config.frame_budget, wire.HELD_BYTES)
        """``HeartbeatAck.held`` and ``lost`` items one ack frame has room for."""
        self.engine = engine
        self.incarnation = incarnation
        self.rank = rank
        self.tp_size = tp_size
        self.stats = HolderStats()
        self._entropy = entropy
        self._mint = LeaseMint(
            engine=engine,
            incarnation=incarnation,
            tp_size=tp_size,
            params=config.params,
            entropy=entropy,
        )
        self._leases = LeaseTable()
        self._lease_deadlines = DeadlineQueue()
        self._session_heap: list[tuple[float, int]] = []
        self._sessions: dict[PeerId, _Session] = {}
        self._by_serial: dict[int, _Session] = {}
        self._serial = 0
        self._tombstones: deque[tuple[float, int]] = deque()
        self._buckets: OrderedDict[PeerId, TokenBucket] = OrderedDict()
        self._granted = 0  # live leases by state, kept as plain ints (Enum hashing is slow)
        self._held = 0
        self._out: list[HolderOutput] = []
        self._fence = WriteFence()
        """Writable leases (push mode) and their armed writers (spec/push-mode.md)."""

    # ------------------------------------------------------------------ API

    def grant(
        self,
        now: float,
        *,
        request_id: str,
        ttl: float | None = None,
        writable: bool = False,
    ) -> LeaseTicket:
        """Grant a lease on the blocks of ``request_id``; the ticket goes to the reader.

        ``ttl`` defaults to ``kv_lease_duration``; pass ``decoder_kv_blocks_ttl``
        for bidirectional turn-2 blocks. ``writable``: the reader *writes* the blocks
        (push mode): its claims arm the write fence, and the blocks are let go only
        once no write can land (``WriteFenced``, spec/push-mode.md).
        """
        lifetime = self.config.kv_lease_duration if ttl is None else ttl
        if not 0 < lifetime <= self.config.max_hold:  # also refuses NaN (it would poison the queue)
            raise LocalProtocolError(f"lease ttl {lifetime} outside (0, max_hold]")
        ticket = self._mint.mint(now, request_id=request_id, ttl=lifetime)
        problem = self._request_problem(ticket)
        if problem is not None:
            raise LocalProtocolError(problem)
        self._hold(now, ticket, writable)
        return ticket

    def adopt(self, now: float, ticket: LeaseTicket, *, writable: bool = False) -> None:
        """Hold a lease minted elsewhere for this engine (vLLM: by the scheduler).

        The deadline is taken relative to ``now`` on this clock, so holders in
        processes with unrelated clocks never free early (vLLM #50326).
        ``writable`` as in :meth:`grant`.
        """
        problem = self.adoption_problem(ticket)
        if problem is not None:
            raise LocalProtocolError(problem)
        self._hold(now, ticket, writable)

    def adoption_problem(self, ticket: LeaseTicket) -> str | None:
        """Why :meth:`adopt` would refuse ``ticket``, or None if it would hold it.

        A binding that adopts tickets from another process checks here first
        instead of catching the refusal.
        """
        if ticket.holder_engine != self.engine or ticket.holder_incarnation != self.incarnation:
            return "ticket was minted for another holder engine or incarnation"
        problem = ticket_problem(ticket)
        if problem is not None:
            return f"bad ticket: {problem}"
        if ticket.lease in self._leases:
            return f"lease {ticket.lease} already held"
        return self._request_problem(ticket)

    def _request_problem(self, ticket: LeaseTicket) -> str | None:
        if ticket.request_id and self._leases.has_request(ticket.request_id):
            return f"request {ticket.request_id!r} already has a lease"
        return None

    def _hold(self, now: float, ticket: LeaseTicket, writable: bool) -> None:
        # grant and adopt have refused what they must (adopt: adoption_problem).
        slot = self._leases.add(ticket, now, self.config.max_hold)
        self._granted += 1
        self.stats.grants += 1
        if writable:
            self._fence.writable.add(ticket.lease)
        self._schedule_lease(slot)

    def revoke(self, now: float, lease_id: int) -> None:
        """Free a live lease now (memory pressure) and tell its readers to recompute."""
        slot = self._leases.slot(lease_id)
        if slot is None:
            raise LocalProtocolError(f"unknown lease {lease_id}")
        lease_next(self._leases.state(slot), LeaseInput.REVOKE)  # raises if already ended
        self._send_revoke(slot, ReleaseReason.REVOKED)
        self._end(now, slot, LeaseInput.REVOKE, ReleaseReason.REVOKED)

    def peer_lost(self, now: float, peer: PeerId) -> None:
        """The transport says ``peer`` is gone: end the leases only its session held.

        Also the proof that the peer can write no more (push mode): its sessions are
        disarmed, the current one and any the holder forgot under that name.
        """
        session = self._sessions.pop(peer, None)
        state = PeerSessionState.ABSENT if session is None else PeerSessionState.OPEN
        peer_session_next(state, PeerSessionInput.LOST)
        if session is not None:
            self._disarm_session(now, session.serial)
            self._forget_session(now, session, lost=True)
        if self._fence.writable:
            for lease, reason in self._fence.peer_lost(peer):
                self._settle(now, lease, reason)
        self._buckets.pop(peer, None)

    def handle_frame(self, now: float, peer: PeerId, data: bytes) -> None:
        """Apply one notification. Bad input is dropped and counted, never raised.

        Only a frame signed with its session's key (one MAC check) or a Hello
        whose anchor proves a ticket changes state. Authenticated frames draw on
        their session's rate limit, everything else on the peer name's, so a
        flood sent under a reader's name cannot starve the reader itself.
        """
        if len(data) > self.config.max_frame_bytes:
            self.stats.oversize += 1
            return
        session = self._sessions.get(peer)
        if session is not None and self._authentic(session, data):
            if not session.bucket.take(now):
                self.stats.rate_limited += 1
                return
            msg = self._decode_counted(data)
            if msg is None:
                return
            if isinstance(msg, wire.Heartbeat):
                self._on_heartbeat(now, session, msg)
            elif isinstance(msg, wire.Done):
                self._on_done(now, session, msg.claim)
            elif isinstance(msg, wire.Arm):
                self._on_arm(now, session, msg.claim)
            else:
                self.stats.unexpected_frames += 1
            return
        if not self._bucket(peer, now).take(now):
            self.stats.rate_limited += 1
            return
        if not wire.is_kvproto_frame(data):
            self._handle_legacy(now, peer, data)
            return
        msg = self._decode_counted(data)
        if msg is None:
            return
        if isinstance(msg, wire.Hello):
            secret = self.config.auth_secret
            if secret is not None and not wire.verify(secret, data):
                self.stats.bad_mac += 1
                return
            self._on_hello(now, peer, msg)
        elif not isinstance(msg, (wire.Heartbeat, wire.Done, wire.Arm)):
            self.stats.unexpected_frames += 1
        elif session is None:
            self.stats.no_session += 1
            seq = msg.seq if isinstance(msg, wire.Heartbeat) else 0
            self._send_plain(peer, wire.Reject(reason=RejectReason.NO_SESSION, seq=seq))
        else:
            # Not signed with this session's key: a forgery, or a reader that holds
            # another key (two of its Hellos crossed). It changes nothing; the
            # unauthenticated answer only asks for a Hello, which the reader heeds
            # at most once an interval and only for a heartbeat it is waiting on.
            self.stats.bad_mac += 1
            if isinstance(msg, wire.Heartbeat) and wire.signed(data):
                self._send_plain(peer, wire.Reject(reason=RejectReason.NO_SESSION, seq=msg.seq))

    def _decode_counted(self, data: bytes) -> wire.Message | None:
        """The frame's message, or None with the frame counted as malformed."""
        try:
            return wire.decode(data)
        except RemoteProtocolError:
            self.stats.malformed += 1
            return None

    def get_timer(self) -> float | None:
        """The next time :meth:`handle_timer` has work, or None."""
        # The binding asks after every step: compare in place, build nothing.
        soonest = self._lease_deadlines.soonest
        found = soonest != math.inf
        if self._session_heap:
            due = self._session_heap[0][0]
            if not found or due < soonest:
                soonest, found = due, True
        if self._tombstones:
            due = self._tombstones[0][0]
            if not found or due < soonest:
                soonest, found = due, True
        return soonest if found else None

    def handle_timer(self, now: float) -> None:
        """End every lease whose deadline passed by ``now``. O(1) when nothing is due."""
        while self._session_heap and self._session_heap[0][0] <= now:
            due, serial = heapq.heappop(self._session_heap)
            session = self._by_serial.get(serial)
            if session is None or session.heap_due != due:
                continue
            session.heap_due = None
            if session.deadline > now:
                if session.leases.count:
                    self._schedule_session(session)
            else:
                for held in self._leases.members.slots(session.leases):
                    self._detach(held, session)
        table = self._leases
        # Ending or re-scheduling a lease here never schedules anything due by now.
        ended = self._lease_deadlines.take_due(now) if self._lease_deadlines.soonest <= now else ()
        for due, lease_id in ended:
            slot = table.slot(lease_id)
            if slot is None or table.due[slot] != due or TERMINAL[table.states[slot]]:
                continue
            table.due[slot] = UNSCHEDULED
            if now >= table.hard[slot]:
                self._send_revoke(slot, _FREED_MAX_HOLD)
                self._end(now, slot, _IN_DEADLINE, _FREED_MAX_HOLD)
            elif self._live_until(slot) <= now:
                self._end(now, slot, _IN_DEADLINE, _FREED_EXPIRED)
            else:
                self._schedule_lease(slot)
        while self._tombstones and self._tombstones[0][0] <= now:
            self._leases.forget(self._tombstones.popleft()[1])

    def drain(self) -> list[HolderOutput]:
        """Everything the binding must do now, in order."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ queries

    def lease_state(self, lease_id: int) -> LeaseState | None:
        """State of a lease, or None if it is unknown or forgotten."""
        slot = self._leases.slot(lease_id)
        return None if slot is None else self._leases.state(slot)

    def deadline(self, lease_id: int) -> float:
        """The time a live lease lapses unless renewed (max of own and session deadlines)."""
        until = self.live_deadline(lease_id)
        if until is None:
            raise LocalProtocolError(f"lease {lease_id} is not live")
        return until

    def live_deadline(self, lease_id: int) -> float | None:
        """:meth:`deadline` of a live lease; None if it ended, was forgotten or never existed.

        For callers that cannot know whether a lease is still live (it may end
        on any input): they ask here instead of catching :meth:`deadline`'s error.
        """
        slot = self._leases.slot(lease_id)
        if slot is None or self._leases.terminal(slot):
            return None
        return min(self._live_until(slot), self._leases.hard[slot])

    def write_state(self, lease_id: int) -> WriteState:
        """The write fence's state of a writable lease (SETTLED once its blocks may be
        reused, and for every lease that was never writable)."""
        return self._fence.state(lease_id)

    def is_live(self, lease_id: int) -> bool:
        """True while the lease's blocks are held (granted or held, not ended)."""
        slot = self._leases.slot(lease_id)
        return slot is not None and not self._leases.terminal(slot)

    def live_leases(self) -> int:
        """Leases whose blocks are still held."""
        return self._granted + self._held

    def reader_of(self, peer: PeerId) -> tuple[str, int] | None:
        """(engine, rank) of the reader whose session ``peer`` carries, or None."""
        session = self._sessions.get(peer)
        return None if session is None else (session.engine, session.rank)

    def stats_snapshot(self, prefix: str = "") -> dict[str, int]:
        """Counters plus gauges (leases by state, sessions), each key ``prefix + name``."""
        snap = counts_of(self.stats, prefix)
        snap[prefix + "leases_granted"] = self._granted
        snap[prefix + "leases_held"] = self._held
        snap[prefix + "sessions"] = len(self._sessions)
        snap[prefix + "tombstones"] = len(self._tombstones)
        snap[prefix + "leases_quarantined"] = self._fence.quarantined()
        return snap

    # ------------------------------------------------------------ frames

    @staticmethod
    def _authentic(session: _Session, data: bytes) -> bool:
        """Signed with the session's reader key (or the one before the last re-key)."""
        if wire.verify(session.up, data):
            return True
        return bool(session.prev_up) and wire.verify(session.prev_up, data)

    def _anchor(self, hello: wire.Hello, old: _Session | None) -> bytes | None:
        """The Hello's anchor lease's token if its proof is right and it may key this session.

        A new session (or a new reader incarnation) may be keyed by any live
        lease whose token the Hello proves (owner binding is for claims: a key
        is as secret as the token it comes from). Re-keying a live session needs a lease
        that session holds (if it holds any): a ticket of one's own, claimed under
        another engine's name, cannot take over that engine's session.
        """
        anchor = hello.anchor
        slot = None if anchor is None else self._leases.slot(anchor.lease)
        if anchor is None or slot is None or self._leases.terminal(slot):
            return None
        if (
            old is not None
            and old.incarnation == hello.incarnation
            and old.leases.count
            and not self._leases.members.holds(slot, old.serial)
        ):
            return None
        token = self._leases.token(slot)
        proof = auth.hello_proof(
            token,
            reader_engine=hello.engine,
            reader_rank=hello.rank,
            reader_tp=hello.tp_size,
            reader_incarnation=hello.incarnation,
            holder_rank=self.rank,
            lease=anchor.lease,
            attempt=hello.attempt,
            nonce=hello.nonce,
        )
        return token if hmac.compare_digest(proof, anchor.proof) else None

    def _reads_from_us(self, hello: wire.Hello) -> bool:
        """The Hello's reader rank reads from this holder rank (its TP layout divides ours)."""
        big, small = max(hello.tp_size, self.tp_size), min(hello.tp_size, self.tp_size)
        if big % small:
            return False  # layouts that do not divide never pair (wire.decode checked both >= 1)
        return self.rank in target_remote_ranks(hello.rank, hello.tp_size, self.tp_size)

    @staticmethod
    def _hello_input(old: _Session | None, hello: wire.Hello) -> PeerSessionInput:
        """What ``hello`` is to the peer's session ``old`` (the session table's input)."""
        if old is None:
            return PeerSessionInput.FIRST
        if old.incarnation != hello.incarnation:
            return PeerSessionInput.RESTARTED
        if (old.engine, old.rank, old.tp_size) != (hello.engine, hello.rank, hello.tp_size):
            return PeerSessionInput.IMPOSTOR
        if old.hello_nonce == hello.nonce:
            return PeerSessionInput.DUPLICATE
        if 0 < hello.attempt - old.attempt <= wire.MAX_HELLO_AHEAD:
            return PeerSessionInput.REKEY
        return PeerSessionInput.REPLAYED

    def _on_hello(self, now: float, peer: PeerId, hello: wire.Hello) -> None:
        old = self._sessions.get(peer)
        event = self._hello_input(old, hello)
        state = PeerSessionState.ABSENT if old is None else PeerSessionState.OPEN
        after = peer_session_next(state, event)  # every input the classification makes has a row
        if event is PeerSessionInput.IMPOSTOR:
            self.stats.bad_hello += 1  # another reader under this incarnation's name
            return
        same = event in (
            PeerSessionInput.DUPLICATE,
            PeerSessionInput.REKEY,
            PeerSessionInput.REPLAYED,
        )
        anchor_token = self._anchor(hello, old if same else None)
        if anchor_token is None:
            # No proof of any ticket: nothing is opened, re-keyed or ended, and
            # nothing is answered (an answer could not be authenticated).
            self.stats.bad_hello += 1
            return
        if event is PeerSessionInput.REPLAYED:
            self.stats.replayed += 1  # an older Hello of this reader, replayed
            return
        refusal = auth.refusal_key(anchor_token, hello.nonce, self.config.auth_secret)
        if not self._reads_from_us(hello):
            # This rank never reads from us: its dones could count for ranks that do.
            self.stats.limit_refusals += 1
            self._send_keyed(peer, refusal, wire.Reject(reason=RejectReason.WRONG_RANK))
            return
        if old is not None and event is PeerSessionInput.RESTARTED:
            # The same transport name with a new incarnation: the old reader died. Not
            # proof that it can write no more (any engine can say this Hello): its armed
            # leases wait for the transport's word on the peer (spec/push-mode.md §5).
            del self._sessions[peer]
            self._fence.orphan(peer, old.serial)
            self._forget_session(now, old, lost=True)
            old = None
            event = PeerSessionInput.FIRST
            peer_session_next(after, event)
        expected = expected_consumers(self.tp_size, hello.tp_size)
        if old is None and (
            len(self._sessions) >= self.config.max_sessions and not self._evict_idle_session()
        ):
            self.stats.limit_refusals += 1
            self._send_keyed(peer, refusal, wire.Reject(reason=RejectReason.TOO_MANY))
            return
        if event is PeerSessionInput.DUPLICATE and old is not None and old.server_nonce:
            # The same Hello again (the transport duplicated it): answer it the same
            # way. A fresh server nonce would re-key the session behind the reader's
            # back, and every later frame of the reader would fail its MAC.
            server_nonce = old.server_nonce
        else:
            server_nonce = self._entropy(16)
        up, down = auth.session_keys(
            anchor_token,
            reader_engine=hello.engine,
            reader_rank=hello.rank,
            reader_incarnation=hello.incarnation,
            holder_engine=self.engine,
            holder_rank=self.rank,
            holder_incarnation=self.incarnation,
            nonce=hello.nonce,
            server_nonce=server_nonce,
            secret=self.config.auth_secret,
        )
        if old is None:
            self._serial += 1
            bucket = TokenBucket(self.config.rate_limit_per_s, self.config.rate_limit_burst, now)
            leases = self._leases.members.open(self._serial)
            session = _Session(self._serial, peer, hello, bucket, leases)
            session.expected = expected
            self._sessions[peer] = session
            self._by_serial[session.serial] = session
        else:
            session = old
            if session.up != up:
                session.prev_up = session.up
            session.hello_nonce = hello.nonce
            session.attempt = hello.attempt
        session.up, session.down = up, down
        session.server_nonce = server_nonce
        welcome = wire.Welcome(
            engine=self.engine,
            rank=self.rank,
            tp_size=self.tp_size,
            incarnation=self.incarnation,
            nonce=hello.nonce,
            server_nonce=server_nonce,
            params=self.config.params,
            clock=now,
        )
        self._send_keyed(peer, down, welcome)

    def _on_heartbeat(self, now: float, session: _Session, hb: wire.Heartbeat) -> None:
        n_ids = len(hb.claims) + len(hb.aborts) + (len(hb.full) if hb.full is not None else 0)
        if n_ids > self.config.max_ids_per_frame:
            self.stats.limit_refusals += 1
            return
        if not session.window.plausible(hb.seq):
            self.stats.implausible_seq += 1
            return
        if not session.window.accept(hb.seq):
            self.stats.replayed += 1
            return
        self.stats.heartbeats += 1
        renewed = now + self._extension
        deadline = session.deadline
        session.deadline = renewed if renewed > deadline else deadline  # max, without the call
        if session.leases.count and session.heap_due is None:
            self._schedule_session(session)
        lost: list[int] = []
        held = self._claim_all(now, session, hb.claims, lost) if hb.claims else []
        for claim in hb.aborts:
            self._abort(now, session, claim)
        if hb.full is not None:
            self._resync(session, hb.full, lost)
        leases = session.leases
        resync = hb.full is None and (leases.count != hb.count or leases.digest != hb.digest)
        if resync:
            self.stats.resyncs += 1
        self._send_acks(session=session, seq=hb.seq, now=now, held=held, lost=lost, resync=resync)

    def _send_acks(
        self,
        *,
        session: _Session,
        seq: int,
        now: float,
        held: list[tuple[int, float]],
        lost: list[int],
        resync: bool,
    ) -> None:
        # held first, then lost, as one list cut to the frame budget.
        room = self._ack_room
        n_held = len(held)
        if n_held + len(lost) <= room:
            # All in one ack (every steady heartbeat's): the loop below, without the cuts.
            ack = wire.HeartbeatAck(seq=seq, clock=now, held=held, lost=lost, resync=resync)
            self._send_session(session, ack)
            return
        for part in wire.frame_slices(n_held + len(lost), room):
            start, stop = part.start - n_held, part.stop - n_held
            ack = wire.HeartbeatAck(
                seq=seq,
                clock=now,
                held=held[part],
                lost=lost[max(0, start) : max(0, stop)],
                resync=resync,
            )
            self._send_session(session, ack)

    def _claim_all(
        self, now: float, session: _Session, claims: list[wire.Claim], lost: list[int]
    ) -> list[tuple[int, float]]:
        """Hold each proven claim for the session: its (lease, seconds left) for the ack;
        the ids of the others go to ``lost``.

        One loop over the frame's claims with the columns in locals: per claim, a
        method call or an attribute read is a sizeable share of what the claim costs
        above its proof (``holder.claim_floor``).
        """
        table = self._leases
        states, own, hard = table.states, table.own, table.hard
        terminal, row, held_state, granted = TERMINAL, _CLAIM_ROW, HELD, GRANTED
        members = table.members
        holder_col = members.holder
        attach = members.attach
        leases = session.leases
        serial = session.serial
        deadline = session.deadline
        cap = self.config.max_leases_per_session
        held: list[tuple[int, float]] = []
        attached = False
        promoted = 0
        for claim, slot in zip(claims, self._check_claims(session, claims), strict=True):
            lease = claim.lease
            if slot is None or terminal[states[slot]]:
                lost.append(lease)
                continue
            if leases.count >= cap and not members.holds(slot, serial):
                self.stats.limit_refusals += 1
                lost.append(lease)
                continue
            # A claim of a lease the session renews already is the (HELD, CLAIM) row: no change.
            old = states[slot]
            new = row[old]
            if new == held_state and old == granted:
                states[slot] = new  # the table's row; the gauges move once, after the loop
                promoted += 1
            elif new != old:
                self._transition(slot, _IN_CLAIM)
            attach(slot, leases, lease)
            attached = True
            # Just attached: renewed by this session alone unless others renew it too.
            # max and min as expressions (a call to either costs more than the claim's
            # other arithmetic); each column read once, as a read boxes a new float.
            if holder_col[slot] == serial:
                until = own[slot]
                until = deadline if deadline > until else until
            else:
                until = self._live_until(slot)
            stop = hard[slot]
            held.append((lease, (stop if stop < until else until) - now))
        self._granted -= promoted
        self._held += promoted
        if attached and session.heap_due is None and deadline != _NEVER_RENEWED:
            self._schedule_session(session)
        return held

    def _check_claims(self, session: _Session, claims: Sequence[wire.Claim]) -> list[int | None]:
        """Each claim's slot if its proof is right and no other engine owns the lease, else
        None (counted). A live lease nobody owned is the session's engine's from now on.

        The checks of a frame's claims in one loop: nothing they read changes while the
        claims are held (no lease ends or is forgotten), and the session's claimer code
        is taken once, not per lease.
        """
        table = self._leases
        home, mask, ids, overflow = table.index()
        owners, states, tokens, terminal = table.claimer, table.states, table.tokens, TERMINAL
        engines = table.claimers.engines
        engine = session.engine
        message = session.claim_message
        blake2b, compare, width = hashlib.blake2b, hmac.compare_digest, TOKEN_BYTES
        stats = self.stats
        code = UNCLAIMED
        new_owned = 0
        slots: list[int | None] = []
        for claim in claims:
            lease = claim.lease
            slot = home[lease & mask]  # table.slot, inline
            if slot < 0 or ids[slot] != lease:
                slot = overflow.get(lease, -1) if overflow else -1
                if slot < 0:
                    stats.unknown_lease += 1
                    slots.append(None)
                    continue
            owner = engines[owners[slot]]  # table.owner, inline
            if owner is not None and owner != engine:
                stats.owner_mismatch += 1
                slots.append(None)
                continue
            # claim_proof(token, engine, lease), the token sliced from its column
            start = slot * width
            token = tokens[start : start + width]
            proof = blake2b(message(lease), key=token, digest_size=PROOF_BYTES).digest()
            if not compare(proof, claim.proof):
                stats.bad_proof += 1
                slots.append(None)
                continue
            if owner is None and not terminal[states[slot]]:
                if code == UNCLAIMED:
                    code = table.claimers.acquire(engine, session.tp_size, session.expected)
                new_owned += 1
                owners[slot] = code  # table.set_claimer, its code counted below
            slots.append(slot)
        if new_owned > 1:
            table.claimers.retain(code, new_owned - 1)
        stats.claims += new_owned
        return slots

    def _abort(self, now: float, session: _Session, claim: wire.Claim) -> None:
        # One claim at a time: ending a lease may forget a tombstoned one a later abort names.
        (slot,) = self._check_claims(session, (claim,))
        if slot is None:
            return
        if self._fence.writable:
            # The writer aborts only with no write of it in flight (push mode, W3).
            self._disarm(now, claim.lease, session.serial)
        if self._leases.terminal(slot):
            # an explicit "late" row: stays ended
            lease_next(self._leases.state(slot), _IN_ABORT)
            return
        self._end(now, slot, _IN_ABORT, _FREED_ABORTED)

    def _resync(self, session: _Session, deltas: list[int], lost: list[int]) -> None:
        table = self._leases
        wanted = set(wire.delta_decode(deltas))
        slots = {table.ids[slot]: slot for slot in table.members.slots(session.leases)}
        holding = set(slots)  # built in join order, as before: ``lost`` keeps its order
        for lease_id in holding - wanted:
            self._detach(slots[lease_id], session)
        for lease_id in wanted - holding:
            slot = table.slot(lease_id)
            if (
                slot is None
                or table.terminal(slot)
                or table.owner(slot) != session.engine
                or session.leases.count >= self.config.max_leases_per_session
            ):
                lost.append(lease_id)
            else:
                self._attach(slot, session)

    def _on_done(self, now: float, session: _Session, claim: wire.Claim) -> None:
        self.stats.done_frames += 1
        (slot,) = self._check_claims(session, (claim,))
        # A done proves the claim as a heartbeat claim does: if it arrives first (the
        # heartbeat carrying the claim was lost or delayed), _check_claims has just
        # recorded this session as the first claimer of the live lease, and the done
        # counts as claim + done.
        if slot is not None and self._fence.writable:
            # The done rode this session's write, after its data: it can write no more.
            self._disarm(now, claim.lease, session.serial)
        verdict = _VERDICT_REFUSED if slot is None else self._apply_done(now, session, slot)
        proof = b""
        if slot is not None and verdict is _VERDICT_HELD:
            proof = session.verdict_prover(self._leases.token(slot), claim.lease, verdict)
        self._send_session(session, wire.DoneAck(lease=claim.lease, verdict=verdict, proof=proof))

    def _on_arm(self, now: float, session: _Session, claim: wire.Claim) -> None:
        """Push mode: the writer is about to write; arm it if it may (its session holds the
        live writable lease) and say so: it writes only on ``armed``."""
        self.stats.arm_frames += 1
        (slot,) = self._check_claims(session, (claim,))
        ack = wire.ArmAck(lease=claim.lease, armed=False)
        if (
            slot is not None
            and claim.lease in self._fence.writable
            and not self._leases.terminal(slot)
            and self._leases.members.holds(slot, session.serial)
        ):
            self._fence.arm(claim.lease, session.serial)
            left = min(self._live_until(slot), self._leases.hard[slot]) - now
            ack = wire.ArmAck(lease=claim.lease, armed=True, left=left)
        self._send_session(session, ack)

    def _done_input(self, session: _Session, slot: int) -> LeaseInput:
        """What a proven done is to its lease; the tables decide what it does."""
        table = self._leases
        code = table.claimer[slot]  # table.reader_tp and table.expected, read once
        reader_tp = table.claimers.tps[code]
        if reader_tp and reader_tp != session.tp_size:
            # reader_tp is unset only when the lease ended before anyone claimed it:
            # such a done is late, not of another TP layout.
            return _IN_FOREIGN_DONE
        consumers = table.consumers.get(slot)
        if consumers is not None and consumers.get(session.rank) == session.serial:
            # Keyed by session, not by rank: if someone else's done for this rank came
            # first (a replayed Hello without auth_secret), the real reader's done after
            # the free is answered LATE, so its read is fenced instead of trusted.
            return _IN_DUPLICATE_DONE
        if TERMINAL[table.states[slot]]:
            return _IN_DONE
        counted = 0 if consumers is None else len(consumers)
        if consumers is None or session.rank not in consumers:
            counted += 1
        return _IN_LAST_DONE if counted >= table.claimers.expected[code] else _IN_DONE

    def _apply_done(self, now: float, session: _Session, slot: int) -> DoneVerdict:
        event = self._done_input(session, slot)
        verdict = done_verdict(STATES[self._leases.states[slot]], event)
        if event is _IN_FOREIGN_DONE:
            self.stats.bad_rank_done += 1  # not in the expected set: its read is not vouched for
        elif verdict is _VERDICT_LATE:
            self.stats.late_done += 1
        elif event is _IN_DUPLICATE_DONE:
            self.stats.duplicate_done += 1  # the same answer as before
        elif event is _IN_LAST_DONE:
            self._count_consumer(session, slot)
            self._end(now, slot, event, _FREED_DONE)
            return verdict
        else:
            self._count_consumer(session, slot)
            self._transition(slot, event)
            if self._leases.members.holds(slot, session.serial):
                self._detach(slot, session)
            return verdict
        self._transition(slot, event)  # a "stay" row
        return verdict

    def _count_consumer(self, session: _Session, slot: int) -> None:
        consumers = self._leases.consumers.setdefault(slot, {})
        consumers.setdefault(session.rank, session.serial)

    def _handle_legacy(self, now: float, peer: PeerId, data: bytes) -> None:
        if not self.config.accept_legacy:
            self.stats.malformed += 1
            return
        try:
            frame = legacy.parse(data)
        except RemoteProtocolError:
            self.stats.malformed += 1
            return
        self.stats.legacy_frames += 1
        owner = "legacy:" + peer
        ids = (
            frame.request_ids if isinstance(frame, legacy.LegacyHeartbeat) else (frame.request_id,)
        )
        if len(ids) > self.config.max_ids_per_frame:
            self.stats.limit_refusals += 1
            return
        table = self._leases
        for request_id in ids:
            slot = table.slot_of_request(request_id)
            if slot is None:
                self.stats.unknown_lease += 1
                continue
            claimed_by = table.owner(slot)
            if claimed_by is not None and claimed_by != owner:
                self.stats.owner_mismatch += 1
                continue
            if table.terminal(slot):
                if isinstance(frame, legacy.LegacyDone):
                    self.stats.late_done += 1
                continue
            if claimed_by is None:
                table.set_claimer(slot, owner)
                self._transition(slot, LeaseInput.CLAIM)
            if isinstance(frame, legacy.LegacyHeartbeat):
                # Stock peers renew per lease; there is no session to renew.
                table.own[slot] = max(table.own[slot], now + self.config.lease_extension)
                continue
            # Stock vLLM counts raw notifications against the count the reader sends.
            done = table.legacy_done.get(slot, 0) + 1
            table.legacy_done[slot] = done
            if done >= frame.expected:
                self._end(now, slot, LeaseInput.LAST_DONE, ReleaseReason.DONE)
            else:
                self._transition(slot, LeaseInput.DONE)

    # -------------------------------------------------------- bookkeeping

    def _transition(self, slot: int, event: LeaseInput) -> None:
        states = self._leases.states
        old = states[slot]
        new = NEXT_STATE[event._value_][old]
        if new == NO_ROW:
            lease_next(STATES[old], event)  # raises: the lease table has no such row
        if new != old:
            if old == GRANTED:
                self._granted -= 1
            else:
                self._held -= 1
            if new == HELD:
                self._held += 1
            states[slot] = new

    def _end(self, now: float, slot: int, event: LeaseInput, reason: ReleaseReason) -> None:
        self._transition(slot, event)
        members = self._leases.members
        if members.holder[slot] != NOBODY:
            for serial in members.holders(slot):
                self._detach(slot, self._by_serial[serial], fall_back=False)
        counter = _END_STATE_COUNTER[reason]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        lease_id = self._leases.ids[slot]
        request_id = self._leases.request_id(slot)
        writable = self._fence.writable
        if writable and lease_id in writable and self._fence.end(lease_id, reason):
            # A writer may still write into the blocks: not used, not reused, and not
            # forgotten (its done or abort must find it) until the last disarm.
            self.stats.write_fenced += 1
            self._out.append(WriteFenced(lease=lease_id, request_id=request_id, reason=reason))
            return
        self._out.append(FreeBlocks(lease=lease_id, request_id=request_id, reason=reason))
        self._tombstone(now, lease_id)

    def _tombstone(self, now: float, lease_id: int) -> None:
        """Remember an ended lease for late frames, for ``tombstone_ttl`` (and a cap)."""
        self._tombstones.append((now + self.config.tombstone_ttl, lease_id))
        if len(self._tombstones) > self.config.max_tombstones:
            self._leases.forget(self._tombstones.popleft()[1])

    def _disarm(self, now: float, lease_id: int, serial: int) -> None:
        """Session ``serial`` can write no more into ``lease_id``: settle it if it was the
        last writer of a quarantined lease."""
        reason = self._fence.disarm(lease_id, serial)
        if reason is not None:
            self._settle(now, lease_id, reason)

    def _disarm_session(self, now: float, serial: int) -> None:
        """Session ``serial``'s peer was lost: it can write into nothing any more."""
        if self._fence.is_armed(serial):
            for lease_id, reason in self._fence.disarm_session(serial):
                self._settle(now, lease_id, reason)

    def _settle(self, now: float, lease_id: int, reason: ReleaseReason) -> None:
        """A quarantined lease's last writer was disarmed: its blocks may be reused now."""
        slot = self._leases.slot(lease_id)
        request_id = "" if slot is None else self._leases.request_id(slot)
        self._out.append(FreeBlocks(lease=lease_id, request_id=request_id, reason=reason))
        self._tombstone(now, lease_id)

    def _attach(self, slot: int, session: _Session) -> None:
        self._leases.members.attach(slot, session.leases, self._leases.ids[slot])
        if session.heap_due is None and session.deadline != _NEVER_RENEWED:
            self._schedule_session(session)

    def _detach(self, slot: int, session: _Session, *, fall_back: bool = True) -> None:
        """Take the lease out of ``session``; it keeps what the session had given it."""
        table = self._leases
        table.members.detach(slot, session.leases, table.ids[slot])
        if fall_back and not TERMINAL[table.states[slot]]:
            table.own[slot] = max(table.own[slot], session.deadline)
            if table.members.holder[slot] == NOBODY:
                self._schedule_lease(slot)

    def _forget_session(self, now: float, session: _Session, *, lost: bool) -> None:
        # Out of the serial index last: the leases it renews name it until detached.
        for slot in self._leases.members.slots(session.leases):
            if lost and self._leases.members.holder[slot] == session.serial:
                self._end(now, slot, _IN_PEER_LOST, _FREED_PEER_LOST)
            else:
                # Another session (another reader rank) still holds it: the lease keeps
                # what this one had given it, or its deadline would move earlier (S2).
                self._detach(slot, session)
        self._leases.members.close(session.leases)
        self._by_serial.pop(session.serial, None)

    def _evict_idle_session(self) -> bool:
        for peer, session in self._sessions.items():
            if not session.leases.count and not self._fence.is_armed(session.serial):
                del self._sessions[peer]
                self._leases.members.close(session.leases)
                self._by_serial.pop(session.serial, None)
                return True
        return False

    def _live_until(self, slot: int) -> float:
        table = self._leases
        until = table.own[slot]
        held = table.members.holder[slot]
        if held == NOBODY:
            return until
        if held != SEVERAL:
            return max(until, self._by_serial[held].deadline)
        for serial in table.members.holders(slot):
            until = max(until, self._by_serial[serial].deadline)
        return until

    def _schedule_lease(self, slot: int) -> None:
        table = self._leases
        due = table.hard[slot]
        if table.members.holder[slot] == NOBODY:
            own = table.own[slot]
            due = own if own < due else due  # min(own, hard), without the call
        if table.due[slot] <= due:  # False while UNSCHEDULED (NaN)
            return  # the earlier canonical entry will fire and re-schedule
        table.due[slot] = due
        self._lease_deadlines.push(due, table.ids[slot])

    def _schedule_session(self, session: _Session) -> None:
        session.heap_due = session.deadline
        heapq.heappush(self._session_heap, (session.deadline, session.serial))

    def _bucket(self, peer: PeerId, now: float) -> TokenBucket:
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = TokenBucket(self.config.rate_limit_per_s, self.config.rate_limit_burst, now)
            self._buckets[peer] = bucket
            if len(self._buckets) > 2 * self.config.max_sessions:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        return bucket

    def _send_revoke(self, slot: int, reason: ReleaseReason) -> None:
        lease_id = self._leases.ids[slot]
        for serial in self._leases.members.holders(slot):
            revoke = wire.Revoke(leases=[lease_id], reason=int(reason))
            self._send_session(self._by_serial[serial], revoke)

    def _send_session(self, session: _Session, msg: wire.Message) -> None:
        self._out.append(SendFrame(peer=session.peer, payload=wire.encode(msg, session.down)))

    def _send_keyed(self, peer: PeerId, key: bytes, msg: wire.Message) -> None:
        self._out.append(SendFrame(peer=peer, payload=wire.encode(msg, key)))

    def _send_plain(self, peer: PeerId, msg: wire.Message) -> None:
        self._out.append(SendFrame(peer=peer, payload=wire.encode(msg, self.config.auth_secret)))


def ended(outputs: Iterable[HolderOutput]) -> list[FreeBlocks]:
    """The FreeBlocks among a drain's outputs (a convenience for bindings and tests)."""
    return [o for o in outputs if isinstance(o, FreeBlocks)]
