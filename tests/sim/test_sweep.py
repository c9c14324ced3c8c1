"""The CI sweep: 200 seeds across the fault scenarios, kvproto, safety and liveness oracles on."""

from __future__ import annotations

import os

import pytest

from kvproto_tools.sim import FAULT_SCENARIOS
from kvproto_tools.sim.sweep import Task, sweep

SEEDS = 200


@pytest.mark.slow
def test_200_seeds_across_fault_scenarios_without_a_violation() -> None:
    tasks = [
        Task(
            scenario=FAULT_SCENARIOS[i % len(FAULT_SCENARIOS)],
            policy="kvproto",
            seed=10_000 + i,
            liveness=True,
        )
        for i in range(SEEDS)
    ]
    results = sweep(tasks, jobs=os.cpu_count())
    bad = [r for r in results if r.violations or r.liveness]
    assert not bad, [
        (
            r.scenario,
            r.seed,
            (r.violations + r.liveness)[0].kind,
            (r.violations + r.liveness)[0].detail,
        )
        for r in bad
    ]
    assert sum(r.metrics["overlapped_reads"] or 0 for r in results) == 0
    assert sum(int(r.extra["used"]) for r in results) > 100 * SEEDS
