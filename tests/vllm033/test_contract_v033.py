"""KvprotoConnector against vLLM 0.33's connector API (no engine, no device).

* the contract tests of tests/vllm/test_kvproto_contract.py (no abstract
  method left, overridden signatures equal the base's -- now including
  ``supports_sleep_mode`` --, factory resolution, light import, stats,
  extra config), run unchanged on 0.33;
* the ``vllm.general_plugins`` entry point registers the class name with
  0.33's connector factory without importing the connector;
* every public member of 0.33's ``KVConnectorBase_V1`` is implemented or
  deliberately inherited (tests/vllm/connector_hooks.py): a hook added by a
  later vLLM fails here until someone reads it;
* sleep mode is refused: ``supports_sleep_mode`` is False, so 0.33's own
  config check rejects ``enable_sleep_mode`` with our connector, directly and
  as a MultiConnector child, and the constructor refuses it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.fixtures import one_group_kv_cache_config

from .vllm033_required import require_vllm033

require_vllm033()

from tests.vllm.kvproto_config import kvproto_config  # noqa: E402
from tests.vllm.test_kvproto_contract import (  # noqa: E402
    test_extra_config,
    test_factory_resolves_from_module_path,
    test_import_is_light,
    test_no_abstract_methods_left,
    test_signatures_match_base,
    test_stats_aggregate_and_reduce,
)
from tests.vllm.test_kvproto_hooks import test_every_base_member_is_accounted_for  # noqa: E402
from tests.vllm.test_kvproto_multi import test_plugin_registers_the_name_lazily  # noqa: E402

from .device_free import device_free_config  # noqa: E402

__all__ = [  # collected here, run against vLLM 0.33
    "test_every_base_member_is_accounted_for",
    "test_extra_config",
    "test_factory_resolves_from_module_path",
    "test_import_is_light",
    "test_no_abstract_methods_left",
    "test_plugin_registers_the_name_lazily",
    "test_signatures_match_base",
    "test_stats_aggregate_and_reduce",
]


def test_the_new_hooks_are_compared() -> None:
    """0.33's sleep-mode members exist, and ours has the base's signature."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvproto_vllm.connector import KvprotoConnector

    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert hasattr(KVConnectorBase_V1, name), f"0.33's base class lost {name}"
    ours = inspect.signature(KvprotoConnector.supports_sleep_mode)
    base = inspect.signature(KVConnectorBase_V1.supports_sleep_mode)
    assert list(ours.parameters) == list(base.parameters)


def _sleep_config(model: Path, kv_transfer: dict[str, object]) -> object:
    """VllmConfig.__post_init__ for a config asking for sleep mode. The model config is
    built first: on this machine ModelConfig itself refuses sleep mode ("not supported on
    current platform", no accelerator), which a GPU host would not."""
    import dataclasses

    cfg = device_free_config(model, kvproto_config("kv_producer"))
    cfg.model_config.enable_sleep_mode = True
    from vllm.config import KVTransferConfig, VllmConfig

    return VllmConfig(
        model_config=cfg.model_config,
        cache_config=dataclasses.replace(cfg.cache_config),
        scheduler_config=cfg.scheduler_config,
        device_config=cfg.device_config,
        kv_transfer_config=KVTransferConfig(**kv_transfer),
    )


def test_sleep_mode_is_refused_by_vllm(tiny_model_dir: Path) -> None:
    # vLLM's message, "<connector> does not support sleep mode." (pydantic wraps it), not
    # the constructor's (which goes on "... sleep mode (--enable-sleep-mode)"): no
    # connector is built by VllmConfig.
    from vllm.config import KVTransferConfig

    from kvproto_vllm.connector import KvprotoConnector

    transfer = KVTransferConfig(**kvproto_config("kv_both"))
    assert KvprotoConnector.supports_sleep_mode(transfer) is False
    with pytest.raises(ValueError, match=r"KvprotoConnector does not support sleep mode\."):
        _sleep_config(tiny_model_dir, kvproto_config("kv_producer"))
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [kvproto_config("kv_producer")]},
    }
    with pytest.raises(ValueError, match=r"MultiConnector does not support sleep mode\."):
        _sleep_config(tiny_model_dir, multi)


def test_sleep_mode_is_refused_by_the_constructor(tiny_model_dir: Path) -> None:
    """Where vLLM does not ask (0.32 has no supports_sleep_mode), the connector refuses."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvproto_vllm.connector import SLEEP_MODE_REFUSAL, KvprotoConnector

    cfg = device_free_config(tiny_model_dir, kvproto_config("kv_producer"))
    cfg.model_config.enable_sleep_mode = True
    kv_cache_config = one_group_kv_cache_config(8)
    with pytest.raises(ValueError, match="does not support sleep mode") as info:
        KvprotoConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert str(info.value) == SLEEP_MODE_REFUSAL
