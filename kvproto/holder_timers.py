"""The holder's lease deadlines: a min-queue of (due, lease id) without an object per entry.

A heap of ``(float, int)`` tuples costs ~100 B an entry (the tuple, a boxed
float and a boxed int), and a holder keeps one entry per live lease. But the
deadlines a holder schedules come in a few rising sequences: grants at the
default TTL, hard deadlines (grant + max_hold) re-scheduled in grant order,
session fall-backs. So the queue keeps a few *lanes*, each a pair of arrays
(16 B an entry) sorted by ``(due, lease id)``: an entry joins the lane whose
last entry it follows most closely, and only an entry that follows none goes
to a small fallback heap.

Entries leave in exactly the order of one heap holding them all, ties broken
by lease id, so moving the holder from a heap to this queue changes no output
order.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_right

LANES = 4
"""Sorted lanes kept; more rising sequences than this spill into the heap."""
_COMPACT_AT = 4096
"""A lane drops its consumed head once it is this long and half consumed."""


class _Lane:
    __slots__ = ("dues", "head", "ids")

    def __init__(self) -> None:
        self.dues = array("d")
        """Empty once consumed to the end (:meth:`take_until` clears it)."""
        self.ids = array("Q")
        self.head = 0
        """Entries before ``head`` have left the queue."""

    def take_until(self, now: float) -> list[tuple[float, int]]:
        """Remove and return the entries due by ``now`` (in order)."""
        head = self.head
        stop = bisect_right(self.dues, now, head)
        taken = list(zip(self.dues[head:stop], self.ids[head:stop], strict=True))
        self.head = stop
        if stop == len(self.dues):
            del self.dues[:], self.ids[:]
            self.head = 0
        elif stop >= _COMPACT_AT and 2 * stop >= len(self.dues):
            del self.dues[:stop], self.ids[:stop]
            self.head = 0
        return taken


class DeadlineQueue:
    """(due, lease id) entries; :meth:`take_due` returns those due, smallest first."""

    __slots__ = ("_heap", "_lanes", "_recent", "soonest")

    def __init__(self) -> None:
        self._lanes = tuple(_Lane() for _ in range(LANES))
        self._heap: list[tuple[float, int]] = []
        self._recent = self._lanes[0]
        """The lane of the last push: the next one usually follows it (grants in a row)."""
        self.soonest = math.inf
        """The smallest due; inf when empty. A plain attribute: an idle holder's timer
        calls read it and stop, without a call into the queue."""

    def push(self, due: float, lease_id: int) -> None:
        """Add an entry (duplicates are the caller's to skip when they come out)."""
        soonest = self.soonest
        self.soonest = due if due < soonest else soonest  # min without the call
        recent = self._recent
        dues = recent.dues
        if dues:
            tail = dues[-1]  # read once: each read of an array boxes a new float
            if due > tail or (due == tail and lease_id >= recent.ids[-1]):
                dues.append(due)
                recent.ids.append(lease_id)
                return
        entry = (due, lease_id)
        best: _Lane | None = None
        best_last: tuple[float, int] | None = None
        spare: _Lane | None = None
        for lane in self._lanes:
            if not lane.dues:
                spare = spare or lane
                continue
            last = (lane.dues[-1], lane.ids[-1])
            if last <= entry and (best_last is None or last > best_last):
                best, best_last = lane, last
        chosen = best or spare
        if chosen is None:
            heapq.heappush(self._heap, entry)
            return
        chosen.dues.append(due)
        chosen.ids.append(lease_id)
        self._recent = chosen

    def take_due(self, now: float) -> list[tuple[float, int]]:
        """Remove and return every entry due by ``now``, in (due, lease id) order."""
        if self.soonest > now:
            return []
        runs = [
            lane.take_until(now)
            for lane in self._lanes
            if lane.dues and lane.dues[lane.head] <= now
        ]
        heap = self._heap
        if heap and heap[0][0] <= now:
            run = []
            while heap and heap[0][0] <= now:
                run.append(heapq.heappop(heap))
            runs.append(run)
        dues = [lane.dues[lane.head] for lane in self._lanes if lane.dues]
        if heap:
            dues.append(heap[0][0])
        self.soonest = min(dues) if dues else math.inf
        if len(runs) == 1:
            return runs[0]
        # Sorted runs: the sort merges them (Timsort finds the runs).
        return sorted(entry for run in runs for entry in run)

    def __len__(self) -> int:
        return sum(len(lane.dues) - lane.head for lane in self._lanes) + len(self._heap)
