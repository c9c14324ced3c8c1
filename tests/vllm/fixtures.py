"""What tests/vllm and tests/vllm033 share: the vLLM marker and the tiny model on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def mark_vllm_under(folder: Path, items: list[pytest.Item]) -> None:
    """Mark every collected test under ``folder`` as needing vLLM (so `-m "not vllm"` works)."""
    for item in items:
        if folder in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + BPE tokenizer on disk (built once per session)."""
    pytest.importorskip("transformers", reason="transformers comes with vllm")
    from tests.vllm.tiny_model import build_tiny_llama

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))
    return model_dir


def one_group_kv_cache_config(num_blocks: int, layers: tuple[str, ...] = ("layer.0",)) -> Any:
    """A ``KVCacheConfig`` of one full-attention group (the tiny Llama's shape) and no
    tensor placement: the connector registers the per-layer tensors it is given."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )
