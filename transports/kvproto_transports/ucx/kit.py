"""The UCX transport as the conformance kit runs it (entry point ``kvproto.transports: ucx``).

Every endpoint is a real :class:`UcxTransport` in this process (its own UCX
context, worker, listener and engine thread), over TCP on localhost, with
host memory from the kit's :class:`~kvproto_transports.conformance.hostmem.HostMemory`.
``kill`` tears an endpoint down without a goodbye: its TCP connections close
as they would when its process dies, which is what peers detect. The real
``kill -9`` of a separate process is in ``tests/transports/ucx``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport
from kvproto_transports.conformance.factory import RealTimeGroup, TransportFactory
from kvproto_transports.conformance.hostmem import HostMemory

from .transport import DEFAULT_MAX_NOTIFICATION_SIZE, UcxTransport


class UcxGroup(RealTimeGroup):
    """``size`` UCX endpoints ``ep0..`` in this process."""

    can_kill = True
    can_restart = True

    def __init__(
        self, size: int, *, max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE
    ) -> None:
        self._max = max_notification_size
        self._memory = [HostMemory() for _ in range(size)]
        self._eps: list[UcxTransport] = []
        try:
            for i in range(size):
                self._eps.append(self._new(i))
        except BaseException:
            self.close()
            raise
        self._dead: set[int] = set()

    def _new(self, index: int) -> UcxTransport:
        return UcxTransport(name_prefix=f"ep{index}", max_notification_size=self._max)

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self._eps

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
        self._eps[index].close()  # no BYE: peers see the connections break
        self._dead.add(index)

    def restart(self, index: int) -> Transport:
        if index not in self._dead:
            self.kill(index)
        self._memory[index] = HostMemory()
        self._eps[index] = self._new(index)
        self._dead.discard(index)
        return self._eps[index]

    def close(self) -> None:
        for ep in self._eps:
            with contextlib.suppress(Exception):  # teardown must reach every endpoint
                ep.close()


def conformance_factory() -> TransportFactory:
    """The UCX transport as the conformance kit runs it."""
    return TransportFactory(
        name="ucx",
        create_group=UcxGroup,
        # Real time: polling granularity on top of the declared bound.
        detection_slack_s=0.1,
    )
