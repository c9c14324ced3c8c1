"""The claim window's trade-off, in the simulator: stranded time against premature frees.

``python -m kvproto_tools.sim.claim_window [--seeds N]`` runs kvproto with grants that
wait ``W`` seconds for their first claim (``LeaseConfig.claim_window``; the default is
the lease extension, 20 s) over the scenarios where ``W`` matters, and the other option
spec/timing.md weighs: a router that hands the holder the ticket of each request it
drops (no router does today). Per ``W``: the worst time a dropped request's blocks stay
held (router-drop's ``reclaim_s``), and, summed over the seeds, the frees of blocks a
reader still needed and the prompt tokens recomputed for them in each other scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
from collections.abc import Sequence

from kvproto_tools.sim.engine import RunResult, Simulator
from kvproto_tools.sim.policies import KVPROTO_CONFIG, POLICIES, Policy
from kvproto_tools.sim.scenarios import SCENARIOS

WINDOWS: tuple[float, ...] = (30.0, 20.0, 15.0, 10.0, 5.0)
"""Claim windows compared (30 s: the whole lease, as before the window; 20 s: the default)."""
PRICED: tuple[str, ...] = ("decode-overload", "slow-forward", "partition", "lossy")
"""Where a shorter window can free blocks a reader still needs."""
RELEASE = "router release"


def _policy(window: float) -> Policy:
    kvproto = POLICIES["kvproto"]
    return dataclasses.replace(kvproto, name=f"kvproto W={window:g} s", turn1_ttl=window)


def _run(job: tuple[str, float, bool, int]) -> tuple[str, float, bool, RunResult]:
    scenario, window, release, seed = job
    spec = dataclasses.replace(SCENARIOS[scenario], router_release=release)
    return scenario, window, release, Simulator(spec, _policy(window), seed).run()


def table(seeds: Sequence[int], jobs: int | None = None) -> str:
    """The markdown table: one row per window, then the release path."""
    work = [("router-drop", w, False, s) for w in WINDOWS for s in seeds]
    work += [(sc, w, False, s) for sc in PRICED for w in WINDOWS for s in seeds]
    release_window = KVPROTO_CONFIG.grant_ttl
    work += [("router-drop", release_window, True, s) for s in seeds]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        done = pool.map(_run, work, chunksize=1)
    runs: dict[tuple[str, float, bool], list[RunResult]] = {}
    for scenario, window, release, result in done:
        runs.setdefault((scenario, window, release), []).append(result)

    def stranded(window: float, release: bool) -> str:
        worst = max(r.metrics["reclaim_s"] or 0.0 for r in runs[("router-drop", window, release)])
        return f"{worst:.1f} s"

    def priced(scenario: str, window: float) -> str:
        rs = runs[(scenario, window, False)]
        frees = sum(int(r.metrics["premature_frees"] or 0) for r in rs)
        tokens = sum(int(r.metrics["wasted_prefill_tokens"] or 0) for r in rs)
        used = sum(int(r.metrics["overlapped_reads"] or 0) for r in rs)
        return f"{frees} ({tokens:,} tokens)" + (f", {used} used freed" if used else "")

    head = "| claim window | router-drop: stranded | " + " | ".join(PRICED) + " |"
    lines = [head, "|---" * (len(PRICED) + 2) + "|"]
    for w in WINDOWS:
        cells = [stranded(w, False), *(priced(sc, w) for sc in PRICED)]
        mark = " (default)" if w == KVPROTO_CONFIG.grant_ttl else ""
        lines.append(f"| {w:g} s{mark} | " + " | ".join(cells) + " |")
    lines.append(
        f"| {release_window:g} s + {RELEASE} | {stranded(release_window, True)} | "
        + " | ".join("as its window" for _ in PRICED)
        + " |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvproto_tools.sim.claim_window")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes")
    args = parser.parse_args(argv)
    print(f"kvproto, premature frees (recomputed prompt tokens) over seeds 0-{args.seeds - 1}")
    print(table(range(args.seeds), jobs=args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
