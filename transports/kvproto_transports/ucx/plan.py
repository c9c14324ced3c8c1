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
from typing import NamedTuple

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import MemoryNotRegistered

from ..read_args import check_block_counts, check_regions, region_spans


class Segment(NamedTuple):
    """One contiguous copy of a read.

    A named tuple, not a frozen dataclass: a scattered 64-block read of 8 regions
    builds 512 of them per request, and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) cost about three times as much. Immutable all the same.
    """

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
    # Which block pairs merge depends only on the byte lengths, not on the regions'
    # base addresses: find the runs once per distinct (llen, rlen, length), not once
    # per region (the per-pair loop was ~200 us of a 64-block, 8-region request).
    runs_by_lengths: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for region in range(local.num_regions):
        loff, roff, length = region_spans(local, remote, region, local_slice, remote_slice)
        llen, rlen = local.block_lens[region], remote.block_lens[region]
        lbase, rbase = local.region_addrs[region] + loff, remote.region_addrs[region] + roff
        key = (llen, rlen, length)
        runs = runs_by_lengths.get(key)
        if runs is None:
            runs = runs_by_lengths[key] = _runs(local_blocks, remote_blocks, llen, rlen, length)
        for first, count in runs:
            out.append(
                Segment(
                    region=region,
                    local_addr=lbase + local_blocks[first] * llen,
                    remote_addr=rbase + remote_blocks[first] * rlen,
                    length=count * length,
                )
            )
    return out


def _runs(
    local_blocks: Sequence[int], remote_blocks: Sequence[int], llen: int, rlen: int, length: int
) -> list[tuple[int, int]]:
    """``(index of the first pair, pairs)`` of each run contiguous on both sides.

    Offsets are relative to the region's base (contiguity does not depend on it).
    """
    runs: list[tuple[int, int]] = []
    first = 0
    run_l = run_r = run_n = -1
    for i, (lb, rb) in enumerate(zip(local_blocks, remote_blocks, strict=True)):
        la, ra = lb * llen, rb * rlen
        if run_n > 0 and run_l + run_n == la and run_r + run_n == ra:
            run_n += length  # contiguous on both sides: extend the run
            continue
        if run_n > 0:
            runs.append((first, run_n // length))
        first, run_l, run_r, run_n = i, la, ra, length
    if run_n > 0:
        runs.append((first, run_n // length))
    return runs
