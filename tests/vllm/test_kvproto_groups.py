"""KV cache groups and their placement, against vLLM 0.32's own config objects.

No engine: vLLM's ``get_kv_cache_config_from_groups`` places real specs (full
attention, sliding window, Mamba state) in one backing buffer exactly as an
engine does, ``allocate_kv_cache`` makes the per-layer views the connector is
given, and the tests check that the registered regions cover every group's
pages of a block and nothing else, and that block lists pair as stock's do.
"""

from __future__ import annotations

from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from kvproto_vllm.groups import (  # noqa: E402
    FULL,
    SLIDING_WINDOW,
    SSM,
    TransferGroups,
    UnsupportedShape,
    clip_ssm_state,
    pair_blocks,
    single_full_group,
)
from kvproto_vllm.kv_layout import kv_layout  # noqa: E402

BLOCK = 32


def _full(heads: int = 2) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.float32
    )


def _window(window: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=window
    )


def test_pairs_take_each_groups_tail_and_skip_the_null_block() -> None:
    # Full group: 2 blocks to fill after a 1-block prefix hit; window group: 3 blocks,
    # the holder's first one out of its window (null).
    pairs = pair_blocks([[7, 8], [20, 21, 22]], [[1, 2, 3], [0, 11, 12]])
    assert pairs.local == [7, 8, 21, 22]
    assert pairs.remote == [2, 3, 11, 12]
    assert pairs.parts == [] and pairs.ratio == 1  # whole blocks: no parts, nothing regrouped


def test_pairs_refuse_more_local_blocks_than_the_holder_has() -> None:
    with pytest.raises(ValueError, match="group 1: 3 local blocks"):
        pair_blocks([[1], [2, 3, 4]], [[5], [6, 7]])
    with pytest.raises(ValueError, match="2 local groups"):
        pair_blocks([[1], [2]], [[5]])


def test_clip_keeps_window_tails_and_the_ssm_state_block() -> None:
    groups = TransferGroups(
        kinds=(FULL, SLIDING_WINDOW, SSM),
        group_ids=(0, 1, 2),
        num_groups=3,
        window_blocks=(0, 2, 0),
        ssm_spec_blocks=(0, 0, 1),
        block_size=BLOCK,
    )
    assert groups.clip(([1, 2, 3], [0, 0, 4, 5], [0, 9, 10])) == [[1, 2, 3], [4, 5], [9]]
    assert groups.clip(()) == [[], [], []]  # a full prefix hit
    assert groups.backoff == 1 and groups.tokens_to_load(100) == 99
    assert groups.describe() == "full+sliding_window(2 blocks)+ssm(+1 spec)"
    with pytest.raises(ValueError, match="2 block lists for 3"):
        groups.clip(([1], [2]))
    assert clip_ssm_state([0, 9], 0) == [9]
    assert clip_ssm_state([], 2) == []


def test_hetero_tp_is_refused_only_where_blocks_do_not_split_by_heads() -> None:
    plain = single_full_group(BLOCK)
    assert plain.hetero_tp_problem(2, 1) is None
    ssm = TransferGroups(
        kinds=(FULL, SSM),
        group_ids=(0, 1),
        num_groups=2,
        window_blocks=(0, 0),
        ssm_spec_blocks=(0, 0),
        block_size=BLOCK,
    )
    assert "SSM state across TP 1 -> 2" in str(ssm.hetero_tp_problem(2, 1))
    assert ssm.hetero_tp_problem(2, 2) is None
    mla = TransferGroups(
        kinds=(FULL,),
        group_ids=(0,),
        num_groups=1,
        window_blocks=(0,),
        ssm_spec_blocks=(0,),
        block_size=BLOCK,
        packed=True,
        mla=True,
    )
    assert mla.hetero_tp_problem(1, 2) is None


