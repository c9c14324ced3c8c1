"""A real vLLM 0.33 VllmConfig without an accelerator (see conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def device_free_config(
    model: Path,
    kv_transfer: dict[str, Any],
    *,
    block_size: int = 32,
    max_num_seqs: int = 8,
    enable_prefix_caching: bool = False,
) -> Any:
    """A real VllmConfig on a machine without an accelerator (what EngineArgs would
    build for these settings, but with the device named instead of asked for)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_config = ModelConfig(
        model=str(model), dtype="float32", max_model_len=512, enforce_eager=True
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=512,
            max_num_batched_tokens=512,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(**kv_transfer),
    )
