"""The overhead benchmark runs and reports the figures the bench table prints."""

from __future__ import annotations

import pytest

from kvproto_transports.ucx import ucx_available, unavailable_reason

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]


def test_measure_overhead_reports_rtt_and_read_time() -> None:
    from kvproto_transports.ucx.bench import measure_overhead

    out = measure_overhead(iterations=10, blocks=64, regions=2, num_blocks=80)
    for key in ("notif_rtt_raw", "notif_rtt_transport", "read_raw", "read_transport"):
        fig = out[key]
        assert 0 < fig["p10_us"] <= fig["median_us"] <= fig["p90_us"]
    assert out["config"]["read_bytes"] == 64 * 2 * 4096
    med = {
        k: out[k]["median_us"]
        for k in ("notif_rtt_transport", "notif_rtt_raw", "read_transport", "read_raw")
    }
    print(
        f"\nUCX over TCP: notification RTT {med['notif_rtt_transport']:.0f} us "
        f"(raw {med['notif_rtt_raw']:.0f} us), 64-block read "
        f"{med['read_transport']:.0f} us (raw {med['read_raw']:.0f} us)"
    )
