"""Host (DRAM) buffers with real addresses, for factories of transports that register memory
by address (NIXL ``DRAM``, UCX ``mem_map``). A factory's ``allocate``/``write_block``/
``read_block`` can delegate to one :class:`HostMemory` per endpoint.
"""

from __future__ import annotations

import ctypes

from kvproto.tpmath import BlockLayout


class HostMemory:
    """Zeroed ctypes buffers, one per region; kept alive as long as this object lives."""

    def __init__(self) -> None:
        self._buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def allocate(
        self, *, num_regions: int, block_len: int, num_blocks: int, device_id: int = 0
    ) -> BlockLayout:
        """``num_regions`` regions of ``num_blocks`` blocks of ``block_len`` bytes."""
        addrs = []
        for _ in range(num_regions):
            buf = ctypes.create_string_buffer(block_len * num_blocks)
            addr = ctypes.addressof(buf)
            self._buffers[addr] = buf
            addrs.append(addr)
        return BlockLayout(
            region_addrs=tuple(addrs),
            block_lens=(block_len,) * num_regions,
            num_blocks=num_blocks,
            device_id=device_id,
            memory_kind="DRAM",
        )

    def buffer(self, addr: int) -> ctypes.Array[ctypes.c_char]:
        """The buffer behind a region address (for APIs that want an object, not an address)."""
        return self._buffers[addr]

    def _addr(self, layout: BlockLayout, region: int, block: int) -> tuple[int, int]:
        base = layout.region_addrs[region]
        if base not in self._buffers:
            raise KeyError(f"region {region} at {base:#x} is not this HostMemory's")
        if not 0 <= block < layout.num_blocks:
            raise IndexError(f"block {block} outside 0..{layout.num_blocks - 1}")
        length = layout.block_lens[region]
        return base + block * length, length

    def write_block(self, layout: BlockLayout, region: int, block: int, data: bytes) -> None:
        """Overwrite one whole block."""
        addr, length = self._addr(layout, region, block)
        if len(data) != length:
            raise ValueError(f"{len(data)} bytes for a block of {length}")
        ctypes.memmove(addr, data, length)

    def read_block(self, layout: BlockLayout, region: int, block: int) -> bytes:
        """The bytes of one whole block."""
        addr, length = self._addr(layout, region, block)
        return ctypes.string_at(addr, length)
