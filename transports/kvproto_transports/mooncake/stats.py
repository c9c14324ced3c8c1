"""Counters of one MooncakeTransport endpoint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MooncakeStats:
    """What one endpoint did (a copy; see ``MooncakeTransport.stats``)."""

    notifications_sent: int = 0
    """Notifications accepted by ``send`` (read notifies not included)."""
    notifications_received: int = 0
    """Notifications delivered by ``poll``."""
    frames_dropped: int = 0
    """Messages received that were malformed or meant for another incarnation."""
    reads_started: int = 0
    """``read_blocks`` calls accepted."""
    reads_completed: int = 0
    """Reads that ended in ReadCompleted."""
    reads_failed: int = 0
    """Reads that ended in ReadFailed."""
    probes_sent: int = 0
    """``send_probe`` calls."""
    probes_failed: int = 0
    """``send_probe`` calls that did not return 0."""
    peers_lost: int = 0
    """PeerLost events reported."""
