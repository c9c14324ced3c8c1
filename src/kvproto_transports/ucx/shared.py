"""State shared between the API threads and the engine thread, and the commands between them.

The API side (any thread) validates, then queues a command; the engine
thread carries commands out and appends events. Only what both sides must
see lives here, each piece guarded by one lock or an atomic deque operation.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

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
    peers_lost: int = 0
    """``PeerLost`` reported."""


class Shared:
    """Events out, peer-loss marks and the send budget; safe from any thread."""

    def __init__(self, max_pending_sends: int) -> None:
        self.events: deque[TransportEvent] = deque()
        """Appended by the engine, drained by ``poll`` (deque ops are atomic)."""
        self.stats = UcxStats()
        """Written by the engine under :attr:`lock`."""
        self.lock = threading.Lock()
        self.failed: str | None = None
        """Set by the engine if its thread died: the endpoint can do nothing more."""
        self._lost: dict[PeerId, str] = {}
        self._pending_sends = 0
        self._max_pending = max_pending_sends

    def fail(self, reason: str) -> None:
        """Engine: its thread is ending abnormally."""
        with self.lock:
            self.failed = reason

    def lost_reason(self, peer: PeerId) -> str | None:
        """Why ``peer`` was reported lost, or None."""
        with self.lock:
            return self._lost.get(peer)

    def mark_lost(self, peer: PeerId, reason: str) -> None:
        """Engine: ``peer`` was reported lost; sends to it now raise PeerUnreachable."""
        with self.lock:
            self._lost[peer] = reason

    def clear_lost(self, peer: PeerId) -> None:
        """API: the peer was added again (or removed); forget the loss."""
        with self.lock:
            self._lost.pop(peer, None)

    def take_send_slot(self) -> bool:
        """API: reserve room for one more queued send; False when the budget is spent."""
        with self.lock:
            if self._pending_sends >= self._max_pending:
                return False
            self._pending_sends += 1
            return True

    def release_send_slot(self) -> None:
        """Engine: a send left the queue (sent, failed or dropped)."""
        with self.lock:
            self._pending_sends -= 1


# --- commands: API thread -> engine thread ----------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    """Open (or reopen) the connection to an added peer."""

    peer: PeerId
    address: bytes
    rkeys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Refresh:
    """The peer's metadata grew (it registered memory after we added it): new remote keys."""

    peer: PeerId
    rkeys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Disconnect:
    """``remove_peer``: close our endpoint to it, fail its reads, report nothing."""

    peer: PeerId


@dataclass(frozen=True, slots=True)
class Send:
    """One notification, counted against the send budget."""

    peer: PeerId
    payload: bytes


@dataclass(slots=True)
class ReadOp:
    """A read: validated segments, then UCP requests in flight."""

    read_id: ReadId
    peer: PeerId
    segments: list[Segment]
    notify: bytes | None
    requests: list[int] = field(default_factory=list)
    """UCP request handles still in flight."""
    failed: str | None = None
    """Why the read will end in ReadFailed (set at the first error)."""
    fail_by: float = 0.0
    """Engine clock: report the failure by then even if UCX has not released every request."""


@dataclass(frozen=True, slots=True)
class Read:
    """Issue a read."""

    op: ReadOp


@dataclass(frozen=True, slots=True)
class Register:
    """Map local memory; the future gets the packed remote keys, one per region."""

    layout: BlockLayout
    result: Future[tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class Stop:
    """Tear everything down and end the thread."""


Command = Connect | Refresh | Disconnect | Send | Read | Register | Stop
