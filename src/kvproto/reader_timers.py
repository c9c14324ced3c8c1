"""When each of the reader's sessions next has timer work: its heartbeat, or a re-Hello.

A session's own time is ``session.beats.next_beat`` (inf: none). This module
keeps those times in one heap with lazy deletion, so that re-scheduling a
session costs O(log n) and finding the earliest time O(1) however many
sessions there are: an entry whose time is no longer its session's is skipped
when it reaches the top. It is apart from the reader because it is pure
bookkeeping of times; what a due session does (heartbeat, re-Hello, nothing)
is the reader's decision. The reader does not ask it on an idle step: it
keeps :meth:`Reader.get_timer`'s last answer until an input comes.
"""

from __future__ import annotations

import heapq
import itertools
import math

from kvproto.reader_session import Session


class SessionTimers:
    """The sessions' next times, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Session]] = []
        """(time, session serial, push number, session); an entry whose time is no longer
        the session's ``next_beat`` was re-scheduled since and is skipped."""
        self._pushes = itertools.count()

    def schedule(self, session: Session, at: float) -> None:
        """The session's timer is due at ``at`` (inf: none)."""
        beats = session.beats
        if at != beats.next_beat:
            beats.next_beat = at
            if at < math.inf:
                heapq.heappush(self._heap, (at, session.serial, next(self._pushes), session))

    def next_due(self) -> float:
        """The earliest time a session's timer is due (inf: none)."""
        heap = self._heap
        while heap and heap[0][3].beats.next_beat != heap[0][0]:
            heapq.heappop(heap)  # re-scheduled since
        return heap[0][0] if heap else math.inf

    def due(self, now: float) -> list[Session]:
        """The sessions due by ``now``, in creation order (as a scan of all would serve them)."""
        heap = self._heap
        due: dict[int, Session] = {}
        while heap and heap[0][0] <= now:
            at, serial, _, session = heapq.heappop(heap)
            if session.beats.next_beat == at:
                due[serial] = session
        return [due[serial] for serial in sorted(due)]
