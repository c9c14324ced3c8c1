"""The holder's sessions with reader ranks: the table by peer, Hellos, keying and rate limits.

A reader rank opens a session with a Hello whose *anchor* proves the token of a
live lease (:func:`kvproto.auth.hello_proof`); the holder answers a Welcome and
both derive the directional session keys from that token
(:func:`kvproto.auth.session_keys`). What a Hello is to the peer's session
(first, duplicate, re-key, replay, restart, impostor) is classified here and
the peer-session table (:mod:`kvproto.states`) says what follows. A Hello that
proves nothing is dropped unanswered; one the holder refuses (wrong rank, too
many sessions) is answered with a Reject under the refusal key
(:func:`kvproto.auth.refusal_key`), which only the Hello's sender can check.

It is apart from the holder because a session's life is keyed by peer and
reader, not by lease; the leases a session renews are the
:class:`~kvproto.holder_book.LeaseBook`'s.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Callable

from kvproto import auth, wire
from kvproto.holder_book import LeaseBook, PeerSession
from kvproto.ratelimit import TokenBucket
from kvproto.states import PeerSessionInput, PeerSessionState, peer_session_next
from kvproto.tpmath import expected_consumers, target_remote_ranks
from kvproto.transport import PeerId
from kvproto.wire import RejectReason


def authentic(session: PeerSession, data: bytes) -> bool:
    """Signed with the session's reader key (or the one before the last re-key)."""
    if wire.verify(session.up, data):
        return True
    return bool(session.prev_up) and wire.verify(session.prev_up, data)


