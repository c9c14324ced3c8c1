"""The overhead benchmark runs beside raw Mooncake and reports the figures the table prints."""

from __future__ import annotations

from tests.transports.mooncake.mooncake_required import needs_mooncake

pytestmark = needs_mooncake


def test_measure_overhead_reports_rtt_and_read_time() -> None:
    from kvproto_transports.mooncake.bench import measure_overhead

    out = measure_overhead(iterations=10, blocks=64, regions=2, num_blocks=80)
    keys = ("notif_rtt_raw", "notif_rtt_transport", "read_raw", "read_transport")
    for key in (*keys, "read_raw_nonotify"):
        fig = out[key]
        assert 0 < fig["p10_us"] <= fig["median_us"] <= fig["p90_us"]
    assert out["config"]["read_bytes"] == 64 * 2 * 4096
    med = {k: out[k]["median_us"] for k in keys}
    print(
        f"\nMooncake over TCP: notification RTT {med['notif_rtt_transport']:.0f} us "
        f"(raw TransferNotify {med['notif_rtt_raw']:.0f} us), 64-block read "
        f"{med['read_transport']:.0f} us (raw {med['read_raw']:.0f} us)"
    )
