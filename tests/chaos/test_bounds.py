"""The chaos run's bounds are sums of the protocol's own parts (spec/timing.md)."""

from __future__ import annotations

import pytest

from kvproto_tools.chaos.bounds import (
    TCP_RTO_INITIAL_S,
    TCP_RTO_MAX_S,
    Terms,
    orphan_s,
    peer_lost_s,
    settle_s,
    tcp_backoff_s,
)
from kvproto_tools.chaos.schedule import Fault
from kvproto_transports.nixl.transport import PROBE_DETECTION_SLACK_S
from kvproto_vllm.config import DEFAULT_PROBE_INTERVAL_S

TERMS = Terms(pump_gap_s=0.4, scrape_s=0.3)


def fault(kind: str, **kw: float) -> Fault:
    return Fault(index=0, kind=kind, target=("prefill-0", "decode-0"), gap_s=1.0, **kw)  # type: ignore[arg-type]


def test_peer_lost_is_the_probe_the_slack_a_pump_gap_and_a_scrape() -> None:
    assert peer_lost_s(TERMS) == pytest.approx(
        DEFAULT_PROBE_INTERVAL_S + PROBE_DETECTION_SLACK_S + 0.4 + 0.3
    )
    exiting = Terms(pump_gap_s=0.4, scrape_s=0.3, exit_s=0.2)
    assert peer_lost_s(exiting) == pytest.approx(peer_lost_s(TERMS) + 0.2)


def test_settle_is_the_lease_plus_tcp_s_wait_after_a_cut() -> None:
    orphan = orphan_s(10, TERMS)
    assert orphan == pytest.approx(10 + 0.4 + 0.3)
    assert settle_s(fault("kill-decode", length_s=5.0), 10, TERMS) == orphan
    assert settle_s(fault("partition", length_s=15.0), 10, TERMS) == pytest.approx(
        orphan + 15.0 + TCP_RTO_INITIAL_S
    )
    flap = fault("flap", length_s=9.0, down_s=1.5, up_s=1.5, flaps=3)
    assert settle_s(flap, 10, TERMS) == pytest.approx(orphan + 1.5 + TCP_RTO_INITIAL_S)
    assert tcp_backoff_s(1000.0) == TCP_RTO_MAX_S
