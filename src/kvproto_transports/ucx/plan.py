"""Which bytes a read moves: pure arithmetic on two layouts (kvproto.tpmath).

A read of blocks ``local_blocks <- remote_blocks`` of every region becomes a
list of ``(local address, remote address, length)`` segments, one per
region and block pair, cut to the slices (heterogeneous TP). Neighbouring
segments that are contiguous on both sides are merged, so a run of
consecutive whole blocks is one UCP ``get`` per region.

Every address is checked against the registered layouts *before* anything
is issued: a UCP ``get`` outside the holder's registered memory is not a
clean error (measured: over TCP it crashed the holder with SIGSEGV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import MemoryNotRegistered

from ..read_args import check_block_counts, check_regions, region_spans


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """One contiguous copy of a read."""

    region: int
    """Region index (selects the remote key)."""
    local_addr: int
    """Destination address in local registered memory."""
    remote_addr: int
    """Source address in the peer's registered memory."""
    length: int
    """Bytes."""


def plan_read(
    local: BlockLayout,
    remote: BlockLayout,
    *,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    local_slice: BlockSlice = BlockSlice.FULL,
    remote_slice: BlockSlice = BlockSlice.FULL,
) -> list[Segment]:
    """Segments of the read, merged; raises LayoutMismatch or MemoryNotRegistered."""
    check_block_counts(local_blocks, remote_blocks)
    check_regions(local, remote)
    # tpmath.descriptor_ids' range rule (0 <= block < num_blocks), without
    # building the id lists: UCX works on addresses, not descriptor ids.
    for side, blocks, layout in (("local", local_blocks, local), ("remote", remote_blocks, remote)):
        if blocks and (min(blocks) < 0 or max(blocks) >= layout.num_blocks):
            raise MemoryNotRegistered(
                f"{side} block outside 0..{layout.num_blocks - 1}: {sorted(set(blocks))[:8]}"
            )
    out: list[Segment] = []
    for region in range(local.num_regions):
        loff, roff, length = region_spans(local, remote, region, local_slice, remote_slice)
        llen, rlen = local.block_lens[region], remote.block_lens[region]
        lbase, rbase = local.region_addrs[region] + loff, remote.region_addrs[region] + roff
        run_l = run_r = run_n = -1
        for lb, rb in zip(local_blocks, remote_blocks, strict=True):
            la, ra = lbase + lb * llen, rbase + rb * rlen
            if run_n > 0 and run_l + run_n == la and run_r + run_n == ra:
                run_n += length  # contiguous on both sides: extend the run
                continue
            if run_n > 0:
                out.append(
                    Segment(region=region, local_addr=run_l, remote_addr=run_r, length=run_n)
                )
            run_l, run_r, run_n = la, ra, length
        if run_n > 0:
            out.append(Segment(region=region, local_addr=run_l, remote_addr=run_r, length=run_n))
    return out
