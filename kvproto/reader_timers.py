"""When each of the reader's sessions next has timer work: its heartbeat, or a re-Hello.

A session's own time is ``session.beats.next_beat`` (inf: none). This module
keeps the sessions in one bucket per time, and the bucket times in a heap,
with lazy deletion: an entry whose time is no longer its session's is skipped
when it is reached. Sessions beaten together are re-scheduled together (one
interval on), so in the steady state a tick costs one heap operation and an
append per session, not a heap operation per session; finding the earliest
time stays O(1) amortised. It is apart from the reader because it is pure
bookkeeping of times; what a due session does (heartbeat, re-Hello, nothing)
is :mod:`kvproto.reader_peers`' decision. The reader does not ask it on an idle step: it
keeps :meth:`Reader.get_timer`'s last answer until an input comes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from kvproto.reader_session import Session

_NEVER = math.inf


class SessionTimers:
    """The sessions' next times, earliest first."""

    def __init__(self) -> None:
        self._times: list[float] = []
        """Heap of the times that have a bucket."""
        self._buckets: dict[float, deque[Session]] = {}
        """Time → the sessions scheduled at it, in scheduling order; a session whose
        ``next_beat`` is no longer that time was re-scheduled since and is skipped."""

    def schedule(self, session: Session, at: float) -> None:
        """The session's timer is due at ``at`` (inf: none)."""
        beats = session.beats
        if at != beats.next_beat:
            beats.next_beat = at
            if at < _NEVER:
                bucket = self._buckets.get(at)
                if bucket is None:
                    heapq.heappush(self._times, at)
                    bucket = self._buckets[at] = deque()
                bucket.append(session)

    def next_due(self) -> float:
        """The earliest time a session's timer is due (inf: none)."""
        times, buckets = self._times, self._buckets
        while times:
            at = times[0]
            bucket = buckets[at]
            while bucket and bucket[0].beats.next_beat != at:
                bucket.popleft()  # re-scheduled since
            if bucket:
                return at
            heapq.heappop(times)
            del buckets[at]
        return _NEVER

    def due(self, now: float) -> list[Session]:
        """The sessions due by ``now``, in creation order (as a scan of all would serve them)."""
        times, buckets = self._times, self._buckets
        due: dict[int, Session] = {}
        while times and times[0] <= now:
            at = heapq.heappop(times)
            for session in buckets.pop(at):
                if session.beats.next_beat == at:
                    due[session.serial] = session
        return [due[serial] for serial in sorted(due)]
