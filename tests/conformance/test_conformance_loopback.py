"""The whole suite on loopback: through pytest (one test per case), on virtual and wall time,
and judged against what a transport declares."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport
from kvproto_transports.conformance import (
    RealTimeGroup,
    TransportFactory,
    Verdict,
    pytest_cases,
    run_conformance,
)
from kvproto_transports.loopback import (
    LinkFaults,
    LoopbackGroup,
    LoopbackNetwork,
    LoopbackTransport,
)

# The pytest entry point, exactly as a transport author would use it: one test per case,
# loaded through the "kvproto.transports" entry point named "loopback".
test_loopback_conformance = pytest_cases("loopback")


def test_every_case_passes_on_loopback_through_the_entry_point() -> None:
    report = run_conformance("loopback")
    assert report.transport == "loopback"
    assert {c.verdict for c in report.cases} == {Verdict.PASS}, [
        (c.id, c.verdict, c.detail) for c in report.cases if c.verdict is not Verdict.PASS
    ]
    t41 = report.case("T4.1")
    assert t41.measured == 0.5  # virtual time: detection exactly at the declared bound
    assert report.case("T5.1").measured is not None


def test_a_transport_is_judged_against_what_it_declares() -> None:
    # Reordering and duplicating links: loopback then declares ordered=False and
    # may_duplicate=True, so those properties are reported (INFO), not failed.
    faults = LinkFaults(delay=50e-6, reorder=0.2, duplicate=0.1)
    factory = TransportFactory(
        name="loopback-faulty",
        create_group=lambda n: LoopbackGroup(n, seed=3, default_link=faults),
        resource_cycles=4000,
    )
    report = run_conformance(factory)
    assert report.by_verdict(Verdict.FAIL) == []
    assert report.by_verdict(Verdict.INFO) == ["T2.6", "T2.7"]
    assert report.case("T2.6").measured and report.case("T2.7").measured


class NoKillGroup(LoopbackGroup):
    """A group that cannot kill or restart endpoints."""

    can_kill = False
    can_restart = False


def test_unsupported_cases_are_declared_not_failed() -> None:
    factory = TransportFactory(
        name="loopback-limited",
        create_group=NoKillGroup,
        unsupported={"T2.9": "measured elsewhere"},
        resource_cycles=1000,
    )
    report = run_conformance(factory)
    unsupported = report.by_verdict(Verdict.UNSUPPORTED)
    assert unsupported == ["T1.3", "T2.9", "T4.1", "T4.2", "T4.3", "T4.4", "T6.6"]
    assert report.case("T2.9").detail == "declared: measured elsewhere"
    assert "cannot kill" in report.case("T4.1").detail
    assert not report.failed


class WallClockLoopback(RealTimeGroup):
    """Loopback run on the wall clock, as a real transport's group runs: the kit only waits."""

    can_kill = True
    can_restart = True

    def __init__(self, size: int) -> None:
        self.t0 = time.monotonic()
        self.net = LoopbackNetwork(
            detection_delay=0.05, read_bandwidth=1e9, default_link=LinkFaults(delay=50e-6)
        )
        self.eps: list[LoopbackTransport] = [self.net.endpoint(f"w{i}") for i in range(size)]

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self.eps

    def wait(self, max_s: float) -> None:
        super().wait(max_s)  # sleeps; then the "hardware" catches up with the wall clock
        self.net.advance(max(self.net.now, time.monotonic() - self.t0))

    def allocate(
        self, index: int, *, num_regions: int, block_len: int, num_blocks: int
    ) -> BlockLayout:
        return self.eps[index].allocate_layout(num_regions, block_len, num_blocks)

    def write_block(
        self, index: int, layout: BlockLayout, region: int, block: int, data: bytes
    ) -> None:
        self.eps[index].write_block(region, block, data, layout=layout)

    def read_block(self, index: int, layout: BlockLayout, region: int, block: int) -> bytes:
        return self.eps[index].read_block(region, block, layout=layout)

    def kill(self, index: int) -> None:
        # Catch the network up first: a crash at a lagging network time would be
        # detected (network time + 50 ms) a hair before 50 ms of wall time had passed.
        self.net.advance(max(self.net.now, time.monotonic() - self.t0))
        self.net.crash(self.eps[index].base_name)

    def restart(self, index: int) -> Transport:
        self.eps[index] = self.net.restart(self.eps[index].base_name)
        return self.eps[index]


def test_the_kit_drives_a_wall_clock_transport_by_waiting() -> None:
    # Generous slack: on a loaded CI machine a 1 ms sleep can overshoot a lot.
    factory = TransportFactory(
        name="loopback-wall",
        create_group=WallClockLoopback,
        timeout_s=5.0,
        settle_s=0.02,
        detection_slack_s=0.5,
        resource_cycles=2000,
    )
    t0 = time.monotonic()
    report = run_conformance(factory)
    assert report.by_verdict(Verdict.FAIL) == [], [
        (c.id, c.detail) for c in report.cases if c.verdict is Verdict.FAIL
    ]
    detected = report.case("T4.1").measured
    assert detected is not None and 0.05 <= detected < 0.55  # real seconds this time
    assert time.monotonic() - t0 < 60
