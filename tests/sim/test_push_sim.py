"""The simulator's push mode (tools/kvproto_tools/sim/push.py): figures and oracles.

Seed 0 of every push scenario under the four default policies: kvproto never writes
into blocks D let go (S1w) nor uses blocks that do not hold the request's KV (S0),
frees at the loss report, keeps an overloaded P's blocks, and strands only armed
writes when P dies silently; the baselines show their known failures. A broken write
fence makes the oracle fire.
"""

from __future__ import annotations

import pytest

from kvproto.holder_writes import WriteFence
from kvproto_tools.sim import SCENARIOS
from kvproto_tools.sim.engine import RunResult
from kvproto_tools.sim.push import PushSimulator
from kvproto_tools.sim.sweep import Task, run_task

PUSH = [name for name, sc in SCENARIOS.items() if sc.push is not None]
POLICIES = ("fixed-480", "fixed-short", "vllm-lease", "kvproto")


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], RunResult]:
    return {(s, p): run_task(Task(scenario=s, policy=p, seed=0)) for s in PUSH for p in POLICIES}


def test_kvproto_breaks_no_oracle_and_never_writes_into_freed_blocks(
    runs: dict[tuple[str, str], RunResult],
) -> None:
    for scenario in PUSH:
        r = runs[(scenario, "kvproto")]
        assert r.violations == (), (scenario, r.violations)
        assert r.metrics["written_freed"] == 0
        assert r.metrics["safety_violations"] == 0
        assert r.extra["corrupt_outputs"] == 0


def test_the_reported_crash_is_reclaimed_at_the_report(
    runs: dict[tuple[str, str], RunResult],
) -> None:
    r = runs[("push-prefill-crash-reported", "kvproto")]
    assert r.metrics["reclaim_s"] == 1.0  # PEER_LOST 1 s after the kill, freed in that step
    assert r.extra["stranded_blocks"] == 0
    stock = runs[("push-prefill-crash-reported", "vllm-lease")]
    assert stock.extra["stranded_blocks"] > 0  # 0.32's push ignores a lost peer


def test_a_silent_crash_strands_only_the_armed_writes(
    runs: dict[tuple[str, str], RunResult],
) -> None:
    kv = runs[("push-prefill-crash", "kvproto")]
    stock = runs[("push-prefill-crash", "vllm-lease")]
    # Stock strands every waiting block; kvproto only those of writes armed at the kill,
    # the others come back by expiry (last heartbeat + 20 s, within the 30 s lease).
    assert 0 < kv.extra["stranded_blocks"] < stock.extra["stranded_blocks"]
    assert 0 < kv.extra["reclaim_freed_s"] <= 30.0
    assert kv.extra["write_fenced"] > 0


def test_overload_and_slow_writes(runs: dict[tuple[str, str], RunResult]) -> None:
    # P's heartbeats keep D's blocks through a 300 s queue; a 30 s give-up does not, and
    # the WRITEs that come later land in blocks recomputed into: corruption.
    assert runs[("push-prefill-overload", "kvproto")].metrics["premature_frees"] == 0
    assert runs[("push-prefill-overload", "fixed-short")].metrics["premature_frees"] > 0
    assert runs[("push-prefill-overload", "fixed-short")].metrics["written_freed"] > 0
    assert runs[("push-slow-write", "fixed-short")].metrics["written_freed"] > 0
    assert runs[("push-slow-write", "kvproto")].extra["recomputed"] == 0
    # A stalled P loses leases (as designed, recomputed) but never writes into freed blocks.
    stall = runs[("push-prefill-stall", "kvproto")]
    assert stall.metrics["premature_frees"] > 0
    assert stall.metrics["written_freed"] == 0
    assert runs[("push-prefill-stall", "fixed-short")].metrics["written_freed"] > 0


def test_a_run_replays_from_its_seed() -> None:
    a = PushSimulator("push-prefill-stall", "kvproto", 3).run()
    b = PushSimulator("push-prefill-stall", "kvproto", 3).run()
    assert a.metrics == b.metrics and a.extra == b.extra


def test_the_oracle_fires_when_the_write_fence_lets_go_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A holder that settles a writable lease at its end whoever is armed (no quarantine):
    # the stalled P's WRITEs land in blocks D recomputed into.
    monkeypatch.setattr(WriteFence, "end", lambda self, lease, reason: False)
    r = PushSimulator("push-prefill-stall", "kvproto", 0).run()
    assert r.metrics["written_freed"] > 0
    assert r.metrics["safety_violations"] > 0
    assert {v.kind for v in r.violations} >= {"S1w"}
