"""What one run measures: sizes, repetitions and batch lengths for the full and quick runs.

The figure *names* are the same in both; only sizes and repetitions shrink,
so a quick run is a faithful smoke test of the full one.
"""

from __future__ import annotations

from dataclasses import dataclass

LARGE = 100_000
"""Sizes above this get fewer repetitions (:meth:`Plan.repeats_for`)."""

FULL_BUDGET_S = 250.0
"""The full run must end within 5 minutes; optional sizes are skipped past this."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Sizes and timing parameters of one run."""

    quick: bool
    """Tiny sizes for smoke tests."""
    holder_sizes: tuple[int, ...]
    """Live leases for the holder figures (also the scaling curve's points)."""
    scaling_extra: tuple[int, ...]
    """Further scaling points, run only if the budget allows."""
    reader_sizes: tuple[int, ...]
    """Waiting requests for the reader figures."""
    reader_engines: tuple[int, ...]
    """Holder engines the waiting requests are spread over."""
    memory_size: int
    """Live leases for the tracemalloc figure."""
    repeats: int
    """Timed repetitions per figure (the median is reported)."""
    fast_batch: int
    """Calls per repetition for sub-microsecond-to-microsecond operations."""
    fast_repeats: int
    """Repetitions where both sides are fast (many cheap samples resist noise bursts)."""
    hb_batch: int
    """Calls per repetition for heartbeat applies and reader ticks."""
    anchor_calls_per_rep: int
    """Anchor work per repetition, in lease-operations (batch = this // size)."""
    loopback_rounds: int
    """Round trips per repetition for the loopback transport figures."""
    external_iterations: int
    """``iterations`` passed to the NIXL/UCX ``measure_overhead()`` (where it takes one)."""
    budget_s: float
    """Wall-clock budget of the whole run."""

    def repeats_for(self, n: int) -> int:
        """Fewer repetitions past 100k, where one anchor call takes a second or more."""
        return self.repeats if n <= LARGE else max(3, self.repeats // 2)

    def anchor_batch(self, n: int) -> int:
        """Calls per repetition for an anchor operation that is O(n)."""
        return max(1, self.anchor_calls_per_rep // max(1, n))


FULL = Plan(
    quick=False,
    holder_sizes=(1_000, 10_000, 100_000),
    scaling_extra=(1_000_000,),
    reader_sizes=(1_000, 10_000),
    reader_engines=(1, 8, 64),
    memory_size=100_000,
    repeats=7,
    fast_batch=1_000,
    fast_repeats=21,
    hb_batch=200,
    anchor_calls_per_rep=40_000,
    loopback_rounds=200,
    external_iterations=200,
    budget_s=FULL_BUDGET_S,
)

QUICK = Plan(
    quick=True,
    holder_sizes=(100, 1_000),
    scaling_extra=(),
    reader_sizes=(128,),
    reader_engines=(1, 8, 64),
    memory_size=1_000,
    repeats=3,
    fast_batch=200,
    fast_repeats=5,
    hb_batch=20,
    anchor_calls_per_rep=2_000,
    loopback_rounds=20,
    external_iterations=10,
    budget_s=60.0,
)
