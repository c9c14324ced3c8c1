"""State shared between the API threads and the engine, and the commands between them.

The API side (any thread) validates, then queues a command; whichever thread
holds the engine's mutex carries commands out and appends events. Only what
both sides must see lives here, and no piece of it takes a lock: each value
has one writer per side and is read or written in single operations (a
deque append or pop, a dict get, set or pop, an int read), which are atomic
in CPython, free-threaded builds included.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from kvproto.tpmath import BlockLayout
from kvproto.transport import PeerId, ReadId, TransportEvent

from .plan import Segment


@dataclass(slots=True)
class UcxStats:
    """Counters of one endpoint; :attr:`UcxTransport.stats` returns a copy."""

    notifications_sent: int = 0
    """Notifications handed to UCX (read notifies included)."""
    notifications_received: int = 0
    """Notifications reported as ``Received``."""
    send_failures: int = 0
    """Sends UCX completed with an error."""
    hellos_received: int = 0
    """Peers that connected and said who they are."""
    hellos_refused: int = 0
    """HELLOs meant for another incarnation, or unreadable: their sender stays unknown."""
    frames_dropped: int = 0
    """Frames of an unknown kind, or notifications from a sender that never said HELLO."""
    reads_started: int = 0
    """Reads issued (zero-block reads included)."""
    reads_completed: int = 0
    """``ReadCompleted`` reported."""
    reads_failed: int = 0
    """``ReadFailed`` reported."""
    gets_issued: int = 0
    """UCP ``get`` operations (after merging contiguous segments)."""
    writes_started: int = 0
    """Writes issued (push mode; zero-block writes included)."""
    writes_completed: int = 0
    """``WriteCompleted`` reported."""
    writes_failed: int = 0
    """``WriteFailed`` reported."""
    puts_issued: int = 0
    """UCP ``put`` operations (after merging contiguous segments)."""
    peers_lost: int = 0
    """``PeerLost`` reported."""


class Shared:
    """Events out, the failure and peer-loss marks and the send budget."""

    def __init__(self, max_pending_sends: int) -> None:
        self.events: deque[TransportEvent] = deque()
        """Appended by the engine, drained by ``poll``."""
        self.stats = UcxStats()
        """Written only by the thread holding the engine's mutex; read under it too
        (:meth:`~.engine.Engine.stats`), so a copy is never half of a step."""
        self.failed: str | None = None
        """Set by the engine if its thread died: the endpoint can do nothing more."""
        self._lost: dict[PeerId, str] = {}
        self._max_pending = max_pending_sends
        # The send budget as two counters, one writer each, instead of one
        # count behind a lock that every send and every reaped send took:
        # queued + in flight = taken - released.
        self._sends_taken = 0
        """API side, under the transport's lock."""
        self._sends_released = 0
        """Engine side, under its mutex."""

    def fail(self, reason: str) -> None:
        """Engine: its thread is ending abnormally."""
        self.failed = reason

    def lost_reason(self, peer: PeerId) -> str | None:
        """Why ``peer`` was reported lost, or None."""
        return self._lost.get(peer)

    def mark_lost(self, peer: PeerId, reason: str) -> None:
        """Engine: ``peer`` was reported lost; sends to it now raise PeerUnreachable."""
        self._lost[peer] = reason

    def clear_lost(self, peer: PeerId) -> None:
        """API: the peer was added again (or removed); forget the loss."""
        self._lost.pop(peer, None)

    def take_send_slot(self) -> bool:
        """API, under the transport's lock: reserve room for one more queued send;
        False when the budget is spent (a release the engine is making meanwhile
        is seen by the next call)."""
        if self._sends_taken - self._sends_released >= self._max_pending:
            return False
        self._sends_taken += 1
        return True

    def release_send_slot(self) -> None:
        """Engine, under its mutex: a send left the queue (sent, failed or dropped)."""
        self._sends_released += 1


# --- commands: API thread -> engine ------------------------------------------
# msgspec Structs: a send builds one per call, ~0.07 us where a frozen slotted
# dataclass took ~0.8 us (its __init__ sets each field through object.__setattr__).


class AddPeer(msgspec.Struct, frozen=True, kw_only=True):
    """``add_peer``: open (or reopen) the connection to the peer."""

    peer: PeerId
    """The added peer."""
    address: bytes
    """Its UCX worker address, from its metadata."""
    rkeys: tuple[bytes, ...]
    """Its packed remote keys, one per region (empty: nothing registered)."""


class Refresh(msgspec.Struct, frozen=True, kw_only=True):
    """The peer's metadata grew (it registered memory after we added it): new remote keys."""

    peer: PeerId
    """The added peer."""
    rkeys: tuple[bytes, ...]
    """Its packed remote keys now."""


class RemovePeer(msgspec.Struct, frozen=True, kw_only=True):
    """``remove_peer``: close our endpoint to it, fail its reads, report nothing."""

    peer: PeerId
    """The removed peer."""


class Send(msgspec.Struct, frozen=True, kw_only=True):
    """One notification, counted against the send budget."""

    peer: PeerId
    """Whom to send to."""
    payload: bytes
    """The exact bytes."""


@dataclass(slots=True)
class ReadOp:
    """A read (or a write): validated segments, then UCP requests in flight."""

    read_id: ReadId
    peer: PeerId
    segments: list[Segment]
    notify: bytes | None
    requests: list[int] = field(default_factory=list)
    """UCP request handles still in flight."""
    failed: str | None = None
    """Why the read will end in ReadFailed (set at the first error)."""
    fail_by: float = 0.0
    """Engine clock: report the failure by then even if UCX has not released every request
    (a read only: a write is reported failed once UCX released every request of it)."""
    write: bool = False
    """A WRITE (push mode): ``put`` per segment, then an endpoint flush (remote completion),
    then the notify."""


class Read(msgspec.Struct, frozen=True, kw_only=True):
    """Issue a read."""

    op: ReadOp
    """The validated read."""


class Register(msgspec.Struct, frozen=True, kw_only=True):
    """Map local memory; the future gets the packed remote keys, one per region."""

    layout: BlockLayout
    """What to map."""
    result: Future[tuple[bytes, ...]]
    """Set by the engine: the keys, or RegistrationError."""


class Stop(msgspec.Struct, frozen=True):
    """Tear everything down and end the thread."""


Command = AddPeer | Refresh | RemovePeer | Send | Read | Register | Stop
