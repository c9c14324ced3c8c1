"""Virtual clocks and step boundaries."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvproto_tools.sim.clock import NodeClock, StepClock, StepModel


@given(
    offset=st.floats(-1e5, 1e5),
    drift=st.floats(-500, 500),
    local=st.floats(-1e5, 1e5),
)
def test_to_global_is_the_first_instant_the_clock_reads_local(
    offset: float, drift: float, local: float
) -> None:
    clock = NodeClock(offset=offset, drift_ppm=drift)
    t = clock.to_global(local)
    assert clock.local(t) >= local
    assert abs(t - (local - offset) / clock.rate) < 1e-6


def test_offset_and_drift() -> None:
    clock = NodeClock(offset=3600.0, drift_ppm=200.0)
    assert clock.local(0.0) == 3600.0
    assert abs(clock.local(1000.0) - 3600.0 - 1000.2) < 1e-9


@given(ts=st.lists(st.floats(0, 5000), min_size=1, max_size=50), seed=st.integers(0, 1000))
def test_boundaries_are_never_early_and_never_skip(ts: list[float], seed: int) -> None:
    steps = StepClock(StepModel(step=0.04, slow_range=(1.0, 20.0)), random.Random(seed))
    for t in ts:  # any query order: a far query must not hide nearer boundaries
        b = steps.boundary(t)
        assert b >= t
        assert b - t <= 20.0 + 1e-9


def test_ordinary_steps_are_a_grid() -> None:
    steps = StepClock(StepModel(step=0.04), random.Random(0))
    assert steps.boundary(11.28) == 11.28 or abs(steps.boundary(11.28) - 11.28) < 1e-9
    assert steps.boundary(11.2800001) > 11.28
    assert StepModel(step=0.04, slow_range=(1.0, 20.0)).max_step == 20.0
