"""An endpoint group of a real transport whose endpoints register host memory by address.

The NIXL and UCX kits differ only in how an endpoint is made, how it is killed
and (NIXL) how a wait drives it; the slots, the per-endpoint
:class:`~kvproto_transports.conformance.hostmem.HostMemory`, the bookkeeping of
dead endpoints, restart and teardown are the same, and live here once.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from kvproto.tpmath import BlockLayout
from kvproto.transport import Transport
from kvproto_transports.conformance.factory import RealTimeGroup
from kvproto_transports.conformance.hostmem import HostMemory

T = TypeVar("T", bound=Transport)


class HostMemoryGroup(RealTimeGroup, Generic[T]):
    """``size`` endpoints ``ep0..`` in this process, each with its own host memory.

    A subclass sets up what :meth:`_new` needs, then calls this constructor.
    """

    can_kill = True
    can_restart = True
    keep_killed_memory: bool = False
    """Keep a killed incarnation's memory until the group goes (the transport may still
    touch it while it tears down); otherwise a restart frees it."""

    def __init__(self, size: int) -> None:
        self._memory = [HostMemory() for _ in range(size)]
        self._dead: set[int] = set()
        self._graveyard: list[HostMemory] = []
        """Memory of killed incarnations, kept when :attr:`keep_killed_memory` says so."""
        self._eps: list[T] = []
        try:
            for i in range(size):
                self._eps.append(self._new(i))
        except BaseException:  # the endpoints made so far must not outlive a failed group
            self.close()
            raise

    @abc.abstractmethod
    def _new(self, index: int) -> T:
        """A fresh endpoint for slot ``index``."""

    @abc.abstractmethod
    def _kill(self, endpoint: T) -> None:
        """Drop ``endpoint`` without a goodbye, as its process's death would."""

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self._eps

    def live(self) -> Iterator[T]:
        """The endpoints not killed (and not yet replaced by a restart)."""
        return (ep for i, ep in enumerate(self._eps) if i not in self._dead)

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
        self._kill(self._eps[index])
        self._dead.add(index)

    def restart(self, index: int) -> Transport:
        if index not in self._dead:
            self.kill(index)
        if self.keep_killed_memory:
            self._graveyard.append(self._memory[index])
        self._memory[index] = HostMemory()
        self._eps[index] = self._new(index)
        self._dead.discard(index)
        return self._eps[index]

    def close(self) -> None:
        for ep in self.live():
            with contextlib.suppress(Exception):  # teardown must reach every endpoint
                ep.close()
