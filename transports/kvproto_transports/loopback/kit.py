"""The loopback transport's conformance factory (entry point ``kvproto.transports: loopback``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport
from kvproto_transports.conformance.factory import EndpointGroup, TransportFactory
from kvproto_transports.loopback.endpoint import LoopbackTransport
from kvproto_transports.loopback.faults import LinkFaults
from kvproto_transports.loopback.network import LoopbackNetwork

LINK_DELAY_S = 50e-6
"""One-way latency of every link in the kit's network: small, but not zero, so
that events at different stages of a read happen at different instants."""
READ_BANDWIDTH = 1e9
"""Bytes per second of a read: a read of data takes longer than a notification."""
DETECTION_DELAY_S = 0.5
"""Seconds from a death to PeerLost; also the declared bound."""


class LoopbackGroup(EndpointGroup):
    """``size`` loopback endpoints ``ep0..`` on one fresh network; time is virtual."""

    can_kill = True
    can_restart = True

    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        default_link: LinkFaults | None = None,
        detection_delay: float = DETECTION_DELAY_S,
        max_notification_size: int | None = 4096,
    ) -> None:
        self.net = LoopbackNetwork(
            seed,
            detection_delay=detection_delay,
            read_bandwidth=READ_BANDWIDTH,
            default_link=default_link or LinkFaults(delay=LINK_DELAY_S),
        )
        """The network, for tests that want to inject faults or read counters."""
        self._eps: list[LoopbackTransport] = [
            self.net.endpoint(f"ep{i}", max_notification_size=max_notification_size)
            for i in range(size)
        ]

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self._eps

    @property
    def loopback_endpoints(self) -> Sequence[LoopbackTransport]:
        """The endpoints with their loopback type (for wrappers and tests)."""
        return self._eps

    def now(self) -> float:
        return self.net.now

    def wait(self, max_s: float) -> None:
        # Jump to the next event if it comes first: timeouts cost no wall time.
        now = self.net.now
        nxt = self.net.next_event_time()
        target = now + max(max_s, 0.0)
        if nxt is not None:
            target = min(target, max(nxt, now))
        self.net.advance(target)

    def allocate(
        self, index: int, *, num_regions: int, block_len: int, num_blocks: int
    ) -> BlockLayout:
        return self._eps[index].allocate_layout(num_regions, block_len, num_blocks)

    def write_block(
        self, index: int, layout: BlockLayout, region: int, block: int, data: bytes
    ) -> None:
        self._eps[index].write_block(region, block, data, layout=layout)

    def read_block(self, index: int, layout: BlockLayout, region: int, block: int) -> bytes:
        return self._eps[index].read_block(region, block, layout=layout)

    def kill(self, index: int) -> None:
        self.net.crash(self._eps[index].base_name)

    def restart(self, index: int) -> Transport:
        self._eps[index] = self.net.restart(self._eps[index].base_name)
        return self._eps[index]


def conformance_factory() -> TransportFactory:
    """The loopback transport as the conformance kit runs it."""
    return TransportFactory(name="loopback", create_group=LoopbackGroup)
