"""Each scenario's headline figure against its bound; the baselines' known failures reproduced."""

from __future__ import annotations

import dataclasses

import pytest

from kvproto_tools.sim import SCENARIOS, Simulator
from kvproto_tools.sim.policies import KVPROTO_CONFIG
from kvproto_tools.sim.scenarios import CLUSTER
from tests.sim.runs import fig, result

D = KVPROTO_CONFIG.kv_lease_duration
E = KVPROTO_CONFIG.lease_extension
W = KVPROTO_CONFIG.grant_ttl


def _p_tick(scenario: str) -> float:
    """One prefill engine step (the longest prefill): the holder's loop granularity."""
    sim = Simulator(scenario, "kvproto", 0)
    return max(e.max_step for e in sim.engines.values() if e.role == "P")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kvproto_never_uses_freed_blocks(scenario: str) -> None:
    r = result(scenario, "kvproto")
    assert r.metrics["overlapped_reads"] == 0
    assert r.metrics["safety_violations"] == 0, r.violations
    assert r.liveness_violations == 0, r.liveness
    assert r.extra["corrupted"] == 0
    assert r.extra["used"] > 0  # it did real work


def test_cluster_covers_every_tp_pairing() -> None:
    tps = {(p.tp, d.tp) for p in CLUSTER if p.role == "P" for d in CLUSTER if d.role == "D"}
    assert {(1, 2), (2, 1), (1, 1), (2, 2)} <= tps


def test_decode_crash_reclaim_bounds() -> None:
    tick = _p_tick("decode-crash")
    # Claimed leases go by last heartbeat + e + one tick (the L1 oracle checks each one);
    # a lease granted just before the crash and never claimed, by grant + the claim
    # window + one tick.
    reclaim = fig("decode-crash", "kvproto", "reclaim_s")
    assert 0 < reclaim <= max(E, W) + tick
    assert result("decode-crash", "kvproto").liveness_violations == 0
    # vLLM before leases holds the dead decoder's blocks for the whole 480 s.
    held = fig("decode-crash", "fixed-480", "reclaim_s")
    assert 450.0 <= held <= 480.0 + tick
    dead_kv = fig("decode-crash", "kvproto", "dead_block_seconds")
    assert fig("decode-crash", "fixed-480", "dead_block_seconds") > 10 * dead_kv


def test_decode_crash_reported_reclaims_at_once() -> None:
    """With PEER_LOST the holder frees the dead reader's leases: seconds, not the lease."""
    sc = SCENARIOS["decode-crash-reported"]
    tick = _p_tick("decode-crash-reported")
    kv = fig("decode-crash-reported", "kvproto", "reclaim_s")
    assert 0 < kv <= sc.detection_delay + tick
    assert result("decode-crash-reported", "kvproto").liveness_violations == 0
    # vLLM 0.32 does nothing with a lost peer on the holder side: its leases run out.
    assert fig("decode-crash-reported", "vllm-lease", "reclaim_s") > D - E
    assert fig("decode-crash-reported", "fixed-480", "reclaim_s") > 450.0


def test_historical_reaper_strands_expired_leases_behind_a_heartbeated_head() -> None:
    """vLLM #58222 in the simulator: seed 7 of decode-crash (found by sweeping seeds).

    The first lease release (vllm-v4) stops at the first live entry; vLLM 0.32 scans
    every entry and reclaims within its lease, kvproto within its claim window.
    """
    historical = result("decode-crash", "vllm-v4", 7)
    shipped = result("decode-crash", "vllm-lease", 7)
    assert historical.liveness_violations > 0
    assert all(v.kind == "L1 dead reader" for v in historical.liveness)
    kv_reclaim = fig("decode-crash", "kvproto", "reclaim_s", seed=7)
    assert fig("decode-crash", "vllm-v4", "reclaim_s", seed=7) > kv_reclaim + E
    assert shipped.liveness_violations == 0
    tick = _p_tick("decode-crash")
    assert kv_reclaim <= W + tick < shipped.metrics["reclaim_s"] <= D + tick
    assert shipped.extra["vllm_num_kv_expired_reqs"] > 0  # vLLM's own counter saw it


