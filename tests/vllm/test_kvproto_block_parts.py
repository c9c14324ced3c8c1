"""Larger decoder blocks filled from smaller holder blocks: the plan and the page regrouping.

The pages are real tensors in vLLM's two layouts; a holder block "read" into a
part is the byte copy a READ makes (the transports are tested to move exactly
those bytes, tests/transports/test_binding_loopback.py), so the page the
decoder ends with must equal the page it would have computed itself.
"""

from __future__ import annotations

import pytest

from kvproto.tpmath import BlockLayout
from kvproto_vllm.block_parts import CannotRegroup, PagedRegions, paged_regions
from kvproto_vllm.groups import block_ratio, last_parts, pair_blocks

torch = pytest.importorskip("torch")

HEADS, HOLDER_BLOCK, DIM = 2, 4, 3
"""Page geometry of the regrouping tests: 2 heads, holder blocks of 4 tokens, head size 3."""
FIRST = 10
"""The holder's first block id in the regrouping tests."""


def test_ratio_is_the_local_block_over_the_holders_and_refuses_the_reverse() -> None:
    assert block_ratio(64, 32) == 2 and block_ratio(32, 32) == 1
    assert "does not divide" in str(block_ratio(32, 64))
    assert "does not divide" in str(block_ratio(48, 32))
    assert "bad block sizes" in str(block_ratio(32, 0))


@pytest.mark.parametrize(
    ("tokens", "want"), [(1, 1), (32, 1), (33, 2), (64, 2), (65, 1), (100, 2), (0, 2)]
)
def test_last_parts_counts_the_holder_blocks_in_the_last_local_block(
    tokens: int, want: int
) -> None:
    assert last_parts(tokens, 32, 2) == want


def test_parts_pair_in_token_order_and_the_tail_part_is_not_read() -> None:
    # 100 tokens: holder blocks of 32 are 4 (10..13), local blocks of 64 are 2 (7, 8);
    # the last local block holds 2 holder blocks' worth... of which 100 - 96 tokens.
    pairs = pair_blocks([[7, 8]], [[10, 11, 12, 13]], ratio=2, tail_parts=last_parts(100, 32, 2))
    assert (pairs.local, pairs.parts, pairs.remote) == (
        [7, 7, 8, 8],
        [0, 1, 0, 1],
        [10, 11, 12, 13],
    )
    # 70 tokens: 3 holder blocks; part 1 of block 8 lies past the prompt.
    pairs = pair_blocks([[7, 8]], [[10, 11, 12]], ratio=2, tail_parts=last_parts(70, 32, 2))
    assert (pairs.local, pairs.parts, pairs.remote) == ([7, 7, 8], [0, 1, 0], [10, 11, 12])
    assert pairs.filled == [7, 8] and pairs.ratio == 2


def test_a_partial_local_hit_fills_the_tail_parts_and_a_window_may_reach_further() -> None:
    # Block 7 was a local hit: only block 8 is filled, from the holder's last two blocks.
    pairs = pair_blocks([[8]], [[10, 11, 12, 13]], ratio=2, tail_parts=2)
    assert (pairs.local, pairs.parts, pairs.remote) == ([8, 8], [0, 1], [12, 13])
    # A window group: the holder kept 3 blocks (one of them null, out of its window),
    # the decoder's 2-block tail reaches 4 holder blocks back: the rest stays unread.
    pairs = pair_blocks(
        [[5, 6], [20, 21]],
        [[1, 2, 3, 4], [0, 31, 32]],
        ratio=2,
        tail_parts=2,
        windowed=[False, True],
    )
    assert pairs.local == [5, 5, 6, 6, 21, 21]
    assert pairs.remote == [1, 2, 3, 4, 31, 32]
    assert pairs.parts == [0, 1, 0, 1, 0, 1]
    assert pairs.filled == [5, 6, 20, 21]
    # A full-attention group short of blocks cannot be filled.
    with pytest.raises(ValueError, match="group 0: 4 local block parts \\(of 2\\) to fill"):
        pair_blocks([[5, 6]], [[1, 2, 3]], ratio=2, tail_parts=2)


