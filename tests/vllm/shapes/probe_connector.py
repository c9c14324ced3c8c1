"""A do-nothing KV connector that records what vLLM hands a connector.

Loaded with ``kv_connector_module_path="tests.vllm.shapes.probe_connector"``,
``kv_connector="ProbeConnector"``. It transfers nothing: ``get_num_new_matched_tokens``
reports no external tokens and ``request_finished*`` lets vLLM free the blocks at once.
Every fact is appended as one JSON line to ``kv_connector_extra_config["dump_path"]``:

* ``kv_cache_config`` (scheduler and worker instance): groups, specs, tensors, num_blocks;
* ``register_kv_caches``: per layer shape, dtype, stride, storage and sharing;
* ``update_state_after_alloc`` and ``request_finished_all_groups``: per-group block ids.

``get_required_kvcache_layout`` asks for what stock NixlConnector asks for ("LBHNC", or
None for MLA) unless ``extra_config["layout"]`` says otherwise ("none" means None).
SupportsHMA is implemented, so vLLM keeps the hybrid KV cache manager on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


class _Meta(KVConnectorMetadata):
    pass


def _plain(value: Any) -> Any:
    """JSON-able rendering of specs and configs (dataclasses, dtypes, tuples)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"class": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _plain(getattr(value, f.name))
        for prop in ("page_size_bytes", "real_page_size_bytes", "storage_block_size"):
            with contextlib.suppress(Exception):  # not every spec has every property
                out[prop] = _plain(getattr(value, prop))
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _tensor_facts(t: torch.Tensor) -> dict[str, Any]:
    st = t.untyped_storage()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "stride": list(t.stride()),
        "element_size": t.element_size(),
        "is_contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": st.data_ptr(),
        "storage_nbytes": st.nbytes(),
        "storage_offset_elems": t.storage_offset(),
        "nbytes_view": t.numel() * t.element_size(),
        "device": str(t.device),
    }


class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._path = extra.get("dump_path", "/tmp/probe_dump.jsonl")
        self._dump(
            "kv_cache_config",
            role=role.name,
            block_size=vllm_config.cache_config.block_size,
            disable_hybrid_kv_cache_manager=(
                vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            ),
            kv_cache_config=_plain(kv_cache_config),
        )

    def _dump(self, kind: str, **payload: Any) -> None:
        with open(self._path, "a") as f:
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), **payload}) + "\n")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        layout = extra.get("layout")
        if layout is not None:
            return None if layout == "none" else layout
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layers: dict[str, Any] = {}
        for name, value in kv_caches.items():
            if isinstance(value, torch.Tensor):
                layers[name] = {"type": "tensor", **_tensor_facts(value)}
            else:  # mamba layers: a list/tuple of state tensors (conv, ssm)
                layers[name] = {
                    "type": type(value).__name__,
                    "parts": [_tensor_facts(v) for v in value],
                }
        # Group layers by the storage they view.
        by_storage: dict[int, list[str]] = {}
        for name, facts in layers.items():
            for i, part in enumerate(facts.get("parts", [facts])):
                tag = name if "parts" not in facts else f"{name}[{i}]"
                by_storage.setdefault(part["storage_ptr"], []).append(tag)
        self._dump(
            "register_kv_caches",
            layers=layers,
            storages={str(k): v for k, v in by_storage.items()},
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._dump(
            "update_state_after_alloc",
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_external_tokens=num_external_tokens,
            block_ids=[list(g) for g in blocks.get_block_ids()],
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _Meta()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._dump("request_finished", request_id=request.request_id, block_ids=list(block_ids))
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        self._dump(
            "request_finished_all_groups",
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens,
            block_ids=[list(g) for g in block_ids],
        )
        return False, None
