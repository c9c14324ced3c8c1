"""Tensor-parallel and descriptor arithmetic, as pure functions.

Follows the NIXL transfer flow of vLLM's NixlConnector (spec/vllm-api.md §9):

* KV memory is a set of *regions* (one per layer, or per layer and K/V), each
  holding ``num_blocks`` blocks of ``block_len`` bytes. A descriptor list
  holds ``num_regions x num_blocks`` entries and
  ``desc_id = region * num_blocks + block``.
* ``tp_ratio = local_tp // remote_tp`` when the reader has at least as many
  ranks as the holder, else ``-(remote_tp // local_tp)``.
* With ``tp_ratio > 1`` several reader ranks share one holder rank and each
  reads its slice ``tp_rank % tp_ratio`` of every remote block. With
  ``tp_ratio < 0`` one reader rank reads whole blocks from ``|tp_ratio|``
  holder ranks, each into its own slice of the local block.
* Replicated KV (MLA: every rank holds the whole latent cache, no head
  split): a reader rank reads whole blocks from one holder rank, the one
  stock NixlConnector picks, and sends the others of its target ranks only
  the completion notification (:func:`part_slices`). Which ranks it
  heartbeats and how many dones a holder rank waits for are unchanged, so a
  holder rank nobody reads from still frees at once. A writer (push mode)
  writes the whole latent into every holder rank instead, each once
  (:func:`write_slices`).
* A partial prefix hit reads only the tail of the remote blocks; zero local
  blocks means nothing to read, only the completion notification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvproto.errors import LocalProtocolError


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSlice:
    """Part ``index`` of ``parts`` equal parts of every block (heterogeneous TP)."""

    index: int
    """Which part, ``0 <= index < parts``."""
    parts: int
    """How many equal parts each block is cut into; 1 means the whole block."""

    FULL: ClassVar[BlockSlice]

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise LocalProtocolError(f"bad block slice {self.index}/{self.parts}")

    def span(self, block_len: int) -> tuple[int, int]:
        """(offset, length) in bytes of this slice inside a block of ``block_len`` bytes."""
        if block_len % self.parts:
            raise LocalProtocolError(
                f"block of {block_len} bytes does not split into {self.parts} parts"
            )
        length = block_len // self.parts
        return self.index * length, length


BlockSlice.FULL = BlockSlice(index=0, parts=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockLayout:
    """Registered KV memory: ``len(region_addrs)`` regions of ``num_blocks`` blocks."""

    region_addrs: tuple[int, ...]
    """Base address of each region (a layer, or a layer's K or V)."""
    block_lens: tuple[int, ...]
    """Bytes per block in each region."""
    num_blocks: int
    """Blocks per region."""
    device_id: int = 0
    """Device index the memory lives on."""
    memory_kind: str = "DRAM"
    """``"DRAM"`` or ``"VRAM"``, as NIXL names them."""

    def __post_init__(self) -> None:
        if len(self.region_addrs) != len(self.block_lens):
            raise LocalProtocolError("one block length per region is required")
        if not self.region_addrs or self.num_blocks < 1:
            raise LocalProtocolError("a layout needs at least one region and one block")
        if any(n <= 0 for n in self.block_lens):
            raise LocalProtocolError("block lengths must be positive")

    @property
    def num_regions(self) -> int:
        """Number of regions."""
        return len(self.region_addrs)

    def descriptors(self, block_slice: BlockSlice = BlockSlice.FULL) -> list[tuple[int, int]]:
        """(address, length) of every descriptor, in ``desc_id`` order."""
        out: list[tuple[int, int]] = []
        for base, block_len in zip(self.region_addrs, self.block_lens, strict=True):
            offset, length = block_slice.span(block_len)
            out.extend((base + b * block_len + offset, length) for b in range(self.num_blocks))
        return out


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """vLLM's signed ratio: ``local//remote`` if local >= remote else ``-(remote//local)``."""
    if local_tp < 1 or remote_tp < 1:
        raise LocalProtocolError("TP sizes must be positive")
    big, small = max(local_tp, remote_tp), min(local_tp, remote_tp)
    if big % small:
        raise LocalProtocolError(f"TP sizes {local_tp} and {remote_tp} do not divide")
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


def target_remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The holder ranks a reader rank reads from (and heartbeats)."""
    _check_rank(local_rank, local_tp)
    r = tp_ratio(local_tp, remote_tp)
    if r > 0:
        return [local_rank // r]
    return [local_rank * -r + i for i in range(-r)]


def holder_ranks(local_rank: int, local_tp: int, holder_tp: int) -> tuple[int, ...]:
    """:func:`target_remote_ranks` of a ticket's holder TP size; () if the sizes do not
    divide (a ticket is peer data: an impossible layout fails its request, not the reader)."""
    big, small = max(local_tp, holder_tp), min(local_tp, holder_tp)
    if small < 1 or big % small:
        return ()
    return tuple(target_remote_ranks(local_rank, local_tp, holder_tp))


def expected_consumers(holder_tp: int, reader_tp: int) -> int:
    """How many reader ranks read from each holder rank, hence its done count."""
    r = tp_ratio(reader_tp, holder_tp)
    return r if r > 0 else 1


def read_slices(
    local_rank: int, local_tp: int, remote_tp: int, remote_rank: int
) -> tuple[BlockSlice, BlockSlice]:
    """(local_slice, remote_slice) for a reader rank's read from one holder rank."""
    targets = target_remote_ranks(local_rank, local_tp, remote_tp)
    if remote_rank not in targets:
        raise LocalProtocolError(f"rank {local_rank} does not read from remote rank {remote_rank}")
    r = tp_ratio(local_tp, remote_tp)
    if r > 0:
        return BlockSlice.FULL, BlockSlice(index=local_rank % r, parts=r)
    return BlockSlice(index=targets.index(remote_rank), parts=-r), BlockSlice.FULL


def part_slices(
    local_rank: int, local_tp: int, remote_tp: int, remote_rank: int, *, replicated: bool
) -> tuple[BlockSlice, BlockSlice] | None:
    """What a reader rank reads from one of its holder ranks: (local, remote) slices, or
    None when it reads nothing there and only sends the done (replicated KV).

    Without replication this is :func:`read_slices`. With it every block is whole on
    both sides and only the first target rank is read -- ``local_rank * remote_tp //
    local_tp``, as stock NixlConnector reads MLA (``tp_mapping.compute_tp_mapping``).
    """
    if not replicated:
        return read_slices(local_rank, local_tp, remote_tp, remote_rank)
    targets = target_remote_ranks(local_rank, local_tp, remote_tp)
    if remote_rank not in targets:
        raise LocalProtocolError(f"rank {local_rank} does not read from remote rank {remote_rank}")
    return (BlockSlice.FULL, BlockSlice.FULL) if remote_rank == targets[0] else None


def write_slices(
    local_rank: int, local_tp: int, remote_tp: int, remote_rank: int, *, replicated: bool
) -> tuple[BlockSlice, BlockSlice] | None:
    """What a writer rank (push mode) writes into one of its holder ranks: (local, remote)
    slices, or None when it writes nothing there and only sends the done.

    Without replication this is :func:`read_slices`: a write moves the bytes a read
    of the same pair of ranks would, the other way. With it every holder rank keeps
    the whole latent, so each must receive all of it: a writer rank with several
    target ranks writes whole blocks into every one of them, and of the writer ranks
    that share one holder rank only the first (``local_rank % ratio == 0``) writes,
    the others send their done alone. Which ranks a writer heartbeats and how many
    dones a holder rank waits for are unchanged.
    """
    if not replicated:
        return read_slices(local_rank, local_tp, remote_tp, remote_rank)
    targets = target_remote_ranks(local_rank, local_tp, remote_tp)
    if remote_rank not in targets:
        raise LocalProtocolError(f"rank {local_rank} does not write to remote rank {remote_rank}")
    ratio = tp_ratio(local_tp, remote_tp)
    return None if ratio > 1 and local_rank % ratio else (BlockSlice.FULL, BlockSlice.FULL)


def descriptor_ids(block_ids: Sequence[int], num_regions: int, num_blocks: int) -> list[int]:
    """``region * num_blocks + block`` for every region, then every block (one READ)."""
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise LocalProtocolError(f"block {b} outside 0..{num_blocks - 1}")
    return [region * num_blocks + b for region in range(num_regions) for b in block_ids]


def blocks_to_read(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[int]:
    """The remote blocks a partial prefix hit still needs: the tail, one per local block."""
    if len(local_block_ids) > len(remote_block_ids):
        raise LocalProtocolError("more local blocks than the holder has")
    if not local_block_ids:
        return []
    return list(remote_block_ids[-len(local_block_ids) :])


def _check_rank(rank: int, tp: int) -> None:
    if not 0 <= rank < tp:
        raise LocalProtocolError(f"rank {rank} outside TP size {tp}")
