"""Slopes with their 95 % interval, as the chaos report prints them."""

from __future__ import annotations

import random

import pytest

from kvproto_tools.chaos.trends import MIN_BLOCKS, slope, t_975


@pytest.mark.parametrize(("df", "exact"), [(6, 2.4469), (10, 2.2281), (18, 2.1009), (30, 2.0423)])
def test_t_quantile_within_one_percent_from_six_degrees_of_freedom(df: int, exact: float) -> None:
    assert t_975(df) == pytest.approx(exact, rel=0.01)


def test_a_noisy_line_s_interval_holds_its_slope_and_a_flat_one_holds_zero() -> None:
    rng = random.Random(5)
    rising = [(t, 100.0 + 3.0 * t / 60.0 + rng.gauss(0, 2.0)) for t in range(0, 1800, 2)]
    fit = slope(rising)
    assert fit is not None and fit.low < 3.0 < fit.high and fit.low > 0
    flat = [(t, 100.0 + rng.gauss(0, 2.0)) for t in range(0, 1800, 2)]
    fit = slope(flat)
    assert fit is not None and fit.low < 0.0 < fit.high
    assert fit.span_s == 1798 and fit.blocks == 20 and fit.mean == pytest.approx(100.0, abs=0.5)


def test_too_short_a_series_has_no_slope() -> None:
    assert slope([(float(t), 1.0) for t in range(MIN_BLOCKS - 1)]) is None
    assert slope([(5.0, 1.0)] * 20) is None  # no time spanned