class PeerSessions:
    """The holder's sessions by peer, and the rate limits of peers without one."""

    __slots__ = (
        "_book",
        "_buckets",
        "_config",
        "_engine",
        "_entropy",
        "_incarnation",
        "_rank",
        "_serial",
        "_stats",
        "_tp_size",
        "by_peer",
    )

    def __init__(
        self,
        book: LeaseBook,
        *,
        engine: str,
        incarnation: int,
        rank: int,
        tp_size: int,
        entropy: Callable[[int], bytes],
    ) -> None:
        self._book = book
        self._config = book.config
        self._stats = book.stats
        self._engine = engine
        self._incarnation = incarnation
        self._rank = rank
        self._tp_size = tp_size
        self._entropy = entropy
        self.by_peer: dict[PeerId, PeerSession] = {}
        self._serial = 0
        self._buckets: OrderedDict[PeerId, TokenBucket] = OrderedDict()

    def bucket(self, peer: PeerId, now: float) -> TokenBucket:
        """The rate limit of frames under ``peer``'s name that no session key signs."""
        bucket = self._buckets.get(peer)
        if bucket is None:
            config = self._config
            bucket = TokenBucket(config.rate_limit_per_s, config.rate_limit_burst, now)
            self._buckets[peer] = bucket
            if len(self._buckets) > 2 * config.max_sessions:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        return bucket

    def lost(self, now: float, peer: PeerId) -> None:
        """The transport says ``peer`` is gone: end the leases only its session held.

        Also the proof that the peer can write no more (push mode): its sessions are
        disarmed, the current one and any forgotten under that name.
        """
        book = self._book
        session = self.by_peer.pop(peer, None)
        state = PeerSessionState.ABSENT if session is None else PeerSessionState.OPEN
        peer_session_next(state, PeerSessionInput.LOST)
        if session is not None:
            book.disarm_session(now, session.serial)
            book.forget_session(now, session, lost=True)
        if book.fence.writable:
            for lease, reason in book.fence.peer_lost(peer):
                book.settle(now, lease, reason)
        self._buckets.pop(peer, None)

    def on_hello(self, now: float, peer: PeerId, hello: wire.Hello) -> None:
        """Open, re-key or refuse the peer's session; answer only what ``hello`` proves."""
        book, config, stats = self._book, self._config, self._stats
        old = self.by_peer.get(peer)
        event = self._hello_input(old, hello)
        state = PeerSessionState.ABSENT if old is None else PeerSessionState.OPEN
        after = peer_session_next(state, event)  # every input the classification makes has a row
        if event is PeerSessionInput.IMPOSTOR:
            stats.bad_hello += 1  # another reader under this incarnation's name
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
            stats.bad_hello += 1
            return
        if event is PeerSessionInput.REPLAYED:
            stats.replayed += 1  # an older Hello of this reader, replayed
            return
        refusal = auth.refusal_key(anchor_token, hello.nonce, config.auth_secret)
        if not self._reads_from_us(hello):
            # This rank never reads from us: its dones could count for ranks that do.
            stats.limit_refusals += 1
            book.send_keyed(peer, refusal, wire.Reject(reason=RejectReason.WRONG_RANK))
            return
        if old is not None and event is PeerSessionInput.RESTARTED:
            # The same transport name with a new incarnation: the old reader died. Not
            # proof that it can write no more (any engine can say this Hello): its armed
            # leases wait for the transport's word on the peer (spec/push-mode.md §5).
            del self.by_peer[peer]
            book.fence.orphan(peer, old.serial)
            book.forget_session(now, old, lost=True)
            old = None
            event = PeerSessionInput.FIRST
            peer_session_next(after, event)
        if old is None and (
            len(self.by_peer) >= config.max_sessions and not self._evict_idle_session()
        ):
            stats.limit_refusals += 1
            book.send_keyed(peer, refusal, wire.Reject(reason=RejectReason.TOO_MANY))
            return
        duplicate = event is PeerSessionInput.DUPLICATE
        self._welcome(now, peer, hello, old, anchor_token, duplicate=duplicate)

    def _welcome(
        self,
        now: float,
        peer: PeerId,
        hello: wire.Hello,
        old: PeerSession | None,
        anchor_token: bytes,
        *,
        duplicate: bool,
    ) -> None:
        """Key the session ``hello`` opens (``old`` None) or re-keys, and welcome it."""
        book, config = self._book, self._config
        if duplicate and old is not None and old.server_nonce:
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
            holder_engine=self._engine,
            holder_rank=self._rank,
            holder_incarnation=self._incarnation,
            nonce=hello.nonce,
            server_nonce=server_nonce,
            secret=config.auth_secret,
        )
        if old is None:
            self._serial += 1
            bucket = TokenBucket(config.rate_limit_per_s, config.rate_limit_burst, now)
            leases = book.leases.members.open(self._serial)
            session = PeerSession(self._serial, peer, hello, bucket, leases)
            session.expected = expected_consumers(self._tp_size, hello.tp_size)
            self.by_peer[peer] = session
            book.by_serial[session.serial] = session
        else:
            session = old
            if session.up != up:
                session.prev_up = session.up
            session.hello_nonce = hello.nonce
            session.attempt = hello.attempt
        session.up, session.down = up, down
        session.server_nonce = server_nonce
        welcome = wire.Welcome(
            engine=self._engine,
            rank=self._rank,
            tp_size=self._tp_size,
            incarnation=self._incarnation,
            nonce=hello.nonce,
            server_nonce=server_nonce,
            params=config.params,
            clock=now,
        )
        book.send_keyed(peer, down, welcome)

    def _anchor(self, hello: wire.Hello, old: PeerSession | None) -> bytes | None:
        """The Hello's anchor lease's token if its proof is right and it may key this session.

        A new session (or a new reader incarnation) may be keyed by any live
        lease whose token the Hello proves (owner binding is for claims: a key
        is as secret as the token it comes from). Re-keying a live session needs a lease
        that session holds (if it holds any): a ticket of one's own, claimed under
        another engine's name, cannot take over that engine's session.
        """
        table = self._book.leases
        anchor = hello.anchor
        slot = None if anchor is None else table.slot(anchor.lease)
        if anchor is None or slot is None or table.terminal(slot):
            return None
        if (
            old is not None
            and old.incarnation == hello.incarnation
            and old.leases.count
            and not table.members.holds(slot, old.serial)
        ):
            return None
        token = table.token(slot)
        proof = auth.hello_proof(
            token,
            reader_engine=hello.engine,
            reader_rank=hello.rank,
            reader_tp=hello.tp_size,
            reader_incarnation=hello.incarnation,
            holder_rank=self._rank,
            lease=anchor.lease,
            attempt=hello.attempt,
            nonce=hello.nonce,
        )
        return token if hmac.compare_digest(proof, anchor.proof) else None

    def _reads_from_us(self, hello: wire.Hello) -> bool:
        """The Hello's reader rank reads from this holder rank (its TP layout divides ours)."""
        big, small = max(hello.tp_size, self._tp_size), min(hello.tp_size, self._tp_size)
        if big % small:
            return False  # layouts that do not divide never pair (wire.decode checked both >= 1)
        return self._rank in target_remote_ranks(hello.rank, hello.tp_size, self._tp_size)

    @staticmethod
    def _hello_input(old: PeerSession | None, hello: wire.Hello) -> PeerSessionInput:
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

    def _evict_idle_session(self) -> bool:
        for peer, session in self.by_peer.items():
            if not session.leases.count and not self._book.fence.is_armed(session.serial):
                del self.by_peer[peer]
                self._book.close_session(session)
                return True
        return False
