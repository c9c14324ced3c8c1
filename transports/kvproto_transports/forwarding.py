"""A Transport that forwards every call to another one: the base of transport wrappers.

A wrapper that changes one behaviour of an endpoint (the simulator's view of a
rank, which delays reads and counts heartbeats; the conformance suite's
deliberately broken transports) subclasses :class:`ForwardingTransport` and
overrides only that call, instead of spelling out the whole protocol again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    Capabilities,
    PeerId,
    ReadId,
    Transport,
    TransportEvent,
    WritableTransport,
    WriteId,
)

T = TypeVar("T", bound=Transport)
W = TypeVar("W", bound=WritableTransport)


class ForwardingTransport(Generic[T]):
    """Every :class:`~kvproto.transport.Transport` call goes to :attr:`inner` unchanged."""

    def __init__(self, inner: T) -> None:
        self.inner = inner
        """The endpoint this one forwards to."""

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def local_peer(self) -> PeerId:
        return self.inner.local_peer

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> PeerId:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: PeerId) -> None:
        self.inner.remove_peer(peer)

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(peer, payload)

    def poll(self) -> Sequence[TransportEvent]:
        return self.inner.poll()

    def register_blocks(self, layout: BlockLayout) -> None:
        self.inner.register_blocks(layout)

    def read_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> ReadId:
        return self.inner.read_blocks(
            peer,
            local_blocks=local_blocks,
            remote_blocks=remote_blocks,
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
        )

    def close(self) -> None:
        self.inner.close()


class ForwardingWrites(ForwardingTransport[W]):
    """:class:`ForwardingTransport` of a :class:`~kvproto.transport.WritableTransport`:
    ``write_blocks`` goes to :attr:`inner` unchanged too."""

    def write_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> WriteId:
        return self.inner.write_blocks(
            peer,
            local_blocks=local_blocks,
            remote_blocks=remote_blocks,
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
        )
