"""The holder's write fence: writable leases (push mode) and the writers armed on them.

In push mode the holder's blocks are *written* by the reader (spec/push-mode.md). A late
write cannot be fenced after the fact the way a late read is, so the blocks of a writable
lease are let go only once no write can land in them any more: each writer session is
*armed* by its accepted claim and *disarmed* by its done (which rides the write, after
the data), its abort (sent only with no write in flight) or its peer's loss. A lease that
ends while a session is still armed is *quarantined*: the holder says ``WriteFenced``
then, and ``FreeBlocks`` only at the last disarm. The transitions are
:data:`~kvproto.states.WRITE_TRANSITIONS`; this class keeps the sets they are about, and
the holder emits the outputs.

Pull-only holders never touch it beyond one emptiness test per claim and per end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvproto import wire
from kvproto.events import ReleaseReason
from kvproto.states import WriteInput, WriteState, write_next
from kvproto.transport import PeerId

if TYPE_CHECKING:
    from kvproto.holder_book import LeaseBook, PeerSession
    from kvproto.holder_claims import Claims

_OPEN = WriteState.OPEN
_ARMED = WriteState.ARMED
_QUARANTINED = WriteState.QUARANTINED
_SETTLED = WriteState.SETTLED


class WriteFence:
    """Writable leases not yet settled, by lease id. See the module docstring."""

    __slots__ = ("_armed", "_by_session", "_orphans", "_quarantined", "writable")

    def __init__(self) -> None:
        self.writable: set[int] = set()
        """Writable leases that are not SETTLED (live, or quarantined)."""
        self._armed: dict[int, set[int]] = {}
        """Lease → serials of the sessions armed on it (never an empty set)."""
        self._by_session: dict[int, set[int]] = {}
        """Session serial → the leases it is armed on."""
        self._quarantined: dict[int, ReleaseReason] = {}
        """Quarantined lease → why it ended (its FreeBlocks says it again)."""
        self._orphans: dict[PeerId, set[int]] = {}
        """Transport peer → serials of its sessions the holder forgot without proof that
        they can write no more (a Hello of a new incarnation under that peer name): their
        leases stay armed until the transport reports the peer lost."""

    # ------------------------------------------------------------ queries

    def state(self, lease: int) -> WriteState:
        """The lease's write state (SETTLED once it left the fence, or if never writable)."""
        if lease not in self.writable:
            return _SETTLED
        if lease in self._quarantined:
            return _QUARANTINED
        return _ARMED if lease in self._armed else _OPEN

    def quarantined(self) -> int:
        """Leases ended with a writer still armed."""
        return len(self._quarantined)

    def armed_sessions(self) -> int:
        """Sessions armed on at least one lease (they are never evicted as idle)."""
        return len(self._by_session)

    def is_armed(self, serial: int) -> bool:
        """Whether session ``serial`` is armed on any lease (or orphaned armed)."""
        return serial in self._by_session

    # ------------------------------------------------------------ inputs

    def arm(self, lease: int, serial: int) -> None:
        """Session ``serial``'s claim of the live writable lease was accepted."""
        write_next(self.state(lease), WriteInput.ARM)  # raises if it ended
        self._armed.setdefault(lease, set()).add(serial)
        self._by_session.setdefault(serial, set()).add(lease)

    def disarm(self, lease: int, serial: int) -> ReleaseReason | None:
        """Session ``serial`` can write no more into ``lease``; the reason to free it with
        if that settled a quarantined lease, else None (also when it was not armed)."""
        sessions = self._armed.get(lease)
        if sessions is None or serial not in sessions:
            return None
        last = len(sessions) == 1
        new = write_next(self.state(lease), WriteInput.LAST_DISARM if last else WriteInput.DISARM)
        sessions.discard(serial)
        if last:
            del self._armed[lease]
        leases = self._by_session.get(serial)
        if leases is not None:
            leases.discard(lease)
            if not leases:
                del self._by_session[serial]
        if new is not _SETTLED:
            return None
        self.writable.discard(lease)
        return self._quarantined.pop(lease)

    def disarm_session(self, serial: int) -> list[tuple[int, ReleaseReason]]:
        """Session ``serial`` can write no more at all (its peer was lost): every lease
        this settled, with the reason to free it with."""
        settled = []
        for lease in sorted(self._by_session.get(serial, ())):
            reason = self.disarm(lease, serial)
            if reason is not None:
                settled.append((lease, reason))
        return settled

    def orphan(self, peer: PeerId, serial: int) -> None:
        """The holder forgot session ``serial`` of ``peer`` without proof that it can
        write no more: its leases stay armed until :meth:`peer_lost` for ``peer``."""
        if serial in self._by_session:
            self._orphans.setdefault(peer, set()).add(serial)

    def peer_lost(self, peer: PeerId) -> list[tuple[int, ReleaseReason]]:
        """The transport reported ``peer`` lost: disarm the sessions orphaned under it."""
        settled = []
        for serial in sorted(self._orphans.pop(peer, ())):
            settled.extend(self.disarm_session(serial))
        return settled

    def end(self, lease: int, reason: ReleaseReason) -> bool:
        """The writable lease ended with ``reason``: True if it is quarantined (a writer is
        still armed), False if it settled at once."""
        new = write_next(self.state(lease), WriteInput.END)
        if new is _QUARANTINED:
            self._quarantined[lease] = reason
            return True
        self.writable.discard(lease)
        return False


class Arms:
    """Answers a session's Arms: a writer about to write (push mode)."""

    def __init__(self, book: LeaseBook, claims: Claims) -> None:
        self._book = book
        self._claims = claims

    def on_arm(self, now: float, session: PeerSession, claim: wire.Claim) -> None:
        """Arm the writer if it may write (its session holds the live writable lease) and
        say so: it writes only on ``armed``."""
        book = self._book
        book.stats.arm_frames += 1
        (slot,) = self._claims.check(session, (claim,))
        table = book.leases
        ack = wire.ArmAck(lease=claim.lease, armed=False)
        if (
            slot is not None
            and claim.lease in book.fence.writable
            and not table.terminal(slot)
            and table.members.holds(slot, session.serial)
        ):
            book.fence.arm(claim.lease, session.serial)
            left = min(book.live_until(slot), table.hard[slot]) - now
            ack = wire.ArmAck(lease=claim.lease, armed=True, left=left)
        book.send_session(session, ack)
