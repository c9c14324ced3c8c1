"""Heartbeat batching of one reader session: what the next heartbeats carry, and what came back.

A session's heartbeat renews every lease the session holds, so it carries
only *changes* -- claims of newly tracked leases, aborts of given-up ones --
until the holder acknowledges them, plus the count and digest of the whole
set (:class:`~kvproto.leaseset.LeaseSet`). A tick's changes are split to the
frame budget, never truncated: each frame's count and digest describe the
set the holder holds once it applied that frame (the set minus the claims
still to come), so a split batch does not look like a divergence, and only
the last frame of a tick states the whole set. When the holder saw a
divergence it asks for a resync: the next tick lists every id (or, if they
do not fit one frame, claims every lease again).

Sans-I/O: :meth:`Beats.frames` returns the encoded frames; the reader sends
them and keeps the request side of every acknowledgement.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from kvproto import wire
from kvproto.leaseset import LeaseSet, digest_of_sum

_INFLIGHT_KEEP = 64
"""Sent heartbeats remembered for their acknowledgement (older answers are unexpected)."""
_NO_IDS: tuple[int, ...] = ()
_NO_CLAIMS: list[wire.Claim] = []
"""The steady heartbeat's claims and aborts: one shared empty list, not two new ones a
frame (never mutated: a Heartbeat is encoded and dropped)."""


class Inflight(msgspec.Struct):
    """One sent heartbeat, remembered until its acknowledgement (or until pushed out).

    A Struct, not a dataclass: one is made per heartbeat sent, and CPython 3.11 makes a
    Python class instance at ~4k instructions against msgspec's ~1k."""

    sent: float
    """When it left (local clock)."""
    claims: tuple[int, ...]
    """Leases it claimed."""
    aborts: tuple[int, ...]
    """Leases it aborted."""
    final: bool = True
    """Last frame of its tick: the only one whose count and digest state the whole set."""
    acked_at: float | None = None
    """When its acknowledgement arrived (local clock); None while unanswered."""


