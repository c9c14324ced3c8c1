"""Virtual time: per-node clocks (offset and drift) and engine step boundaries.

The simulator keeps one global time ``t`` (seconds). Each engine reads its own
clock, ``local = offset + (1 + drift_ppm * 1e-6) * t``, and every value handed
to a core (``now``) or received from it (timers, deadlines) is in that local
clock. Engines act only at *step boundaries*, as vLLM does: heartbeats are
sent, frames processed and reads issued between forward passes.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeClock:
    """One node's clock as a function of global time."""

    offset: float = 0.0
    """Local reading at global time 0, seconds (perf_counter epochs differ between hosts)."""
    drift_ppm: float = 0.0
    """Rate error in parts per million (positive runs fast)."""

    @property
    def rate(self) -> float:
        """Local seconds per global second."""
        return 1.0 + self.drift_ppm * 1e-6

    def local(self, t: float) -> float:
        """This node's reading at global time ``t``."""
        return self.offset + self.rate * t

    def to_global(self, local: float) -> float:
        """The earliest global time at which this clock reads at least ``local``.

        Rounding is corrected upwards so that a timer due at ``local`` really is
        due when the engine wakes at the returned time (otherwise a wake could
        find its timer a few ulps short and loop).
        """
        t = (local - self.offset) / self.rate
        while self.local(t) < local:
            t = math.nextafter(t, math.inf)
        return t


@dataclass(frozen=True, slots=True, kw_only=True)
class StepModel:
    """How long an engine's forward steps take."""

    step: float
    """Duration of an ordinary step, seconds."""
    slow_range: tuple[float, float] | None = None
    """If set, occasional slow steps take a duration drawn uniformly from this range."""
    slow_every: float = 30.0
    """Mean seconds of ordinary steps between two slow phases."""
    slow_burst: int = 2
    """Largest number of consecutive slow steps in one slow phase."""

    @property
    def max_step(self) -> float:
        """The longest step this model produces (the engine's "one tick")."""
        return self.step if self.slow_range is None else max(self.step, self.slow_range[1])


class StepClock:
    """Step boundaries of one engine, generated lazily from its own RNG.

    Steps come in segments of equal duration (a run of ordinary steps, or one
    slow step), so finding the first boundary at or after ``t`` is a binary
    search plus one division, whatever the step rate.
    """

    __slots__ = ("_counts", "_durs", "_model", "_rng", "_starts")

    def __init__(self, model: StepModel, rng: random.Random) -> None:
        self._model = model
        self._rng = rng
        self._starts: list[float] = [0.0]
        self._durs: list[float] = []
        self._counts: list[int] = []
        self._extend()

    def _extend(self) -> None:
        """Append the next segment(s)."""
        start = self._starts[-1]
        m = self._model
        if m.slow_range is None:
            self._durs.append(m.step)
            self._counts.append(1 << 40)
            self._starts.append(start + m.step * (1 << 40))
            return
        ordinary = max(1, math.ceil(self._rng.expovariate(1.0 / m.slow_every) / m.step))
        self._durs.append(m.step)
        self._counts.append(ordinary)
        start += m.step * ordinary
        self._starts.append(start)
        for _ in range(self._rng.randint(1, m.slow_burst)):
            slow = self._rng.uniform(*m.slow_range)
            self._durs.append(slow)
            self._counts.append(1)
            start += slow
            self._starts.append(start)

    def boundary(self, t: float) -> float:
        """The first step boundary at or after global time ``t``."""
        while self._starts[-1] < t:
            self._extend()
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= len(self._durs):
            i = len(self._durs) - 1
        start = self._starts[i]
        if t <= start:
            return start
        dur = self._durs[i]
        k = math.ceil((t - start) / dur)
        b = start + k * dur
        while b < t:  # rounding: a boundary must never come before t
            k += 1
            b = start + k * dur
        return min(b, self._starts[i + 1])
