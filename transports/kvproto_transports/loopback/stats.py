"""Traffic counters, kept per network and per endpoint incarnation."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopbackStats:
    """A snapshot of traffic counters."""

    notifications_sent: int
    """Notifications accepted by ``send`` (and read notifies put on the wire)."""
    delivered: int
    """Notifications put in a receiver's inbox, duplicates included."""
    dropped: int
    """Notifications lost: the ``drop`` fault, a partition, or a dead receiver."""
    duplicated: int
    """Extra copies created by the ``duplicate`` fault."""
    reordered: int
    """Notifications held back by the ``reorder`` fault."""
    reads_started: int
    """Calls to ``read_blocks`` that returned a read id."""
    reads_completed: int
    """Reads whose data was copied (ReadCompleted)."""
    reads_failed: int
    """Reads that ended in ReadFailed."""
    peers_lost: int
    """PeerLost events reported."""


@dataclass(slots=True)
class Counters:
    """The mutable counters behind :class:`LoopbackStats`."""

    notifications_sent: int = 0
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    reads_started: int = 0
    reads_completed: int = 0
    reads_failed: int = 0
    peers_lost: int = 0

    def snapshot(self) -> LoopbackStats:
        """Freeze the current values."""
        return LoopbackStats(**asdict(self))
