"""The measurement loop the NIXL and UCX benches share: what it runs and the shape it reports.

The bench table reads these keys (``tools/kvproto_tools/bench/transport_bench.py``),
so their names, order and definitions are pinned here without any transport.
"""

from __future__ import annotations

import pytest

from kvproto_transports.benchloop import (
    WARMUP,
    interleave,
    overhead_report,
    partial_hit,
    read_config,
    spin,
    summary,
)

STEPS = ("notif_rtt_raw", "notif_rtt_transport", "read_raw", "read_transport")


def test_steps_warm_up_then_run_interleaved() -> None:
    calls: list[str] = []

    def step(name: str, seconds: float) -> float:
        calls.append(name)
        return seconds

    steps = {name: (lambda n=name, s=i + 1.0: step(n, s)) for i, name in enumerate(STEPS)}
    samples = interleave(steps, iterations=3)
    warmup = [name for name in STEPS for _ in range(WARMUP)]
    assert calls == warmup + list(STEPS) * 3
    assert samples == {name: [i + 1.0] * 3 for i, name in enumerate(STEPS)}


def test_summary_is_in_microseconds() -> None:
    fig = summary([i * 1e-6 for i in range(1, 11)])
    assert fig == pytest.approx({"median_us": 5.5, "p10_us": 2.0, "p90_us": 10.0, "mean_us": 5.5})
    assert list(fig) == ["median_us", "p10_us", "p90_us", "mean_us"]


def test_report_is_config_then_steps_then_ratios() -> None:
    config = {**read_config(iterations=3, blocks=4, regions=2, block_len=16), "extra": "x"}
    samples = {name: [(i + 1) * 1e-6] * 3 for i, name in enumerate(STEPS)}
    out = overhead_report(config, samples)
    assert list(out) == ["config", *STEPS, "notif_rtt_overhead_ratio", "read_overhead_ratio"]
    assert out["config"] == {
        "iterations": 3,
        "blocks": 4,
        "regions": 2,
        "block_len": 16,
        "read_bytes": 128,
        "extra": "x",
    }
    assert out["notif_rtt_overhead_ratio"] == pytest.approx(2.0)
    assert out["read_overhead_ratio"] == pytest.approx(4.0 / 3.0)


def test_partial_hit_reads_the_tail_into_the_head() -> None:
    assert partial_hit(3, 8) == ([0, 1, 2], [5, 6, 7])


def test_spin_names_what_timed_out() -> None:
    with pytest.raises(TimeoutError, match=r"ping took over 0\.001 s"):
        spin(lambda: False, 0.001, "ping")
