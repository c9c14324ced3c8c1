"""Loopback KV memory: real bytes behind virtual addresses.

Reads must move real data so that tests can see *when* data becomes visible
(the whole point of "notify only after the data left the holder"). Memory is
kept per block and created on first touch, so a simulator may register a
layout of thousands of large blocks and only pay for the blocks it writes or
reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvproto.tpmath import BlockLayout
from kvproto.transport import MemoryNotRegistered

PAGE = 4096
"""Virtual regions are page aligned, like the real allocations they stand for."""


@dataclass(slots=True)
class _Region:
    block_len: int
    num_blocks: int
    blocks: dict[int, bytearray] = field(default_factory=dict)


class AddressSpace:
    """Hands out non-overlapping virtual addresses for every endpoint of one network.

    Distinct endpoints never share an address, so a transport bug that reads
    the wrong peer's memory cannot pass by luck.
    """

    __slots__ = ("_next",)

    def __init__(self, base: int = 0x10_0000_0000) -> None:
        self._next = base

    def take(self, size: int) -> int:
        """Reserve ``size`` bytes; return the page-aligned base address."""
        addr = self._next
        self._next += -(-max(size, 1) // PAGE) * PAGE
        return addr


class Memory:
    """One endpoint's memory: regions by base address, each a sparse array of blocks."""

    __slots__ = ("_regions",)

    def __init__(self) -> None:
        self._regions: dict[int, _Region] = {}

    def add_region(self, addr: int, block_len: int, num_blocks: int) -> None:
        """Back ``num_blocks`` blocks of ``block_len`` bytes at ``addr``."""
        self._regions[addr] = _Region(block_len, num_blocks)

    def adopt(self, layout: BlockLayout) -> None:
        """Back every region of ``layout``; regions already allocated must fit it."""
        for addr, block_len in zip(layout.region_addrs, layout.block_lens, strict=True):
            region = self._regions.get(addr)
            if region is None:
                self.add_region(addr, block_len, layout.num_blocks)
            elif region.block_len != block_len or region.num_blocks < layout.num_blocks:
                raise MemoryNotRegistered(
                    f"region at {addr:#x} holds {region.num_blocks} blocks of "
                    f"{region.block_len} B; layout wants {layout.num_blocks} of {block_len} B"
                )

    def _region(self, addr: int) -> _Region:
        region = self._regions.get(addr)
        if region is None:
            raise MemoryNotRegistered(f"no memory at {addr:#x}")
        return region

    def _block(self, addr: int, block: int) -> bytearray:
        region = self._region(addr)
        if not 0 <= block < region.num_blocks:
            raise MemoryNotRegistered(f"block {block} outside 0..{region.num_blocks - 1}")
        data = region.blocks.get(block)
        if data is None:
            data = region.blocks[block] = bytearray(region.block_len)
        return data

    def read(self, addr: int, block: int, offset: int, length: int) -> bytes:
        """Copy ``length`` bytes at ``offset`` of one block out."""
        data = self._block(addr, block)
        if offset < 0 or offset + length > len(data):
            raise MemoryNotRegistered(f"bytes {offset}..{offset + length} outside the block")
        return bytes(data[offset : offset + length])

    def write(self, addr: int, block: int, offset: int, payload: bytes) -> None:
        """Copy ``payload`` into one block at ``offset``."""
        data = self._block(addr, block)
        if offset < 0 or offset + len(payload) > len(data):
            raise MemoryNotRegistered(f"bytes {offset}..{offset + len(payload)} outside the block")
        data[offset : offset + len(payload)] = payload
