"""Whether a figure grows over a run: its slope, with a 95 % confidence interval.

Samples a quarter of a second apart are far from independent (memory moves
in steps, gauges follow the load), so the slope is fitted to block means: the
series is cut into :data:`BLOCKS` equal stretches of time, each stretch
averaged, and an ordinary least-squares line fitted to those means; the
interval is Student's t at ``n - 2`` degrees of freedom on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import msgspec

BLOCKS = 20
"""Stretches a series is averaged over before the fit."""
MIN_BLOCKS = 8
"""Fewer non-empty stretches than this and no slope is given (too short a series)."""


class Slope(msgspec.Struct, frozen=True, kw_only=True):
    """A fitted slope, per minute."""

    per_min: float
    """The slope, units per minute."""
    half_width: float
    """Half the 95 % confidence interval, units per minute."""
    mean: float
    """The series' mean (to read the slope against)."""
    span_s: float
    """Seconds the series covers."""
    blocks: int
    """Block means the line was fitted to."""

    @property
    def low(self) -> float:
        """The interval's lower end."""
        return self.per_min - self.half_width

    @property
    def high(self) -> float:
        """The interval's upper end."""
        return self.per_min + self.half_width


def t_975(df: int) -> float:
    """Student's t 97.5 % quantile (Cornish-Fisher expansion: within 1 % from 6 df on)."""
    z = NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def slope(points: Sequence[tuple[float, float]]) -> Slope | None:
    """The slope of ``(t seconds, value)`` points, or None for too short a series."""
    if len(points) < MIN_BLOCKS:
        return None
    t0, t1 = points[0][0], points[-1][0]
    if t1 <= t0:
        return None
    width = (t1 - t0) / BLOCKS
    sums = [[0.0, 0.0, 0] for _ in range(BLOCKS)]
    for t, v in points:
        block = sums[min(BLOCKS - 1, int((t - t0) / width))]
        block[0] += t
        block[1] += v
        block[2] += 1
    means = [(st / k, sv / k) for st, sv, k in sums if k]
    n = len(means)
    if n < MIN_BLOCKS:
        return None
    tm = sum(t for t, _ in means) / n
    vm = sum(v for _, v in means) / n
    sxx = sum((t - tm) ** 2 for t, _ in means)
    b = sum((t - tm) * (v - vm) for t, v in means) / sxx
    residual = sum((v - vm - b * (t - tm)) ** 2 for t, v in means)
    stderr = math.sqrt(residual / (n - 2) / sxx)
    return Slope(
        per_min=b * 60.0,
        half_width=t_975(n - 2) * stderr * 60.0,
        mean=sum(v for _, v in points) / len(points),
        span_s=t1 - t0,
        blocks=n,
    )