class Beats:
    """The heartbeat side of one reader session. See the module docstring."""

    __slots__ = (
        "acked_seq",
        "in_sync_seq",
        "in_sync_since",
        "inflight",
        "last_beat",
        "leases",
        "next_beat",
        "pending_aborts",
        "pending_claims",
        "seq",
        "want_full",
    )

    def __init__(self) -> None:
        self.leases: LeaseSet[str] = LeaseSet()
        """Lease id → the request whose lease it is (ids repeat across incarnations)."""
        self.pending_claims: dict[int, bytes] = {}
        """Lease → claim proof, until a heartbeat carrying it is acknowledged."""
        self.pending_aborts: dict[int, bytes] = {}
        """Lease → proof, until a heartbeat carrying the abort is acknowledged."""
        self.inflight: dict[int, Inflight] = {}
        """Seq → sent heartbeat, in send order (the last :data:`_INFLIGHT_KEEP`)."""
        self.seq = 0
        """Seq of the last heartbeat sent."""
        self.acked_seq = 0
        """Highest heartbeat seq the holder acknowledged (in sync or not)."""
        self.last_beat = -math.inf
        """When the last heartbeat left (deferrals of one instant share it)."""
        self.next_beat = math.inf
        """When the session's timer is due (the next heartbeat, or a Hello retry)."""
        self.want_full = False
        """The holder asked for a resync: the next tick lists the whole set."""
        self.in_sync_seq = -1
        """Seq of the last heartbeat whose count and digest matched the holder's set."""
        self.in_sync_since = -math.inf
        """When that heartbeat left."""

    # ------------------------------------------------------------ the set

    def hold(self, lease: int, request_id: str, proof: bytes) -> None:
        """Heartbeat ``lease`` from now on; its claim goes in the next heartbeat."""
        self.leases.add(lease, request_id)
        self.pending_claims[lease] = proof

    def release(self, lease: int) -> None:
        """Stop heartbeating ``lease`` (an unsent claim of it is dropped)."""
        self.leases.discard(lease)
        self.pending_claims.pop(lease, None)

    def reclaim_all(self, proof_of: Callable[[str], bytes]) -> None:
        """Claim every held lease again (a new session: the holder knows none of them)."""
        for lease, rid in self.leases.items():
            self.pending_claims.setdefault(lease, proof_of(rid))

    def reset(self) -> None:
        """The session broke: nothing is pending or in flight any more."""
        self.next_beat = math.inf
        self.pending_claims.clear()
        self.pending_aborts.clear()
        self.inflight.clear()

    # ------------------------------------------------------------ sending

    def frames(
        self,
        now: float,
        *,
        key: bytes,
        budget: int,
        proof_of: Callable[[str], bytes],
    ) -> list[bytes]:
        """This tick's heartbeat frames, signed with ``key``, split to ``budget`` bytes.

        The caller schedules the next tick (:attr:`next_beat`).
        """
        if not (self.pending_claims or self.pending_aborts or self.want_full):
            # The steady state: nothing to carry but the set's count and digest.
            steady = self._frame(
                now,
                key,
                claims=_NO_CLAIMS,
                aborts=_NO_CLAIMS,
                later_count=0,
                later_ids=0,
                full=None,
                final=True,
            )
            return [steady]
        claims = [wire.Claim(lease=lease, proof=p) for lease, p in self.pending_claims.items()]
        aborts = [wire.Claim(lease=lease, proof=p) for lease, p in self.pending_aborts.items()]
        full: list[int] | None = None
        if self.want_full:
            self.want_full = False
            if len(self.leases) <= (budget - wire.FRAME_OVERHEAD) // wire.ID_BYTES:
                # The full list goes alone in the first frame and names only leases the
                # holder can already know: claims travel in the frames after it, and a
                # listed lease that was never claimed would be answered "lost".
                pending = self.pending_claims
                full = wire.delta_encode(lease for lease in self.leases if lease not in pending)
            else:
                # Too many to list in one frame: fall back to explicit claims of every lease.
                claims = [
                    wire.Claim(lease=lease, proof=proof_of(rid))
                    for lease, rid in self.leases.items()
                ]
        per_frame = wire.frame_room(budget, wire.CLAIM_BYTES)
        return self._split(now, key, claims=claims, aborts=aborts, full=full, per_frame=per_frame)

    def _split(
        self,
        now: float,
        key: bytes,
        *,
        claims: list[wire.Claim],
        aborts: list[wire.Claim],
        full: list[int] | None,
        per_frame: int,
    ) -> list[bytes]:
        """Aborts first, then claims, ``per_frame`` to a frame (the full list alone, first)."""
        items = [(False, c) for c in aborts] + [(True, c) for c in claims]
        chunks = [items[cut] for cut in wire.frame_slices(len(items), per_frame)]
        if full is not None and items:
            chunks.insert(0, [])  # the full list goes alone
        later_count = len(claims)
        later_ids = sum(c.lease for c in claims)
        out = []
        for index, chunk in enumerate(chunks):
            chunk_claims = [c for is_claim, c in chunk if is_claim]
            chunk_aborts = [c for is_claim, c in chunk if not is_claim]
            later_count -= len(chunk_claims)
            later_ids -= sum(c.lease for c in chunk_claims)
            out.append(
                self._frame(
                    now,
                    key,
                    claims=chunk_claims,
                    aborts=chunk_aborts,
                    later_count=later_count,
                    later_ids=later_ids,
                    full=full if index == 0 else None,
                    final=index == len(chunks) - 1,
                )
            )
        return out

    def _frame(
        self,
        now: float,
        key: bytes,
        *,
        claims: list[wire.Claim],
        aborts: list[wire.Claim],
        later_count: int,
        later_ids: int,
        full: list[int] | None,
        final: bool,
    ) -> bytes:
        """One heartbeat; its count and digest leave out the claims still to come
        (``later_count`` of them, their ids summing to ``later_ids``)."""
        self.seq += 1
        self.last_beat = now
        leases = self.leases
        hb = wire.Heartbeat(
            seq=self.seq,
            claims=claims,
            aborts=aborts,
            count=leases.count - later_count,
            # The set's digest less the later claims' (the digest is linear in the ids).
            digest=digest_of_sum(leases.id_sum - later_ids),
            full=full,
        )
        inflight = self.inflight
        inflight[self.seq] = Inflight(
            now,
            tuple(c.lease for c in claims) if claims else _NO_IDS,
            tuple(c.lease for c in aborts) if aborts else _NO_IDS,
            final,
        )
        if len(inflight) > _INFLIGHT_KEEP:
            del inflight[next(iter(inflight))]
        return wire.encode(hb, key)

    # ------------------------------------------------------------ answers

    def answered(self, now: float, seq: int) -> Inflight | None:
        """The holder acknowledged heartbeat ``seq``; None if it is not one we wait on.

        Its aborts are done with; the request side (held, lost) is the reader's.
        """
        sent = self.inflight.get(seq)
        if sent is None:
            return None
        self.acked_seq = max(self.acked_seq, seq)
        if sent.acked_at is None:
            sent.acked_at = now
        for lease in sent.aborts:
            self.pending_aborts.pop(lease, None)
        return sent

    def claim_answered(self, lease: int, sent: Inflight) -> bool:
        """An acknowledgement of ``sent`` names ``lease``: whether it answers our claim of it."""
        return self.pending_claims.pop(lease, None) is not None or lease in sent.claims

    def compared(self, seq: int, sent: Inflight, *, resync: bool) -> bool:
        """The holder compared its set with heartbeat ``seq``'s; True if it asks for a resync.

        Only the last frame of a tick counts: an earlier frame of a split batch
        excludes claims still in flight, so neither a mismatch nor a match says
        anything about the set.
        """
        if not sent.final:
            return False
        if resync:
            self.want_full = True
            return True
        if seq > self.in_sync_seq:
            # Count and digest matched: when this heartbeat arrived the holder held
            # exactly our lease set, so every lease claimed by then lives at least
            # until arrival + extension, and arrival came after sending.
            self.in_sync_seq = seq
            self.in_sync_since = sent.sent
        return False
