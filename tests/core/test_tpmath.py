"""TP and descriptor arithmetic against vLLM 0.32.0's (spec/vllm-api.md §9)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import (
    BlockLayout,
    BlockSlice,
    blocks_to_read,
    descriptor_ids,
    expected_consumers,
    part_slices,
    read_slices,
    target_remote_ranks,
    tp_ratio,
    write_slices,
)


@pytest.mark.parametrize(
    ("local", "remote", "ratio"),
    [(1, 1, 1), (2, 1, 2), (4, 2, 2), (8, 1, 8), (1, 2, -2), (2, 4, -2), (1, 8, -8), (4, 4, 1)],
)
def test_tp_ratio_both_signs(local: int, remote: int, ratio: int) -> None:
    assert tp_ratio(local, remote) == ratio


@pytest.mark.parametrize(("local", "remote"), [(3, 2), (2, 3), (0, 1), (1, 0), (-2, 1), (6, 4)])
def test_tp_ratio_refuses_non_dividing_or_empty(local: int, remote: int) -> None:
    with pytest.raises(LocalProtocolError):
        tp_ratio(local, remote)


@pytest.mark.parametrize(
    ("rank", "local", "remote", "targets"),
    [
        (0, 1, 1, [0]),
        (0, 4, 2, [0]),  # tp_rank // r
        (1, 4, 2, [0]),
        (2, 4, 2, [1]),
        (3, 4, 2, [1]),
        (0, 1, 2, [0, 1]),  # tp_rank * |r| + i
        (0, 2, 8, [0, 1, 2, 3]),
        (1, 2, 8, [4, 5, 6, 7]),
    ],
)
def test_target_remote_ranks(rank: int, local: int, remote: int, targets: list[int]) -> None:
    assert target_remote_ranks(rank, local, remote) == targets


def test_target_remote_ranks_refuses_rank_outside_tp() -> None:
    with pytest.raises(LocalProtocolError):
        target_remote_ranks(2, 2, 1)
    with pytest.raises(LocalProtocolError):
        target_remote_ranks(-1, 2, 1)


@pytest.mark.parametrize(
    ("holder_tp", "reader_tp", "expected"),
    [(1, 1, 1), (1, 2, 2), (2, 4, 2), (1, 8, 8), (2, 1, 1), (8, 2, 1), (4, 4, 1)],
)
def test_expected_consumers(holder_tp: int, reader_tp: int, expected: int) -> None:
    assert expected_consumers(holder_tp, reader_tp) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_holder_rank_gets_exactly_expected_consumers(holder_tp: int, reader_tp: int) -> None:
    readers_of: dict[int, list[int]] = {h: [] for h in range(holder_tp)}
    for rank in range(reader_tp):
        for h in target_remote_ranks(rank, reader_tp, holder_tp):
            readers_of[h].append(rank)
    for h, readers in readers_of.items():
        assert len(readers) == expected_consumers(holder_tp, reader_tp), h
    # The slices of one holder block read by its readers tile the block exactly once,
    # and each reader's local slices from its holders tile its local block exactly once.
    for h, readers in readers_of.items():
        parts = [read_slices(r, reader_tp, holder_tp, h)[1] for r in readers]
        assert sorted(p.index for p in parts) == list(range(parts[0].parts))
    for rank in range(reader_tp):
        targets = target_remote_ranks(rank, reader_tp, holder_tp)
        local = [read_slices(rank, reader_tp, holder_tp, h)[0] for h in targets]
        assert sorted(p.index for p in local) == list(range(local[0].parts))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_replicated_kv_reads_each_reader_rank_once_and_leaves_no_done_out(
    holder_tp: int, reader_tp: int
) -> None:
    """MLA: every reader rank reads whole blocks from exactly one holder rank (stock's
    ``rank * holder_tp // reader_tp``); every target rank still counts it as a consumer."""
    for rank in range(reader_tp):
        targets = target_remote_ranks(rank, reader_tp, holder_tp)
        plans = {h: part_slices(rank, reader_tp, holder_tp, h, replicated=True) for h in targets}
        read = [h for h, plan in plans.items() if plan is not None]
        assert read == [rank * holder_tp // reader_tp]
        assert plans[read[0]] == (BlockSlice.FULL, BlockSlice.FULL)
        assert all(
            part_slices(rank, reader_tp, holder_tp, h, replicated=False)
            == read_slices(rank, reader_tp, holder_tp, h)
            for h in targets
        )
    with pytest.raises(LocalProtocolError):
        part_slices(0, 4, 2, 1, replicated=True)  # rank 0 does not read from remote rank 1


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_writes_fill_every_holder_rank_once(holder_tp: int, writer_tp: int, mla: bool) -> None:
    """Push mode: every holder rank receives the whole of what it keeps exactly once (MLA:
    the whole latent, from one writer rank; else each writer's head slice), and each of
    its expected consumers sends it a done (a data write or a done-only one)."""
    filled: dict[int, list[tuple[BlockSlice, BlockSlice]]] = {h: [] for h in range(holder_tp)}
    dones = dict.fromkeys(range(holder_tp), 0)
    for rank in range(writer_tp):
        for h in target_remote_ranks(rank, writer_tp, holder_tp):
            dones[h] += 1
            plan = write_slices(rank, writer_tp, holder_tp, h, replicated=mla)
            if plan is not None:
                filled[h].append(plan)
    assert set(dones.values()) == {expected_consumers(holder_tp, writer_tp)}
    for plans in filled.values():
        if mla:
            assert plans == [(BlockSlice.FULL, BlockSlice.FULL)]
        else:
            # The writer slices of one holder rank tile its blocks (or one writes them whole).
            remote = sorted((r.index, r.parts) for _, r in plans)
            assert remote == [(i, len(plans)) for i in range(len(plans))] or remote == [(0, 1)]
    with pytest.raises(LocalProtocolError):
        write_slices(0, 2, 4, 3, replicated=True)  # rank 0 writes to remote ranks 0 and 1


def test_read_slices_seed_examples() -> None:
    # D TP 4 reads from P TP 2: rank 3 reads half (3 % 2 = 1) of remote rank 1's blocks.
    assert read_slices(3, 4, 2, 1) == (BlockSlice.FULL, BlockSlice(index=1, parts=2))
    assert read_slices(2, 4, 2, 1) == (BlockSlice.FULL, BlockSlice(index=0, parts=2))
    # D TP 1 reads from P TP 2: whole remote blocks into halves of the local block.
    assert read_slices(0, 1, 2, 0) == (BlockSlice(index=0, parts=2), BlockSlice.FULL)
    assert read_slices(0, 1, 2, 1) == (BlockSlice(index=1, parts=2), BlockSlice.FULL)
    with pytest.raises(LocalProtocolError):
        read_slices(0, 4, 2, 1)  # rank 0 does not read from remote rank 1


def test_rank_offset_is_tp_rank_mod_ratio_times_remote_slice_len() -> None:
    # rank_offset = (tp_rank % tp_ratio) * kv_block_len, kv_block_len = block_len / tp_ratio
    block_len = 4096
    for rank in range(4):
        _, remote = read_slices(rank, 4, 2, rank // 2)
        assert remote.span(block_len) == ((rank % 2) * (block_len // 2), block_len // 2)


def test_block_slice_validation_and_spans() -> None:
    assert BlockSlice.FULL.span(100) == (0, 100)
    assert BlockSlice(index=2, parts=4).span(64) == (32, 16)
    with pytest.raises(LocalProtocolError):
        BlockSlice(index=2, parts=2)
    with pytest.raises(LocalProtocolError):
        BlockSlice(index=0, parts=0)
    with pytest.raises(LocalProtocolError):
        BlockSlice(index=0, parts=3).span(64)  # does not split evenly


def test_descriptor_ids_are_region_times_num_blocks_plus_block() -> None:
    # The seed's example: blocks [3, 7, 12] of 2L regions of N blocks.
    n, regions = 100, 4
    ids = descriptor_ids([3, 7, 12], regions, n)
    assert ids == [3, 7, 12, 103, 107, 112, 203, 207, 212, 303, 307, 312]
    assert len(ids) == regions * 3


def test_descriptor_ids_zero_blocks_and_bounds() -> None:
    assert descriptor_ids([], 8, 10) == []
    with pytest.raises(LocalProtocolError):
        descriptor_ids([10], 1, 10)
    with pytest.raises(LocalProtocolError):
        descriptor_ids([-1], 1, 10)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 50),
    st.data(),
)
def test_descriptor_ids_index_the_layouts_descriptor_list(
    regions: int, num_blocks: int, data: st.DataObject
) -> None:
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=10))
    lens = tuple(data.draw(st.sampled_from([16, 32, 64])) for _ in range(regions))
    layout = BlockLayout(
        region_addrs=tuple(0x10000 * (i + 1) for i in range(regions)),
        block_lens=lens,
        num_blocks=num_blocks,
    )
    descs = layout.descriptors()
    assert len(descs) == regions * num_blocks
    for i, d in enumerate(descriptor_ids(blocks, regions, num_blocks)):
        region, block = divmod(d, num_blocks)
        assert descs[d] == (layout.region_addrs[region] + block * lens[region], lens[region])
        assert region == i // len(blocks) and block == blocks[i % len(blocks)]


def test_layout_descriptors_with_a_slice_are_remote_addresses_plus_rank_offset() -> None:
    layout = BlockLayout(region_addrs=(1000, 9000), block_lens=(64, 128), num_blocks=3)
    half = BlockSlice(index=1, parts=2)
    assert layout.descriptors(half) == [
        (1000 + 32, 32),
        (1000 + 64 + 32, 32),
        (1000 + 128 + 32, 32),
        (9000 + 64, 64),
        (9000 + 128 + 64, 64),
        (9000 + 256 + 64, 64),
    ]
    assert layout.num_regions == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"region_addrs": (1,), "block_lens": (1, 2), "num_blocks": 1},
        {"region_addrs": (), "block_lens": (), "num_blocks": 1},
        {"region_addrs": (1,), "block_lens": (8,), "num_blocks": 0},
        {"region_addrs": (1,), "block_lens": (0,), "num_blocks": 1},
    ],
)
def test_layout_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(LocalProtocolError):
        BlockLayout(**kwargs)  # type: ignore[arg-type]


def test_partial_prefix_hit_reads_the_tail() -> None:
    # remote_block_ids[-len(local_block_ids):]
    assert blocks_to_read([5, 6], [10, 11, 12, 13]) == [12, 13]
    assert blocks_to_read([1, 2, 3, 4], [10, 11, 12, 13]) == [10, 11, 12, 13]


def test_full_prefix_hit_reads_nothing() -> None:
    assert blocks_to_read([], [10, 11, 12]) == []
    assert blocks_to_read([], []) == []


def test_more_local_blocks_than_remote_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        blocks_to_read([1, 2, 3], [10])
