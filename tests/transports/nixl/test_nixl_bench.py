"""The overhead benchmark runs and reports consistent figures (no timing targets here)."""

from __future__ import annotations

import pytest

from kvproto_transports.nixl import nixl_available

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]


def test_measure_overhead_reports_both_variants() -> None:
    from kvproto_transports.nixl.bench import measure_overhead

    out = measure_overhead(iterations=10, blocks=8, regions=2, num_blocks=16)
    assert out["config"]["read_bytes"] == 8 * 2 * 4096
    for key in ("notif_rtt_raw", "notif_rtt_transport", "read_raw", "read_transport"):
        fig = out[key]
        assert 0 < fig["p10_us"] <= fig["median_us"] <= fig["p90_us"]
    assert out["read_overhead_ratio"] == pytest.approx(
        out["read_transport"]["median_us"] / out["read_raw"]["median_us"]
    )
    print(
        f"\nnotif RTT {out['notif_rtt_transport']['median_us']:.0f} us "
        f"(raw {out['notif_rtt_raw']['median_us']:.0f}); 8-block READ "
        f"{out['read_transport']['median_us']:.0f} us (raw {out['read_raw']['median_us']:.0f})"
    )
