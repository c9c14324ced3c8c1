"""The checks of ``read_blocks``' arguments that every transport with real memory makes.

NIXL and UCX both refuse a read before anything moves (a transfer outside
the holder's registered memory can crash the holder), with the same errors
and messages; each calls these in its own order (NIXL checks the slices
before the block ranges, UCX after), which is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import FrameTooLarge, LayoutMismatch


def check_notify(notify: bytes | None, max_size: int | None) -> None:
    """Raise FrameTooLarge if the read's notification exceeds ``max_size``."""
    if notify is not None and max_size is not None and len(notify) > max_size:
        raise FrameTooLarge(f"notify of {len(notify)} bytes > {max_size}")


def check_block_counts(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> None:
    """Raise LayoutMismatch unless there is one local block per remote block."""
    if len(local_blocks) != len(remote_blocks):
        raise LayoutMismatch(
            f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks"
        )


def check_regions(local: BlockLayout, remote: BlockLayout) -> None:
    """Raise LayoutMismatch unless both layouts have as many regions."""
    if local.num_regions != remote.num_regions:
        raise LayoutMismatch(f"{local.num_regions} local regions, {remote.num_regions} remote")


def region_spans(
    local: BlockLayout,
    remote: BlockLayout,
    region: int,
    local_slice: BlockSlice,
    remote_slice: BlockSlice,
) -> tuple[int, int, int]:
    """``(local offset, remote offset, length)`` of one region's slices in a block.

    Raises LayoutMismatch if a slice does not divide its block or the two
    slices differ in length.
    """
    llen, rlen = local.block_lens[region], remote.block_lens[region]
    try:
        loff, length = local_slice.span(llen)
        roff, rlength = remote_slice.span(rlen)
    except LocalProtocolError as exc:
        raise LayoutMismatch(str(exc)) from exc
    if length != rlength:
        raise LayoutMismatch(
            f"region {region}: local slice of {llen} bytes/{local_slice.parts} "
            f"!= remote slice of {rlen} bytes/{remote_slice.parts}"
        )
    return loff, roff, length