def test_router_drop_frees_at_the_claim_window_and_a_router_release_at_once() -> None:
    """Requests dropped between P's answer and D hold their blocks until the grant's own
    deadline: kvproto's claim window, vLLM's whole lease, 480 s before leases. A router
    that hands P the dropped tickets (the option spec/timing.md weighs) strands nothing."""
    tick = _p_tick("router-drop")
    kv = result("router-drop", "kvproto")
    assert kv.extra["dropped"] > 0 and kv.metrics["premature_frees"] == 0
    assert W - 0.01 <= kv.metrics["reclaim_s"] <= W + tick
    assert D - 0.01 <= fig("router-drop", "vllm-lease", "reclaim_s") <= D + tick
    assert fig("router-drop", "fixed-480", "reclaim_s") >= 480.0 - 0.01
    released = Simulator(
        dataclasses.replace(SCENARIOS["router-drop"], router_release=True), "kvproto", 0
    ).run()
    assert released.metrics["reclaim_s"] <= tick
    assert released.extra["dropped"] == kv.extra["dropped"]
    assert released.metrics["safety_violations"] == 0


def test_overload_leases_hold_and_a_short_timeout_frees_early() -> None:
    assert fig("decode-overload", "kvproto", "premature_frees") == 0
    assert fig("decode-overload", "kvproto", "wasted_prefill_tokens") == 0
    assert fig("decode-overload", "vllm-lease", "premature_frees") == 0
    assert fig("decode-overload", "fixed-short", "premature_frees") > 10
    # vLLM reads anyway: silent corruption, caught by the S1 oracle.
    used_freed = fig("decode-overload", "fixed-short", "overlapped_reads")
    assert used_freed == fig("decode-overload", "fixed-short", "safety_violations") > 0
    assert result("decode-overload", "fixed-short").violations[0].kind == "S1 use after free"
    # vLLM's text heartbeat grows with the queue; kvproto's does not.
    kv_bytes = fig("decode-overload", "kvproto", "heartbeat_bytes")
    assert fig("decode-overload", "vllm-lease", "heartbeat_bytes") > 3 * kv_bytes


def test_duplicated_completion_frees_early_under_raw_counting() -> None:
    lossy = SCENARIOS["lossy"]
    no_dup = dataclasses.replace(lossy, link=dataclasses.replace(lossy.link, duplicate=0.0))
    assert fig("lossy", "vllm-lease", "overlapped_reads") > 0
    assert Simulator(no_dup, "vllm-lease", 0).run().metrics["overlapped_reads"] == 0
    assert fig("lossy", "kvproto", "premature_frees") == 0


def test_slow_forward_fences_instead_of_corrupting() -> None:
    assert fig("slow-forward", "vllm-lease", "overlapped_reads") > 0
    assert fig("slow-forward", "kvproto", "overlapped_reads") == 0
    # A step longer than e - i can cost kvproto a lease too: it recomputes instead.
    assert fig("slow-forward", "kvproto", "wasted_prefill_tokens") > 0


def test_clock_skew_breaks_the_first_releases_turn2_deadlines_not_0_32s() -> None:
    # The first release compared the holder's deadline with the reader's own clock;
    # 0.32 subtracts the handshake's clock offset, so a skewed clock no longer corrupts.
    assert fig("clock-skew", "vllm-v4", "overlapped_reads") > 0
    assert fig("clock-skew", "vllm-lease", "overlapped_reads") == 0
    assert fig("clock-skew", "kvproto", "overlapped_reads") == 0
    assert result("clock-skew", "kvproto").extra["turn2"] > 0


def test_bidirectional_turn2_blocks_are_read_by_the_prefill_side() -> None:
    assert result("bidirectional", "kvproto").extra["turn2"] > 20
    # Clients back after the 480 s TTL recompute under every 480 s policy alike; kvproto
    # saves some more: its reader heartbeats turn-2 leases from scheduler entry, and renews
    # one whose TTL ends within the read margin (a deferred read) instead of declining it.
    kv = fig("bidirectional", "kvproto", "wasted_prefill_tokens")
    assert kv <= fig("bidirectional", "vllm-lease", "wasted_prefill_tokens")
    assert fig("bidirectional", "fixed-short", "wasted_prefill_tokens") > kv


def test_partition_kvproto_recomputes_but_never_corrupts() -> None:
    assert fig("partition", "kvproto", "wasted_prefill_tokens") > 0
    assert fig("partition", "kvproto", "overlapped_reads") == 0
    assert fig("partition", "fixed-short", "overlapped_reads") > 0


def test_prefill_restart_costs_kvproto_no_more_than_the_baseline() -> None:
    kv = fig("prefill-restart", "kvproto", "wasted_prefill_tokens")
    assert kv <= fig("prefill-restart", "vllm-lease", "wasted_prefill_tokens")