def _kv(tokens: int) -> torch.Tensor:
    """A layer's KV for ``tokens`` positions, [tokens, HEADS, 2 (key, value), DIM], unique."""
    return (
        torch.arange(tokens * HEADS * 2 * DIM, dtype=torch.float32).view(tokens, HEADS, 2, -1) + 1
    )


def _page(kv: torch.Tensor, backend: str) -> torch.Tensor:
    """The page bytes of one block's tokens ``kv`` as ``backend`` lays them out.

    CPU_ATTN: ``[H, N, 2D]`` whose kernel reads ``[H, 2N, D]`` -- per head, every key of
    the block, then every value (``cpu_attn.py``); CPU_MLA: token-major, one token's
    whole latent after another."""
    page = kv.permute(1, 2, 0, 3) if backend == "CPU_ATTN" else kv
    return page.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "CPU_MLA"])
@pytest.mark.parametrize("ratio", [2, 4])
def test_regrouped_parts_equal_the_page_the_decoder_would_have_written(
    backend: str, ratio: int
) -> None:
    local_block = HOLDER_BLOCK * ratio
    tokens = 2 * local_block - HOLDER_BLOCK - 1  # the last local block: one part unread
    kv = _kv(tokens)
    num_blocks, page_bytes = 4, HEADS * local_block * 2 * DIM * 4
    memory = torch.full((2 * num_blocks * page_bytes,), 0xEE, dtype=torch.uint8)  # stale
    base = memory.data_ptr()
    layout = BlockLayout(
        region_addrs=(base, base + num_blocks * page_bytes),
        block_lens=(page_bytes, page_bytes),
        num_blocks=num_blocks,
    )
    regions = paged_regions(layout, [memory], [HEADS, HEADS], backend=backend)
    holder_blocks = -(-tokens // HOLDER_BLOCK)
    pairs = pair_blocks(
        [[1, 3]],
        [list(range(FIRST, FIRST + holder_blocks))],  # 0 would be vLLM's null block
        ratio=ratio,
        tail_parts=last_parts(tokens, HOLDER_BLOCK, ratio),
    )
    part_bytes = page_bytes // ratio
    for page in regions.pages:
        for local, part, remote in zip(pairs.local, pairs.parts, pairs.remote, strict=True):
            # What a READ of the holder's page moves: its block of HOLDER_BLOCK tokens.
            first = (remote - FIRST) * HOLDER_BLOCK
            held = torch.zeros(HOLDER_BLOCK, HEADS, 2, DIM)
            span = kv[first : first + HOLDER_BLOCK]
            held[: span.shape[0]] = span  # the holder's last block is part-filled
            page[local, part * part_bytes : (part + 1) * part_bytes] = _page(held, backend)
    regions.regroup(ratio, pairs.local, pairs.parts, pairs.filled)
    for page in regions.pages:
        for i, local in enumerate([1, 3]):
            want = torch.zeros(local_block, HEADS, 2, DIM)
            chunk = kv[i * local_block : (i + 1) * local_block]
            want[: chunk.shape[0]] = chunk  # stale bytes past the last token: zeroed
            assert torch.equal(page[local], _page(want, backend)), (backend, ratio, local)
        assert bool((page[0] == 0xEE).all()) and bool((page[2] == 0xEE).all())  # untouched


def test_pages_that_do_not_split_are_refused_by_name() -> None:
    memory = torch.zeros(4 * 96, dtype=torch.uint8)
    layout = BlockLayout(region_addrs=(memory.data_ptr(),), block_lens=(96,), num_blocks=4)
    with pytest.raises(CannotRegroup, match="FLASH_ATTN is not known"):
        paged_regions(layout, [memory], [2], backend="FLASH_ATTN")
    with pytest.raises(CannotRegroup, match="no registered tensor"):
        paged_regions(layout, [torch.zeros(8, dtype=torch.uint8)], [2], backend="CPU_ATTN")
    regions = paged_regions(layout, [memory], [2], backend="CPU_ATTN")
    assert isinstance(regions, PagedRegions)
    with pytest.raises(CannotRegroup, match="does not split into 5 parts of 4 rows"):
        regions.regroup(5, [1], [0], [1])
