"""The side channel's circuit breaker, with explicit times."""

from __future__ import annotations

import pytest

from kvproto_binding.sidechannel import CircuitBreaker


def test_opens_after_threshold_then_lets_one_trial_through() -> None:
    b = CircuitBreaker(threshold=2, cooldown_s=1.0, max_cooldown_s=3.0)
    assert b.allow(0.0) is None
    b.failure(0.0)
    assert b.allow(0.1) is None  # one failure: still closed
    b.failure(0.1)
    assert b.allow(0.5) == pytest.approx(0.6)  # open until 1.1
    assert b.allow(1.2) is None  # half-open trial
    assert b.allow(1.2) is not None  # only one trial at a time
    b.failure(1.3)  # the trial failed: open twice as long
    assert b.allow(3.2) is not None
    assert b.allow(3.4) is None
    b.failure(3.4)
    assert b.current_cooldown_s == 3.0  # capped
    assert b.allow(6.5) is None
    b.success()
    assert b.allow(6.5) is None and b.failures == 0 and b.open_until is None
