"""The Mooncake transport as the kit runs it (entry point ``kvproto.transports: mooncake``).

Every endpoint is a real :class:`MooncakeTransport` in this process (its own
transfer engine, handshake listener and ZMQ sockets) over TCP on localhost,
with host memory from the kit's
:class:`~kvproto_transports.conformance.hostmem.HostMemory`. ``kill`` destroys
the endpoint without a goodbye: its engine's listener and TCP server close as
they would when its process dies, which is what peers' probes and reads see.
The real ``kill -9`` of a separate process is in ``tests/transports/mooncake``.
"""

from __future__ import annotations

from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.conformance.hostgroup import HostMemoryGroup

from .transport import DEFAULT_MAX_NOTIFICATION_SIZE, MooncakeTransport

KILL_SLACK_S = 1.2
"""Added to the declared detection bound by the kit: ``kill`` destroys the engine, which
holds the GIL for ~1 s (its listener's accept timeout) before peers can see it gone;
a ``kill -9`` of a process has no such delay."""


class MooncakeGroup(HostMemoryGroup[MooncakeTransport]):
    """``size`` Mooncake endpoints ``ep0..`` in this process."""

    keep_killed_memory = True  # a peer's read may still be in the dead engine's TCP server

    def __init__(
        self, size: int, *, max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE
    ) -> None:
        self._max = max_notification_size
        super().__init__(size)

    def _new(self, index: int) -> MooncakeTransport:
        return MooncakeTransport(name_prefix=f"ep{index}", max_notification_size=self._max)

    def _kill(self, endpoint: MooncakeTransport) -> None:
        endpoint.close()  # no goodbye exists: peers find out from probes and reads


def conformance_factory() -> TransportFactory:
    """The Mooncake transport as the conformance kit runs it."""
    return TransportFactory(
        name="mooncake",
        create_group=MooncakeGroup,
        detection_slack_s=KILL_SLACK_S,
    )
