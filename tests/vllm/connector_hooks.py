"""Every public member of vLLM's ``KVConnectorBase_V1``, and what KvprotoConnector does with it.

The hook tests (tests/vllm/test_kvproto_hooks.py on vLLM 0.32,
tests/vllm033/test_contract_v033.py on 0.33) fail when the installed base
class has a public member missing here: a new vLLM hook must be read and
either implemented or listed as deliberately inherited, with the reason.
Members only one vLLM version has are listed once; the union covers 0.32
and 0.33.
"""

from __future__ import annotations

IMPLEMENTED: frozenset[str] = frozenset(
    {
        # worker side
        "register_kv_caches",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "get_handshake_metadata",
        "shutdown",
        # scheduler side
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "has_pending_push_work",
        "set_xfer_handshake_metadata",
        "get_loaded_kv_cache_group_ids",  # every transfer group: a load fills each of them
        "supports_divergent_local_hybrid_hits",  # True: the SSM state comes with the read
        # class methods
        "get_required_kvcache_layout",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "supports_sleep_mode",  # 0.33: False, so vLLM refuses --enable-sleep-mode
    }
)
"""Overridden by KvprotoConnector (each must be in its class body)."""

INHERITED: dict[str, str] = {
    "role": "property: the role vLLM built this instance for",
    "bind_connector_metadata": "the base keeps the step's metadata; start_load_kv reads it",
    "clear_connector_metadata": "the base drops it after the step (0.33 MRV2 + speculator: "
    "in finalize_step, after get_transfer_results; nothing of ours waits for it)",
    "has_connector_metadata": "as the base",
    "bind_kv_cache_manager": "no block-pool bookkeeping: blocks are held by request_finished",
    "bind_gpu_block_pool": "as above",
    "build_connector_worker_meta": "None: results travel as finished_sending/recving",
    "finish_forward": "no per-forward state",
    "reset_capture_state": "no CUDA-graph capture state",
    "get_external_cache_hit_sources": "all external tokens are P2P (_cache_hit_source)",
    "get_finished_count": "None (world size): every TP rank reports each request",
    "get_kv_connector_kv_cache_events": "no KV cache events",
    "take_events": "no KV cache events",
    "get_mem_pool_context": "the engine's default KV memory pool",
    "handle_preemptions": "no asynchronous saves to protect",
    "has_pending_block_frees": "False: a lease ends when its reader is done, not sooner",
    "register_finished_partial_tail": "offloading connectors only",
    "requires_kv_delivery": "the base's producer-role default (preempted hand-off recomputes)",
    "requires_piecewise_for_cudagraph": "False: no layer-wise operations",
    "reset_cache": "no connector-side cache",
    "set_host_xfer_buffer_ops": "no host staging buffer",
    "set_xfer_handshake_metadata_pp_aware": "maps to set_xfer_handshake_metadata; refuses "
    "pp_rank > 0 with a clear ValueError (no PP-disaggregated transfer)",
    "unregister_kv_caches": "0.33 sleep hook: never called, supports_sleep_mode is False",
    "restore_kv_caches": "0.33 wake hook: never called, supports_sleep_mode is False",
}
"""Deliberately left to the base class, with the reason."""


def public_members(cls: type) -> set[str]:
    """Public names a class defines or inherits (methods, class methods, properties)."""
    return {name for name in dir(cls) if not name.startswith("_")}
