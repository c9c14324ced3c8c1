"""The simulator's clock and scheduler: global virtual time and the heap of what is due.

The loopback network keeps its own queue (frames, read completions, loss
reports); :class:`Agenda` holds everything else that happens at a known time
(arrivals, step boundaries, faults, handshakes, oracle deadlines). The event
loop in :mod:`kvproto_tools.sim.engine` merges the two in time order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class Agenda:
    """Global virtual time ``t`` and the callbacks due at later times (FIFO among equal times)."""

    __slots__ = ("_heap", "_seq", "t")

    def __init__(self) -> None:
        self.t = 0.0
        """Global virtual time, seconds (set by the event loop only)."""
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fire: Callable[[], None]) -> None:
        """Run ``fire`` at global time ``t``."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fire))

    def next_time(self) -> float:
        """When the earliest callback is due (infinity when none is)."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def pop(self) -> Callable[[], None]:
        """Remove and return the earliest callback."""
        return heapq.heappop(self._heap)[2]
