"""Oracle bookkeeping: the trace ring and the violations a run records.

The checks themselves live next to the events they watch
(:mod:`kvproto_tools.sim.checks`, :mod:`kvproto_tools.sim.flows`); this module
keeps what a failing seed must print: the kind of violation, when, what, and
the last events before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

TRACE_LEN = 60
"""Events kept for a violation's shortened trace."""
KEEP_TRACES = 3
"""Violations per run (and per mode) that keep their trace; the rest are only counted."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Violation:
    """One failed oracle."""

    mode: str
    """``"safety"`` or ``"liveness"``."""
    kind: str
    """Which invariant (S1..S4 safety, L1..L3 liveness; spec/simulator.md)."""
    time: float
    """Global time, seconds."""
    detail: str
    """What was observed."""
    trace: tuple[str, ...] = ()
    """The last events before it (empty beyond the first few violations of a run)."""


class Recorder:
    """The trace ring and the violation lists of one run."""

    __slots__ = ("liveness", "liveness_count", "safety", "safety_count", "trace")

    def __init__(self) -> None:
        self.trace: deque[tuple[float, str]] = deque(maxlen=TRACE_LEN)
        self.safety: list[Violation] = []
        self.liveness: list[Violation] = []
        self.safety_count = 0
        self.liveness_count = 0

    def note(self, t: float, text: str) -> None:
        """Add one event to the trace."""
        self.trace.append((t, text))

    def violate(self, mode: str, kind: str, t: float, detail: str) -> None:
        """Record a violation (with the trace, for the first few)."""
        kept = self.safety if mode == "safety" else self.liveness
        if mode == "safety":
            self.safety_count += 1
        else:
            self.liveness_count += 1
        trace = tuple(f"{when:11.4f}  {text}" for when, text in self.trace)
        keep_trace = len(kept) < KEEP_TRACES
        self.note(t, f"!! {kind}: {detail}")
        if len(kept) < 50:
            kept.append(
                Violation(
                    mode=mode,
                    kind=kind,
                    time=t,
                    detail=detail,
                    trace=trace if keep_trace else (),
                )
            )