def _placed(groups: list[Any], *, mamba: bool = False) -> tuple[Any, dict[str, Any]]:
    """vLLM's own placement of ``groups`` in a small buffer, and the per-layer views."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config = _vllm_config(block_outermost=mamba)
    config = get_kv_cache_config_from_groups(vllm_config, groups, 64 * 1024 * 1024)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    return config, views


def _vllm_config(*, block_outermost: bool) -> Any:
    from vllm.config import VllmConfig

    cfg = VllmConfig()
    if block_outermost:
        cfg.cache_config.kv_cache_layout = "BLHNC"  # what mixed page sizes need
    else:
        cfg.cache_config.kv_cache_layout = "LBHNC"  # what the connector asks for
    return cfg


def _pages(views: dict[str, Any]) -> set[tuple[int, int]]:
    """Every (address, bytes) a layer's block 3 occupies, over all layers' views."""
    out = set()
    for view in views.values():
        for t in view if isinstance(view, list | tuple) else (view,):
            block = t[3]
            out.add((int(block.data_ptr()), block.numel() * block.element_size()))
    return out


def test_full_and_window_layers_alias_one_region_per_layer_slot() -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec(["l.0", "l.2"], _full()),
        KVCacheGroupSpec(["l.1", "l.3"], _window(64)),
    ]
    config, views = _placed(groups)
    got = kv_layout(views, config, num_blocks=config.num_blocks)
    assert got.placement == "layer-outermost" and got.slices_by_head
    lay = got.layout
    assert lay.num_regions == 2  # two slots, each shared by one layer of each group
    spans = {(a + 3 * n, n) for a, n in zip(lay.region_addrs, lay.block_lens, strict=True)}
    assert spans == _pages(views)


def _mamba() -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    # conv state (3 x 96) and SSM state (2 x 16 x 16): a page unlike attention's.
    return MambaSpec(
        block_size=BLOCK, shapes=((3, 96), (2, 16, 16)), dtypes=(torch.float32, torch.float32)
    )


def test_attention_beside_mamba_state_is_one_packed_region() -> None:
    """Mixed page sizes: vLLM packs every layer's page of a block side by side; the
    views are strided, the packed block is one region that covers them all."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec(["attn.0"], _full()),
        KVCacheGroupSpec(["mamba.1", "mamba.2"], _mamba()),
    ]
    config, views = _placed(groups, mamba=True)
    assert any(not t.is_contiguous() for v in views.values() for t in _tensors(v))
    got = kv_layout(views, config, num_blocks=config.num_blocks)
    assert got.placement == "block-outermost" and not got.slices_by_head
    ((addr,), (length,)) = got.layout.region_addrs, got.layout.block_lens
    block3 = (addr + 3 * length, addr + 4 * length)
    for start, n in _pages(views):
        assert block3[0] <= start and start + n <= block3[1]  # inside block 3's bytes


def _tensors(view: Any) -> tuple[Any, ...]:
    return tuple(view) if isinstance(view, list | tuple) else (view,)


def test_transfer_groups_refuses_what_it_cannot_move() -> None:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvproto_vllm.groups import transfer_groups

    cfg = _vllm_config(block_outermost=False)
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        attention_chunk_size=64,
    )
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], _full()), KVCacheGroupSpec(["b"], chunked)],
    )
    with pytest.raises(UnsupportedShape, match="group 1 is ChunkedLocalAttentionSpec"):
        transfer_groups(cfg, config)
    empty = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(UnsupportedShape, match="no KV cache group"):
        transfer_groups(cfg, empty)
    ok = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], _full()), KVCacheGroupSpec(["b"], _window(96))],
    )
    groups = transfer_groups(cfg, ok)
    assert groups.kinds == (FULL, SLIDING_WINDOW) and groups.window_blocks == (0, 4)


def test_an_ssm_only_engine_plans_its_read_with_no_block_size() -> None:
    """An engine whose only group is SSM state has no attention block size (0), and the
    holder names 0 as its ``remote_block_size``: the read is planned whole (ratio 1)."""
    from types import SimpleNamespace

    from kvproto.config import LeaseConfig
    from kvproto.holder import Holder
    from kvproto_vllm.reader_scheduler import ReaderScheduler

    groups = TransferGroups(
        kinds=(SSM,),
        group_ids=(0,),
        num_groups=1,
        window_blocks=(0,),
        ssm_spec_blocks=(0,),
        block_size=0,
    )
    ticket = Holder(LeaseConfig(), engine="P", incarnation=1).grant(0.0, request_id="p-1")
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[7]],
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 40,
        "remote_block_size": 0,
        "kvproto": ticket.to_params(),
    }
    request: Any = SimpleNamespace(
        request_id="d-1", kv_transfer_params=params, num_prompt_tokens=41
    )
    reader = ReaderScheduler(groups=groups)
    reader.on_new_request(request)
    assert reader.is_tracked("d-1")
    blocks: Any = SimpleNamespace(
        get_unhashed_block_ids_all_groups=lambda: ([3],), get_block_ids=lambda: ([3],)
    )
    reader.update_state_after_alloc(request, blocks, 40)
    (recv,) = reader.take()[1]
    assert (recv.local_block_ids, recv.remote_block_ids, recv.ratio) == ([3], [7], 1)
    assert recv.problem is None
