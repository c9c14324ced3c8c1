"""The UCX transport as the conformance kit runs it (entry point ``kvproto.transports: ucx``).

Every endpoint is a real :class:`UcxTransport` in this process (its own UCX
context, worker, listener and engine thread), over TCP on localhost, with
host memory from the kit's :class:`~kvproto_transports.conformance.hostmem.HostMemory`.
``kill`` tears an endpoint down without a goodbye: its TCP connections close
as they would when its process dies, which is what peers detect. The real
``kill -9`` of a separate process is in ``tests/transports/ucx``.
"""

from __future__ import annotations

from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.conformance.hostgroup import HostMemoryGroup

from .transport import DEFAULT_MAX_NOTIFICATION_SIZE, UcxTransport


class UcxGroup(HostMemoryGroup[UcxTransport]):
    """``size`` UCX endpoints ``ep0..`` in this process."""

    def __init__(
        self, size: int, *, max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE
    ) -> None:
        self._max = max_notification_size
        super().__init__(size)

    def _new(self, index: int) -> UcxTransport:
        return UcxTransport(name_prefix=f"ep{index}", max_notification_size=self._max)

    def _kill(self, endpoint: UcxTransport) -> None:
        endpoint.close()  # no BYE: peers see the connections break


def conformance_factory() -> TransportFactory:
    """The UCX transport as the conformance kit runs it."""
    return TransportFactory(
        name="ucx",
        create_group=UcxGroup,
        # Real time: polling granularity on top of the declared bound.
        detection_slack_s=0.1,
    )
