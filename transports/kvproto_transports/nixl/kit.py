"""The NIXL transport as the conformance kit runs it (entry point ``kvproto.transports: nixl``).

Every endpoint is a real NIXL agent in this process, with host memory from
the kit's :class:`~kvproto_transports.conformance.hostmem.HostMemory`. NIXL's
progress thread is off by default (it spins a core per agent; a group holds up
to nine agents), so :meth:`NixlGroup.wait` drives every live endpoint with
:meth:`~kvproto_transports.nixl.transport.NixlTransport.progress`. ``kill``
drops an agent without any goodbye, which closes its UCX connections as a
process death would. Endpoints probe their peers every 100 ms, so the declared
failure-detection bound holds even for a peer nobody sends to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport
from kvproto_transports.conformance.factory import RealTimeGroup, TransportFactory
from kvproto_transports.conformance.hostmem import HostMemory

from .transport import DEFAULT_MAX_NOTIFICATION_SIZE, NixlTransport

PROBE_INTERVAL_S = 0.1
"""Auto-probe period of the kit's endpoints (declared bound: this + 0.5 s)."""


class NixlGroup(RealTimeGroup):
    """``size`` NIXL endpoints ``ep0..`` in this process."""

    can_kill = True
    can_restart = True

    def __init__(
        self,
        size: int,
        *,
        progress_thread: bool = False,
        auto_probe_interval_s: float | None = PROBE_INTERVAL_S,
        max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE,
    ) -> None:
        self._options = {
            "progress_thread": progress_thread,
            "auto_probe_interval_s": auto_probe_interval_s,
            "max_notification_size": max_notification_size,
        }
        self._memory = [HostMemory() for _ in range(size)]
        self._eps = [self._new(i) for i in range(size)]
        self._dead: set[int] = set()
        self._graveyard: list[HostMemory] = []
        """Memory of killed incarnations: NIXL may still deregister it while it tears down."""

    def _new(self, index: int) -> NixlTransport:
        return NixlTransport(name_prefix=f"ep{index}", **self._options)  # type: ignore[arg-type]

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self._eps

    def wait(self, max_s: float) -> None:
        for i, ep in enumerate(self._eps):
            if i not in self._dead:
                with contextlib.suppress(Exception):  # a closed endpoint: the kit's business
                    ep.progress()
        super().wait(max_s)

    def allocate(
        self, index: int, *, num_regions: int, block_len: int, num_blocks: int
    ) -> BlockLayout:
        return self._memory[index].allocate(
            num_regions=num_regions, block_len=block_len, num_blocks=num_blocks
        )

    def write_block(
        self, index: int, layout: BlockLayout, region: int, block: int, data: bytes
    ) -> None:
        self._memory[index].write_block(layout, region, block, data)

    def read_block(self, index: int, layout: BlockLayout, region: int, block: int) -> bytes:
        return self._memory[index].read_block(layout, region, block)

    def kill(self, index: int) -> None:
        self._eps[index]._crash()
        self._dead.add(index)

    def restart(self, index: int) -> Transport:
        if index not in self._dead:
            self.kill(index)
        self._graveyard.append(self._memory[index])
        self._memory[index] = HostMemory()
        self._eps[index] = self._new(index)
        self._dead.discard(index)
        return self._eps[index]

    def close(self) -> None:
        for i, ep in enumerate(self._eps):
            if i not in self._dead:
                with contextlib.suppress(Exception):  # teardown must reach every endpoint
                    ep.close()


def conformance_factory() -> TransportFactory:
    """The NIXL transport as the conformance kit runs it."""
    return TransportFactory(
        name="nixl",
        create_group=NixlGroup,
        # Real time: a tick of polling granularity on top of the declared bound.
        detection_slack_s=0.1,
    )
