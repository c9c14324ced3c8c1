"""KV block memory: an engine's block pool, and the bytes every block should hold.

A freed block goes to the top of the free list and the next prefill takes it
first, so blocks freed while a reader still reads them really are
overwritten, as on a busy GPU. Every block carries real bytes in the loopback
transport's memory: 16 bytes per KV head identifying (content, block, head),
so a reader can check exactly what it received.
"""

from __future__ import annotations

import struct

HEADS = 4
"""KV heads of the simulated model (split across TP ranks)."""
HEAD_BYTES = 16
"""Bytes per head per block in the simulation."""
_MAGIC = 0x4B56


def block_len(tp: int) -> int:
    """Bytes per block on one rank of a TP-``tp`` engine."""
    return HEADS // tp * HEAD_BYTES


def rank_heads(rank: int, tp: int) -> range:
    """The KV heads a rank holds."""
    per = HEADS // tp
    return range(rank * per, (rank + 1) * per)


def block_bytes(content: int, index: int, heads: range) -> bytes:
    """What block ``index`` of content ``content`` holds for ``heads``."""
    return b"".join(struct.pack("<IIHHI", content & 0xFFFFFFFF, index, h, _MAGIC, 0) for h in heads)


class BlockPool:
    """An engine's KV blocks: which are free, and which hold what."""

    __slots__ = ("_free", "owner")

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))
        self.owner: list[object | None] = [None] * num_blocks
        """Per block: the object (a hold or a request) using it, or None when free."""

    def allocate(self, n: int, owner: object) -> list[int] | None:
        """Take ``n`` blocks for ``owner`` (most recently freed first), or None if too few."""
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.owner[b] = owner
        return blocks

    def release(self, blocks: list[int], owner: object) -> int:
        """Free ``owner``'s blocks; returns how many were not owned by it (double frees)."""
        bad = 0
        for b in blocks:
            if self.owner[b] is not owner:
                bad += 1
                continue
            self.owner[b] = None
            self._free.append(b)
        return bad

    def owns(self, blocks: list[int], owner: object) -> bool:
        """Whether every block still belongs to ``owner`` (not freed, not reused)."""
        own = self.owner
        return all(own[b] is owner for b in blocks)

    @property
    def free(self) -> int:
        """Free blocks."""
        return len(self._free)
