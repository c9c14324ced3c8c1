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

from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.conformance.hostgroup import HostMemoryGroup

from .transport import DEFAULT_MAX_NOTIFICATION_SIZE, NixlTransport

PROBE_INTERVAL_S = 0.1
"""Auto-probe period of the kit's endpoints (declared bound: this + 0.5 s)."""


class NixlGroup(HostMemoryGroup[NixlTransport]):
    """``size`` NIXL endpoints ``ep0..`` in this process."""

    keep_killed_memory = True  # NIXL may still deregister it while a killed agent tears down

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
        super().__init__(size)

    def _new(self, index: int) -> NixlTransport:
        return NixlTransport(name_prefix=f"ep{index}", **self._options)  # type: ignore[arg-type]

    def _kill(self, endpoint: NixlTransport) -> None:
        endpoint.abort()

    def wait(self, max_s: float) -> None:
        for ep in self.live():
            with contextlib.suppress(Exception):  # a closed endpoint: the kit's business
                ep.progress()
        super().wait(max_s)


def conformance_factory() -> TransportFactory:
    """The NIXL transport as the conformance kit runs it."""
    return TransportFactory(
        name="nixl",
        create_group=NixlGroup,
        # Real time: a tick of polling granularity on top of the declared bound.
        detection_slack_s=0.1,
    )
