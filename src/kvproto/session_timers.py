"""When each of a reader's sessions next has work (a heartbeat, or a Hello again).

A heap of (time, session serial, push number, session). The time a session is
due lives in its ``beats.next_beat``; an entry whose time is no longer the
session's was rescheduled since and is skipped, so an idle step is one peek.
"""

from __future__ import annotations

import heapq
import itertools
import math

from kvproto.reader_session import Session


class SessionTimers:
    """The reader's session timers. See the module docstring."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Session]] = []
        self._pushes = itertools.count()

    def schedule(self, session: Session, at: float) -> None:
        """The session's timer is due at ``at`` (inf: none)."""
        beats = session.beats
        if at != beats.next_beat:
            beats.next_beat = at
            if at < math.inf:
                heapq.heappush(self._heap, (at, session.serial, next(self._pushes), session))

    def next_due(self) -> float:
        """The earliest time a session has work (inf: none)."""
        heap = self._heap
        while heap and heap[0][3].beats.next_beat != heap[0][0]:
            heapq.heappop(heap)  # rescheduled since
        return heap[0][0] if heap else math.inf

    def any_due(self, now: float) -> bool:
        """Whether an entry is due by ``now`` (it may be stale: :meth:`due` skips those)."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= now

    def due(self, now: float) -> list[Session]:
        """Sessions whose timer is due, in creation order (as a scan of all would serve them)."""
        heap = self._heap
        due: dict[int, Session] = {}
        while heap and heap[0][0] <= now:
            at, serial, _, session = heapq.heappop(heap)
            if session.beats.next_beat == at:
                due[serial] = session
        return [due[serial] for serial in sorted(due)]
