"""Timing discipline: warm-ups, batches, several repetitions, medians, interleaved pairs.

Absolute times drift on a shared 2-core machine; ratios measured in one
process with the two sides interleaved (A, B, A, B, ...) drift far less,
because a slow stretch of the machine hits both sides alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

Op = Callable[[], object]


def _batch_ns(op: Op, batch: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(batch):
        op()
    return (time.perf_counter_ns() - start) / batch


def median_ns(op: Op, *, batch: int, repeats: int, warmup: int = 1) -> float:
    """Median over ``repeats`` of the mean per-call time of ``batch`` calls, in ns."""
    for _ in range(warmup):
        _batch_ns(op, batch)
    return statistics.median(_batch_ns(op, batch) for _ in range(repeats))


def paired_ns(
    ours: Op,
    anchor: Op,
    *,
    batch: int,
    anchor_batch: int | None = None,
    repeats: int,
    warmup: int = 1,
) -> tuple[float, float]:
    """Medians (ns per call) of ``ours`` and ``anchor``, repetitions interleaved."""
    b_anchor = batch if anchor_batch is None else anchor_batch
    for _ in range(warmup):
        _batch_ns(ours, batch)
        _batch_ns(anchor, b_anchor)
    a_samples: list[float] = []
    b_samples: list[float] = []
    for _ in range(repeats):
        a_samples.append(_batch_ns(ours, batch))
        b_samples.append(_batch_ns(anchor, b_anchor))
    return statistics.median(a_samples), statistics.median(b_samples)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile ``q`` (0..1) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


@contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect, then freeze what exists, so timed loops are not charged for old objects.

    Both sides of a comparison run under the same regime. The cost of a full
    collection over the live leases is measured separately (``gc.full_collect``).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def no_gc() -> Iterator[None]:
    """Disable the cyclic collector while building large fixtures (it is superlinear there)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Budget:
    """Wall-clock budget of one run, so optional large sizes are skipped instead of overrunning."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._start = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self._start

    def left(self) -> float:
        """Seconds left."""
        return self.seconds - self.elapsed()
