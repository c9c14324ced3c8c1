"""Who may read whose KV blocks (compat hash) and where a holder's side channel listens.

The compat hash plays the role of stock vLLM's ``compute_nixl_compatibility_hash``:
the holder's side channel refuses a reader whose hash differs, and the reader
fails its requests (recompute) with a clear log line instead of reading blocks
it cannot interpret. Like stock, the model *path string* is a factor, so P and
D must load the model from the same path. The block size is not a factor: a
holder names it in every request's ``kv_transfer_params`` and a reader whose
blocks are a multiple of it reads each holder block into one part of its own
(:func:`.groups.block_ratio`; any other pair is refused per request, recomputed).
The KV cache groups and their placement are factors (:mod:`.groups`), and so is
the transport (``kv_transport``): a UCX reader cannot use a NIXL holder's
metadata, so such a pair is refused at the handshake (recompute), and
:func:`neighbour_hashes` lets the reader name that cause, and a dtype or MLA
difference alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from kvproto.config import ConfigError

from .config import KV_TRANSPORTS, AdapterConfig
from .groups import TransferGroups

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ADAPTER_PROTOCOL = 3
"""Bumped when the adapter's kv_transfer_params or side-channel use changes."""


def compat_factors(
    vllm_config: VllmConfig,
    *,
    kv_transport: str,
    groups: TransferGroups | None = None,
) -> dict[str, Any]:
    """The facts two engines must share for one to read the other's blocks.

    With ``groups`` (the engine's KV cache groups) their kinds, windows and placement
    and whether the KV is latent (MLA) are factors too: a block id means the same bytes
    on both sides only if every group is laid out alike."""
    from vllm import __version__ as vllm_version

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    return {
        "kvproto_vllm_protocol": ADAPTER_PROTOCOL,
        "vllm_version": vllm_version,
        "model": model.model,
        "dtype": str(model.dtype),
        "num_kv_heads": model.get_total_num_kv_heads(),
        "head_size": model.get_head_size(),
        "num_hidden_layers": model.get_total_num_hidden_layers(),
        "cache_dtype": str(cache.cache_dtype),
        "kv_transport": kv_transport,
        "use_mla": bool(model.use_mla),
        **(
            {}
            if groups is None
            else {"kv_groups": groups.describe(), "kv_packed_blocks": groups.packed}
        ),
    }


def compat_hash(factors: dict[str, Any]) -> bytes:
    """A 16-byte digest of the factors (stable across processes and hosts)."""
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


NEIGHBOUR_VALUES: dict[str, tuple[Any, ...]] = {
    "kv_transport": KV_TRANSPORTS,
    "use_mla": (False, True),
    "cache_dtype": ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "dtype": ("torch.float32", "torch.float16", "torch.bfloat16"),
}
"""Values a peer's factor plausibly takes where ours differs: a holder whose hash is one
of :func:`neighbour_hashes` differs from us by that one factor, and the log can say which
and how (a compat hash alone only says *that* the engines differ)."""


def neighbour_hashes(factors: dict[str, Any]) -> dict[bytes, tuple[str, Any]]:
    """compat hash -> (factor, value) for every factor of :data:`NEIGHBOUR_VALUES` set to
    every other value of its own, the rest as ours."""
    out: dict[bytes, tuple[str, Any]] = {}
    for key, values in NEIGHBOUR_VALUES.items():
        if key not in factors:
            continue
        for value in values:
            if value != factors[key]:
                out[compat_hash({**factors, key: value})] = (key, value)
    return out


def side_channel_address(vllm_config: VllmConfig, cfg: AdapterConfig) -> tuple[str, int]:
    """(host, port of TP rank 0) of this engine's kvproto side channel.

    Stock's listener is ``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index``
    and serves every TP rank from the scheduler process. Here each worker rank
    serves its own metadata and takes its readers' introductions itself (so a
    holder can add a reader's NIXL agent before the reader's first frame is
    handled), so rank r listens on ``base + dp_index * tp_size + r``; with TP 1
    this is exactly stock's port. In interop mode (``accept_legacy``) the stock
    port serves stock-format handshakes and the base is
    ``kvproto_side_channel_port`` instead.
    """
    from vllm import envs

    parallel = vllm_config.parallel_config
    start = envs.VLLM_NIXL_SIDE_CHANNEL_PORT
    if cfg.lease.accept_legacy and vllm_config.kv_transfer_config is not None:
        if vllm_config.kv_transfer_config.is_kv_producer:
            if cfg.kvproto_side_channel_port is None:
                raise ConfigError(
                    "accept_legacy serves stock NixlConnector handshakes on "
                    "VLLM_NIXL_SIDE_CHANNEL_PORT; set kvproto_side_channel_port in "
                    "kv_connector_extra_config for the kvproto side channel"
                )
            start = cfg.kvproto_side_channel_port
    elif cfg.kvproto_side_channel_port is not None:
        start = cfg.kvproto_side_channel_port
    base = start + parallel.data_parallel_index * transfer_tp_size(vllm_config)
    return envs.VLLM_NIXL_SIDE_CHANNEL_HOST, base


def stock_side_channel_address(vllm_config: VllmConfig) -> tuple[str, int]:
    """Where stock NixlConnector listens (and a stock decoder connects)."""
    from vllm import envs

    port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index
    return envs.VLLM_NIXL_SIDE_CHANNEL_HOST, port


def transfer_tp_size(vllm_config: VllmConfig) -> int:
    """TP size as the lease protocol sees it (one holder or reader per TP rank)."""
    return int(vllm_config.parallel_config.tensor_parallel_size)
