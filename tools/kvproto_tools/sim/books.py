"""The books of one run: figures, counters, the trace, the oracles' violations.

Flows and oracles write here; :meth:`kvproto_tools.sim.engine.Simulator.run`
reads it back into a :class:`~kvproto_tools.sim.engine.RunResult`. The open
counters tell the event loop when a run is over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvproto_tools.sim.model import Metrics
from kvproto_tools.sim.oracles import Recorder

if TYPE_CHECKING:
    from kvproto_tools.sim.agenda import Agenda
    from kvproto_tools.sim.model import Hold

EXTRA_KEYS = (
    "requests",
    "used",
    "recomputed",
    "corrupted",
    "lost",
    "dropped",
    "turn2",
    "handshakes",
    "handshakes_failed",
)
"""The counters every run reports in ``RunResult.extra`` (more are added at the end)."""


class Books:
    """What one run recorded so far (all times global)."""

    __slots__ = (
        "clock",
        "crash_holds",
        "crash_time",
        "drops",
        "ended",
        "extra",
        "faults_pending",
        "held_blocks",
        "metrics",
        "open_holds",
        "open_requests",
        "rec",
        "record_timeline",
        "timeline",
    )

    def __init__(self, clock: Agenda, *, record_timeline: bool, hold_log: bool = False) -> None:
        self.clock = clock
        self.metrics = Metrics()
        """The figures (JSON ``metrics``)."""
        self.rec = Recorder()
        """The trace ring and the violations."""
        self.extra: dict[str, float | int] = dict.fromkeys(EXTRA_KEYS, 0)
        """Further counters for people (``RunResult.extra``)."""
        self.open_requests = 0
        """Requests not resolved yet (the run is over when all three open counts are 0)."""
        self.open_holds = 0
        """Holds not ended yet."""
        self.faults_pending = 0
        """Scheduled faults that have not happened yet."""
        self.held_blocks = 0
        """Blocks held by holders now."""
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        """(time, held blocks) at every change, when recorded."""
        self.crash_time: float | None = None
        """When the reader crash of the scenario happened (reclaim_s)."""
        self.crash_holds: list[Hold] = []
        """The holds the crashed reader was going to read (reclaim_s)."""
        self.drops: list[tuple[float, Hold]] = []
        """(when, hold) of every request the router dropped before its reader (reclaim_s)."""
        self.ended: list[Hold] | None = [] if hold_log else None
        """Every hold that ended, in order, when kept (``Simulator(hold_log=True)``)."""

    def note(self, text: str) -> None:
        """Add an event to the trace ring."""
        self.rec.note(self.clock.t, text)

    def violate(self, mode: str, kind: str, detail: str) -> None:
        """Record a failed oracle."""
        if mode == "safety":
            self.metrics.safety_violations += 1
        self.rec.violate(mode, kind, self.clock.t, detail)

    def held(self, delta: int) -> None:
        """Blocks held by holders changed by ``delta`` (the plotted timeline)."""
        self.held_blocks += delta
        if self.record_timeline:
            self.timeline.append((self.clock.t, self.held_blocks))
