"""Many runs: every (scenario, policy, seed), in parallel processes, with progress."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvproto_tools.sim.engine import RunResult, Simulator
from kvproto_tools.sim.policies import POLICIES
from kvproto_tools.sim.push import PushSimulator
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
    if SCENARIOS[task.scenario].push is not None:
        return PushSimulator(task.scenario, task.policy, task.seed).run()
    sim = Simulator(
        task.scenario, task.policy, task.seed, liveness=task.liveness, timeline=task.timeline
    )
    return sim.run()


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Every run of a sweep, made one at a time as they are handed out.

    A sweep of a million seeds is tens of millions of runs: making every task
    up front would cost minutes and gigabytes before the first run starts.
    """

    scenarios: Sequence[str]
    """Scenario names, in order."""
    policies: Sequence[str]
    """Policy names, in order."""
    seeds: Sequence[int]
    """Seeds, in order (a ``range`` stays small however many)."""
    liveness: bool = False
    """Check the liveness bounds too."""
    timelines: bool = False
    """Record held blocks over time for each (scenario, policy)'s first seed."""

    def __len__(self) -> int:
        return len(self.scenarios) * len(self.policies) * len(self.seeds)

    def __iter__(self) -> Iterator[Task]:
        """Every task in canonical order (scenario, policy, seed)."""
        first = self.seeds[0] if self.seeds else None
        for s in self.scenarios:
            for p in self.policies:
                for seed in self.seeds:
                    yield Task(
                        scenario=s,
                        policy=p,
                        seed=seed,
                        liveness=self.liveness,
                        timeline=self.timelines and seed == first,
                    )


def plan(
    scenarios: Sequence[str],
    policies: Sequence[str],
    seeds: Sequence[int],
    *,
    liveness: bool = False,
    timelines: bool = False,
) -> list[Task]:
    """Every run, in canonical order; timelines only for each pair's first seed."""
    return list(
        Plan(
            scenarios=scenarios,
            policies=policies,
            seeds=seeds,
            liveness=liveness,
            timelines=timelines,
        )
    )


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
    results = list(stream(tasks, len(tasks), jobs=jobs, progress=progress))
    results.sort(key=_key)
    return results


def _run_numbered(item: tuple[int, Task]) -> tuple[int, RunResult]:
    return item[0], run_task(item[1])


def stream(
    tasks: Iterable[Task],
    total: int,
    *,
    jobs: int | None = None,
    progress: Callable[[RunResult], None] | None = None,
) -> Iterator[RunResult]:
    """Run ``total`` tasks (in ``jobs`` processes) and yield each result in the tasks' order.

    ``progress`` sees each run as it ends; the caller gets them in order, so
    it can aggregate and write them as they come and keep none. Only the runs
    that ended before an earlier, slower one wait here: the workers take the
    tasks in order, so that is a few per worker.
    """
    workers = max(1, min(jobs or os.cpu_count() or 1, total))
    if workers == 1:
        for task in tasks:
            r = run_task(task)
            if progress is not None:
                progress(r)
            yield r
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    waiting: dict[int, RunResult] = {}
    following = 0
    with ctx.Pool(workers) as pool:
        for i, r in pool.imap_unordered(_run_numbered, enumerate(tasks), chunksize=1):
            if progress is not None:
                progress(r)
            waiting[i] = r
            while following in waiting:
                yield waiting.pop(following)
                following += 1
