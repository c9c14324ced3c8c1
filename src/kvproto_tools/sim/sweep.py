"""Many runs: every (scenario, policy, seed), in parallel processes, with progress."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvproto_tools.sim.engine import RunResult, Simulator
from kvproto_tools.sim.policies import POLICIES
from kvproto_tools.sim.scenarios import SCENARIOS


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One run to do."""

    scenario: str
    """Scenario name."""
    policy: str
    """Policy name."""
    seed: int
    """Seed."""
    liveness: bool = False
    """Check the liveness bounds too."""
    timeline: bool = False
    """Record held blocks over time (for the plot)."""


def run_task(task: Task) -> RunResult:
    """Run one task (also the worker function of the process pool)."""
    sim = Simulator(
        task.scenario, task.policy, task.seed, liveness=task.liveness, timeline=task.timeline
    )
    return sim.run()


def plan(
    scenarios: Sequence[str],
    policies: Sequence[str],
    seeds: Sequence[int],
    *,
    liveness: bool = False,
    timelines: bool = False,
) -> list[Task]:
    """Every run, in canonical order; timelines only for each pair's first seed."""
    return [
        Task(
            scenario=s,
            policy=p,
            seed=seed,
            liveness=liveness,
            timeline=timelines and seed == seeds[0],
        )
        for s in scenarios
        for p in policies
        for seed in seeds
    ]


def _key(r: RunResult) -> tuple[int, int, int]:
    return (list(SCENARIOS).index(r.scenario), list(POLICIES).index(r.policy), r.seed)


def sweep(
    tasks: Sequence[Task],
    *,
    jobs: int | None = None,
    progress: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every task (in ``jobs`` processes) and return the results in canonical order.

    Runs are independent and seeded, so the results do not depend on ``jobs``.
    """
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[RunResult] = []
    if workers == 1:
        for task in tasks:
            r = run_task(task)
            results.append(r)
            if progress is not None:
                progress(r)
    else:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        with ctx.Pool(workers) as pool:
            for r in pool.imap_unordered(run_task, tasks, chunksize=1):
                results.append(r)
                if progress is not None:
                    progress(r)
    results.sort(key=_key)
    return results
