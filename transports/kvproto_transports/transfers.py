"""What a transport that both reads and writes shares: one transfer path, two entry points.

A read and a write (push mode) move the same bytes between the same two layouts, in
opposite directions: the checks of the blocks and slices, the descriptor lists or
segments, the notify that must follow the data, and the way an outcome is reported
are one code path in each transport (``_transfer``). :class:`Transfers` gives it the
two calls of the protocol, :func:`outcome` the event that ends either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvproto.tpmath import BlockSlice
from kvproto.transport import (
    PeerId,
    ReadCompleted,
    ReadFailed,
    ReadId,
    TransportEvent,
    WriteCompleted,
    WriteFailed,
    WriteId,
)


class Transfers(ABC):
    """``read_blocks`` and ``write_blocks`` of a transport, both through ``_transfer``.

    The two calls keep the protocol's signatures (:class:`kvproto.transport.Transport`,
    :class:`kvproto.transport.WritableTransport`); what each transport checks and raises
    is in its ``_transfer``'s docstring.
    """

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
        """One READ of ``remote_blocks`` of every region of ``peer`` into ``local_blocks``;
        ``notify`` reaches the peer only after the data left its memory."""
        return self._transfer(
            peer,
            local_blocks=local_blocks,
            remote_blocks=remote_blocks,
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
            write=False,
        )

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
        """One WRITE of ``local_blocks`` of every region into ``peer``'s ``remote_blocks`` (push
        mode); ``notify`` reaches the peer only after the data is in its memory, and the
        write is reported complete only then (remote completion)."""
        return self._transfer(
            peer,
            local_blocks=local_blocks,
            remote_blocks=remote_blocks,
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
            write=True,
        )

    @abstractmethod
    def _transfer(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice,
        remote_slice: BlockSlice,
        notify: bytes | None,
        write: bool,
    ) -> int:
        """Issue one transfer; its id (reads and writes share the counter)."""


def count(stats: object, *, write: bool, failed: str | None) -> None:
    """Bump ``stats``' counter of this outcome: ``reads_`` or ``writes_`` + ``completed`` or
    ``failed`` (the names NIXL's and UCX's stats use)."""
    name = ("writes_" if write else "reads_") + ("completed" if failed is None else "failed")
    setattr(stats, name, getattr(stats, name) + 1)


def outcome(transfer_id: int, *, write: bool, failed: str | None) -> TransportEvent:
    """The event that ends a transfer: completed (``failed`` None) or failed, read or write."""
    if write:
        if failed is None:
            return WriteCompleted(write_id=transfer_id)
        return WriteFailed(write_id=transfer_id, reason=failed)
    if failed is None:
        return ReadCompleted(read_id=transfer_id)
    return ReadFailed(read_id=transfer_id, reason=failed)
