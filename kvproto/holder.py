"""The holder: keeps KV blocks alive exactly as long as a reader may still read them.

Sans-I/O, in the manner of aioquic's ``QuicConnection``: every input carries
``now``; :meth:`Holder.get_timer` says when the holder next needs
:meth:`Holder.handle_timer`; :meth:`Holder.drain` returns what the binding
must do (send these frames, free these blocks). The life cycle and the
session keep-alive are explained in :mod:`kvproto.states`.

One :class:`Holder` serves one holder rank: it keeps the API (grant, adopt,
revoke, queries), dispatches each frame to the part it concerns and runs the
timers. The parts: the sessions with reader ranks, their Hellos and keys
(:mod:`kvproto.holder_peers`); the heartbeat path, claims and resyncs
(:mod:`kvproto.holder_claims`); dones and their verdicts
(:mod:`kvproto.holder_dones`); stock vLLM peers (:mod:`kvproto.holder_legacy`).
All of them move leases through one :class:`~kvproto.holder_book.LeaseBook`:
the lease table and its gauges, the expiry queues, the outputs.

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

import math
import secrets
from collections.abc import Callable

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError, RemoteProtocolError
from kvproto.events import HolderOutput, ReleaseReason
from kvproto.holder_book import LeaseBook
from kvproto.holder_claims import Claims
from kvproto.holder_dones import Dones
from kvproto.holder_legacy import handle_legacy
from kvproto.holder_peers import PeerSessions, authentic
from kvproto.holder_writes import Arms
from kvproto.states import LeaseInput, LeaseState, WriteState, lease_next
from kvproto.stats import HolderStats, counts_of
from kvproto.ticket import LeaseMint, LeaseTicket, ticket_problem
from kvproto.transport import PeerId
from kvproto.wire import RejectReason


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
        self.engine = engine
        self.incarnation = incarnation
        self.rank = rank
        self.tp_size = tp_size
        self.stats = HolderStats()
        self._mint = LeaseMint(
            engine=engine,
            incarnation=incarnation,
            tp_size=tp_size,
            params=config.params,
            entropy=entropy,
        )
        self._book = book = LeaseBook(config, self.stats)
        self._leases = book.leases
        # The book's queues, read in place by get_timer and handle_timer after every step.
        self._lease_deadlines = book.lease_deadlines
        self._session_heap = book.session_heap
        self._tombstones = book.tombstones
        self._peers = PeerSessions(
            book,
            engine=engine,
            incarnation=incarnation,
            rank=rank,
            tp_size=tp_size,
            entropy=entropy,
        )
        self._sessions = self._peers.by_peer
        self._claims = Claims(book)
        self._dones = Dones(book, self._claims)
        self._arms = Arms(book, self._claims)

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

        ``ttl`` defaults to the claim window (``config.grant_ttl``): nobody heartbeats
        the lease before its reader's claim; pass ``decoder_kv_blocks_ttl`` for
        bidirectional turn-2 blocks, which a client keeps for its next turn.
        ``writable``: the reader *writes* the blocks (push mode): its Arm arms the
        write fence, and the blocks are let go only once no write can land
        (``WriteFenced``, spec/push-mode.md).
        """
        lifetime = self.config.grant_ttl if ttl is None else ttl
        if not 0 < lifetime <= self.config.max_hold:  # also refuses NaN (it would poison the queue)
            raise LocalProtocolError(f"lease ttl {lifetime} outside (0, max_hold]")
        ticket = self._mint.mint(now, request_id=request_id, ttl=lifetime)
        problem = self._request_problem(ticket)
        if problem is not None:
            raise LocalProtocolError(problem)
        self._book.hold(now, ticket, writable=writable)
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
        self._book.hold(now, ticket, writable=writable)

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

    def revoke(self, now: float, lease_id: int) -> None:
        """Free a live lease now (memory pressure) and tell its readers to recompute."""
        slot = self._leases.slot(lease_id)
        if slot is None:
            raise LocalProtocolError(f"unknown lease {lease_id}")
        lease_next(self._leases.state(slot), LeaseInput.REVOKE)  # raises if already ended
        self._book.send_revoke(slot, ReleaseReason.REVOKED)
        self._book.end(now, slot, LeaseInput.REVOKE, ReleaseReason.REVOKED)

    def peer_lost(self, now: float, peer: PeerId) -> None:
        """The transport says ``peer`` is gone: end the leases only its session held (and,
        push mode, disarm it: the proof that it writes no more)."""
        self._peers.lost(now, peer)

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
        if session is not None and authentic(session, data):
            if not session.bucket.take(now):
                self.stats.rate_limited += 1
                return
            msg = self._decode_counted(data)
            if msg is None:
                return
            if isinstance(msg, wire.Heartbeat):
                self._claims.on_heartbeat(now, session, msg)
            elif isinstance(msg, wire.Done):
                self._dones.on_done(now, session, msg.claim)
            elif isinstance(msg, wire.Arm):
                self._arms.on_arm(now, session, msg.claim)
            else:
                self.stats.unexpected_frames += 1
            return
        if not self._peers.bucket(peer, now).take(now):
            self.stats.rate_limited += 1
            return
        if not wire.is_kvproto_frame(data):
            handle_legacy(self._book, now, peer, data)
            return
        msg = self._decode_counted(data)
        if msg is None:
            return
        if isinstance(msg, wire.Hello):
            secret = self.config.auth_secret
            if secret is not None and not wire.verify(secret, data):
                self.stats.bad_mac += 1
                return
            self._peers.on_hello(now, peer, msg)
        elif not isinstance(msg, (wire.Heartbeat, wire.Done, wire.Arm)):
            self.stats.unexpected_frames += 1
        elif session is None:
            self.stats.no_session += 1
            seq = msg.seq if isinstance(msg, wire.Heartbeat) else 0
            self._book.send_plain(peer, wire.Reject(reason=RejectReason.NO_SESSION, seq=seq))
        else:
            # Not signed with this session's key: a forgery, or a reader that holds
            # another key (two of its Hellos crossed). It changes nothing; the
            # unauthenticated answer only asks for a Hello, which the reader heeds
            # at most once an interval and only for a heartbeat it is waiting on.
            self.stats.bad_mac += 1
            if isinstance(msg, wire.Heartbeat) and wire.signed(data):
                self._book.send_plain(
                    peer, wire.Reject(reason=RejectReason.NO_SESSION, seq=msg.seq)
                )

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
        # The binding calls after every step: look at the queues' heads in place.
        book = self._book
        if self._session_heap and self._session_heap[0][0] <= now:
            book.expire_sessions(now)
        if self._lease_deadlines.soonest <= now:
            book.expire_leases(now)
        if self._tombstones and self._tombstones[0][0] <= now:
            book.forget_tombstones(now)

    def drain(self) -> list[HolderOutput]:
        """Everything the binding must do now, in order."""
        book = self._book
        out, book.out = book.out, []
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
        return min(self._book.live_until(slot), self._leases.hard[slot])

    def write_state(self, lease_id: int) -> WriteState:
        """The write fence's state of a writable lease (SETTLED once its blocks may be
        reused, and for every lease that was never writable)."""
        return self._book.fence.state(lease_id)

    def is_live(self, lease_id: int) -> bool:
        """True while the lease's blocks are held (granted or held, not ended)."""
        slot = self._leases.slot(lease_id)
        return slot is not None and not self._leases.terminal(slot)

    def live_leases(self) -> int:
        """Leases whose blocks are still held."""
        return self._book.granted + self._book.held

    def reader_of(self, peer: PeerId) -> tuple[str, int] | None:
        """(engine, rank) of the reader whose session ``peer`` carries, or None."""
        session = self._sessions.get(peer)
        return None if session is None else (session.engine, session.rank)

    def stats_snapshot(self, prefix: str = "") -> dict[str, int]:
        """Counters plus gauges (leases by state, sessions), each key ``prefix + name``."""
        snap = counts_of(self.stats, prefix)
        snap[prefix + "leases_granted"] = self._book.granted
        snap[prefix + "leases_held"] = self._book.held
        snap[prefix + "sessions"] = len(self._sessions)
        snap[prefix + "tombstones"] = len(self._tombstones)
        snap[prefix + "leases_quarantined"] = self._book.fence.quarantined()
        return snap
