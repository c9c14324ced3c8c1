"""What a transport author provides to run the conformance kit.

Two objects:

* :class:`EndpointGroup` — ``size`` endpoints that can reach each other, plus
  the hooks the kit needs and the Transport protocol does not offer: host
  memory to register and inspect, a clock, and (optionally) killing and
  restarting an endpoint.
* :class:`TransportFactory` — a name, a function that makes a fresh group,
  the cases the transport declares unsupported, and the kit's tolerances.

Time. The kit never sleeps and never reads a clock for protocol time: it asks
the group. :meth:`EndpointGroup.now` is the group's clock and
:meth:`EndpointGroup.wait` lets up to ``max_s`` of it pass. A simulated
transport (loopback) jumps its virtual clock to the next event, so timeouts
cost nothing; a real transport (NIXL, UCX) subclasses :class:`RealTimeGroup`,
whose clock is ``time.monotonic`` and whose ``wait`` sleeps a tick. Only the
"never blocks" cases use the wall clock, because blocking is about wall time.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport


class EndpointGroup(abc.ABC):
    """``size`` connected endpoints of one transport, fresh for one case.

    "Connected" means each endpoint can ``add_peer`` any other's
    ``metadata()``; the kit exchanges metadata itself, because that is part
    of what it tests. Index ``i`` always names the same slot; :meth:`restart`
    puts the new incarnation in the same slot.
    """

    can_kill: bool = False
    """Whether :meth:`kill` works; cases that need it are UNSUPPORTED otherwise."""
    can_restart: bool = False
    """Whether :meth:`restart` works."""

    @property
    @abc.abstractmethod
    def endpoints(self) -> Sequence[Transport]:
        """The endpoints, by slot. The kit calls them only from the thread that made the group."""

    @abc.abstractmethod
    def now(self) -> float:
        """The group's clock, in seconds (virtual for a simulated transport)."""

    @abc.abstractmethod
    def wait(self, max_s: float) -> None:
        """Let at most ``max_s`` seconds of the group's clock pass.

        May return early (as soon as something may have happened), so the
        kit polls and calls it again. Must not block longer than ``max_s``.
        """

    @abc.abstractmethod
    def allocate(
        self, index: int, *, num_regions: int, block_len: int, num_blocks: int
    ) -> BlockLayout:
        """Memory for endpoint ``index`` that its ``register_blocks`` accepts; zero filled."""

    @abc.abstractmethod
    def write_block(
        self, index: int, layout: BlockLayout, region: int, block: int, data: bytes
    ) -> None:
        """Overwrite one whole block of endpoint ``index``'s memory (data is one block long)."""

    @abc.abstractmethod
    def read_block(self, index: int, layout: BlockLayout, region: int, block: int) -> bytes:
        """The bytes of one whole block of endpoint ``index``'s memory, as visible now."""

    def kill(self, index: int) -> None:
        """Kill endpoint ``index`` abruptly (like ``kill -9``); the kit never calls it again."""
        raise NotImplementedError("this group cannot kill an endpoint")

    def restart(self, index: int) -> Transport:
        """Kill endpoint ``index`` if alive and start a new incarnation in its slot."""
        raise NotImplementedError("this group cannot restart an endpoint")

    def close(self) -> None:
        """Release everything. The default closes every endpoint and ignores their errors."""
        for ep in self.endpoints:
            with contextlib.suppress(Exception):  # teardown must reach every endpoint
                ep.close()


class RealTimeGroup(EndpointGroup):
    """Base for transports that run in wall time: ``now`` is monotonic, ``wait`` sleeps a tick."""

    tick_s: float = 0.001
    """How long one ``wait`` sleeps at most; short, because the kit polls after each."""

    def now(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wait(self, max_s: float) -> None:
        """Sleep ``min(max_s, tick_s)``."""
        if max_s > 0:
            time.sleep(min(max_s, self.tick_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportFactory:
    """Everything the kit needs to test one transport. Entry points return one of these."""

    name: str
    """The transport's name, as in reports and ``--transport``."""
    create_group: Callable[[int], EndpointGroup]
    """Make ``size`` fresh endpoints; called once per case."""
    unsupported: Mapping[str, str] = field(default_factory=dict)
    """Case id -> why this transport does not support it (verdict UNSUPPORTED)."""
    timeout_s: float = 10.0
    """Longest the kit waits (group clock) for anything that must happen; then it calls a hang."""
    settle_s: float = 0.25
    """Quiet period (group clock) after the expected events, to catch extra or late ones."""
    poll_block_bound_s: float = 0.25
    """Wall seconds one ``poll`` may take before the kit calls it blocking."""
    send_block_bound_s: float = 0.25
    """Wall seconds one ``send`` may take before the kit calls it blocking."""
    detection_slack_s: float = 0.0
    """Added to the declared failure-detection bound (polling granularity of real transports)."""
    resource_cycles: int = 100_000
    """Send/poll cycles of the memory-bound case."""
    memory_growth_per_cycle: float = 4.0
    """Bytes per cycle the resource case may leave allocated (a leaked object is >= 16 B)."""
