"""Shared, cached simulator runs (each (scenario, policy, seed) is simulated once per session)."""

from __future__ import annotations

import functools

from kvproto_tools.sim import RunResult, Simulator


@functools.cache
def result(scenario: str, policy: str, seed: int = 0, liveness: bool = True) -> RunResult:
    """One run's result (liveness oracles on by default: they only add checks)."""
    return Simulator(scenario, policy, seed, liveness=liveness).run()


def fig(scenario: str, policy: str, key: str, seed: int = 0) -> float:
    """One figure of one run, as a number (None, for reclaim without a crash, is an error)."""
    value = result(scenario, policy, seed).metrics[key]
    assert value is not None, f"{scenario}/{policy}: {key} is undefined"
    return float(value)
