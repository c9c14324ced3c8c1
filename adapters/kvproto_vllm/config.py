"""``kv_connector_extra_config`` parsing: the lease keys plus the adapter's own.

Pure (no vLLM import), so it is unit-testable and cheap. Lease keys go to
:meth:`kvproto.config.LeaseConfig.from_mapping` (vLLM's names:
``kv_lease_duration``, ``decoder_kv_blocks_ttl``, ...); the adapter adds the
keys in :data:`ADAPTER_KEYS`. Two stock NixlConnector keys that only tune
stock internals are accepted and ignored (:data:`IGNORED_STOCK_KEYS`), so a
config written for the stock connector loads; a stock key whose behaviour is
not implemented here (``enforce_handshake_compat: false``) is refused loudly
rather than silently doing something else. Any other key is an error.

``kv_transport`` (:data:`KV_TRANSPORTS`) picks the transport the worker runs
(:mod:`.transport_choice`); every other key means the same with either.

``transfer_mode`` (:data:`TRANSFER_MODES`) is pull (the default: D reads P's blocks) or
push (P writes into D's blocks, spec/push-mode.md). Both engines of a pair run the same
mode (it is part of the handshake compat hash). Push is refused when the engine starts
with what it cannot serve safely: Mooncake (its loss report is no proof that a write
cannot land), bidirectional turn 2 (as stock), stock interop (``accept_legacy``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvproto.config import ConfigError, LeaseConfig

IGNORED_STOCK_KEYS = frozenset({"num_threads", "engine_ttl"})
"""Stock NixlConnector tuning keys with no meaning here (accepted, ignored)."""

_DEFAULT_DURATION = LeaseConfig().kv_lease_duration

KV_TRANSPORTS = ("nixl", "ucx", "mooncake")
"""Values of ``kv_transport``; the first is the default (stock NixlConnector's transport)."""

TRANSFER_MODES = ("pull", "push")
"""Values of ``transfer_mode`` (stock's ``kv_transfer_params`` name); pull is the default."""

PUSH_REFUSALS = {
    "kv_transport": (
        "transfer_mode 'push' cannot run over kv_transport 'mooncake': its transport infers "
        "a lost peer from unanswered probes, which is no proof that a write can no longer "
        "land (spec/push-mode.md section 5); use kv_transport 'nixl' or 'ucx', or "
        "transfer_mode 'pull'"
    ),
    "bidirectional_kv_xfer": (
        "transfer_mode 'push' cannot be combined with bidirectional_kv_xfer (as stock "
        "NixlPushConnector refuses it): turn 2 reads the decoder's blocks, which push mode "
        "does not serve; use transfer_mode 'pull' for bidirectional turns"
    ),
    "accept_legacy": (
        "transfer_mode 'push' cannot be combined with accept_legacy: stock decoders pull; "
        "use transfer_mode 'pull' to serve them"
    ),
}
"""Why push mode is refused when the engine starts, per conflicting key (ConfigError)."""

DEFAULT_PROBE_INTERVAL_S = 0.25
"""Seconds between the worker's transport probes (``probe_interval_s``)."""

DEFAULT_READ_MARGIN = 5.0
"""vLLM's turn-2 read margin; capped at half the lease extension for short leases."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """The adapter's own settings (the lease settings live in :attr:`lease`)."""

    lease: LeaseConfig
    """Lease protocol settings, validated by the core."""
    kv_transport: str = KV_TRANSPORTS[0]
    """Which transport moves the blocks and frames: ``"nixl"``, ``"ucx"`` (ucxx) or
    ``"mooncake"`` (Mooncake's transfer engine, notifications over ZMQ). Both engines of a
    pair must use the same one (it is part of the handshake compat hash)."""
    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends (stock key ``backends``); unused with another ``kv_transport``."""
    nixl_progress_thread: bool = True
    """Run NIXL's progress thread (with a wait between passes: it does not spin). Over TCP
    it answers a reader's READs while the engine step computes, which keeps UCX from
    aborting a holder that answers a dead reader's queued READs late
    (spec/nixl-transport.md, "Progress"). ``False``: transfers move only inside the
    worker's calls, once per step."""
    probe_interval_s: float | None = DEFAULT_PROBE_INTERVAL_S
    """How often the worker probes its transport peers so a dead peer surfaces as PeerLost
    (a holder then frees at once instead of at lease expiry); None disables probing.
    A probe is one 20-byte notification per peer, sent from a pump: the loss is seen at
    most this + the transport's slack + one engine step after the kill."""
    handshake_timeout_s: float = 5.0
    """Side-channel round-trip timeout (stock: 5 s)."""
    handshake_attempts: int = 3
    """Side-channel attempts before a holder counts as unreachable."""
    kv_recompute_threshold: int = 0
    """Stock key: remote tails shorter than this many tokens are recomputed, not read
    (the holder is still told at once). Default 0 = always read (stock: 64)."""
    kvproto_side_channel_port: int | None = None
    """Base port of the kvproto side channel (rank r: + dp_index * tp_size + r). Default:
    VLLM_NIXL_SIDE_CHANNEL_PORT, like stock; required with ``accept_legacy`` on a
    producer, whose stock port then serves stock-format handshakes."""
    transfer_mode: str = TRANSFER_MODES[0]
    """``"pull"``: D reads P's finished blocks; ``"push"``: D registers its allocated
    blocks with P, which writes into them (spec/push-mode.md). Both engines of a pair run
    the same mode (compat hash); a request whose ``kv_transfer_params`` name the other
    one is recomputed."""
    bidirectional_kv_xfer: bool = False
    """Stock key: turn 2 of a conversation reads the decoder's blocks back. D keeps a
    finished request's blocks under a lease of ``decoder_kv_blocks_ttl`` and returns
    its ticket; P reads them for the turn-2 prompt. Both engines then run a holder and
    a reader (spec/vllm-adapter.md, bidirectional turn 2)."""

    @property
    def side_channel_secret(self) -> bytes | None:
        """The lease ``auth_secret`` also authenticates the side channel."""
        return self.lease.auth_secret


ADAPTER_KEYS = frozenset(f.name for f in fields(AdapterConfig)) - {"lease"}
LEASE_KEYS = frozenset(f.name for f in fields(LeaseConfig))


def parse_extra_config(extra: Mapping[str, Any] | None) -> AdapterConfig:
    """Validate ``kv_connector_extra_config``; raises :class:`ConfigError` with the key."""
    values = dict(extra or {})
    if values.pop("enforce_handshake_compat", True) is not True:
        raise ConfigError(
            "enforce_handshake_compat=false is not supported: a holder whose compat hash "
            "differs is never read from"
        )
    for key in IGNORED_STOCK_KEYS:
        values.pop(key, None)
    mode = values.pop("transfer_mode", TRANSFER_MODES[0])
    if mode not in TRANSFER_MODES:
        raise ConfigError(f"transfer_mode must be 'pull' or 'push', got {mode!r}")
    unknown = sorted(set(values) - ADAPTER_KEYS - LEASE_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config keys for KvprotoConnector: {', '.join(unknown)}"
        )
    lease_values = {k: v for k, v in values.items() if k in LEASE_KEYS}
    if "read_margin" not in lease_values:
        lease_values["read_margin"] = _default_read_margin(lease_values)
    lease = LeaseConfig.from_mapping(lease_values)
    own = {k: v for k, v in values.items() if k in ADAPTER_KEYS}
    adapter = AdapterConfig(
        lease=lease,
        kv_transport=_kv_transport(own.get("kv_transport", KV_TRANSPORTS[0]), lease),
        backends=_backends(own.get("backends", ("UCX",))),
        nixl_progress_thread=_flag("nixl_progress_thread", own.get("nixl_progress_thread", True)),
        probe_interval_s=_optional_positive(
            "probe_interval_s", own.get("probe_interval_s", DEFAULT_PROBE_INTERVAL_S)
        ),
        handshake_timeout_s=_positive("handshake_timeout_s", own.get("handshake_timeout_s", 5.0)),
        handshake_attempts=int(_positive("handshake_attempts", own.get("handshake_attempts", 3))),
        kv_recompute_threshold=int(
            _non_negative("kv_recompute_threshold", own.get("kv_recompute_threshold", 0))
        ),
        kvproto_side_channel_port=_port(own.get("kvproto_side_channel_port")),
        transfer_mode=mode,
        bidirectional_kv_xfer=_bidirectional(own.get("bidirectional_kv_xfer", False), lease),
    )
    if mode == "push":
        _check_push(adapter)
    return adapter


def _check_push(adapter: AdapterConfig) -> None:
    """Refuse push mode with what it cannot serve safely (:data:`PUSH_REFUSALS`)."""
    conflicts = {
        "kv_transport": adapter.kv_transport == "mooncake",
        "bidirectional_kv_xfer": adapter.bidirectional_kv_xfer,
        "accept_legacy": adapter.lease.accept_legacy,
    }
    for key, conflict in conflicts.items():
        if conflict:
            raise ConfigError(PUSH_REFUSALS[key])


def _default_read_margin(lease_values: Mapping[str, Any]) -> float:
    """vLLM users set only ``kv_lease_duration``; a 6 s lease has a 4 s extension, which
    the core's default 5 s margin would exceed, so the default shrinks with the lease."""
    duration = lease_values.get("kv_lease_duration", _DEFAULT_DURATION)
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        return DEFAULT_READ_MARGIN  # LeaseConfig reports the bad value itself
    if not math.isfinite(duration):
        return DEFAULT_READ_MARGIN
    extension = duration * 2 // 3
    return float(min(DEFAULT_READ_MARGIN, extension / 2))


def _kv_transport(value: Any, lease: LeaseConfig) -> str:
    if not isinstance(value, str) or value.lower() not in KV_TRANSPORTS:
        raise ConfigError(
            f"kv_transport must be one of {', '.join(map(repr, KV_TRANSPORTS))}, got {value!r}"
        )
    kind = value.lower()
    if kind != "nixl" and lease.accept_legacy:
        # Stock decoders find the holder through NIXL agent metadata and speak NIXL notifs.
        raise ConfigError(
            f"accept_legacy (stock NixlConnector interop) needs kv_transport 'nixl', not {kind!r}"
        )
    return kind


def _backends(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not value or not all(isinstance(b, str) for b in value):
        raise ConfigError(f"backends must be a non-empty list of names, got {value!r}")
    return tuple(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive(name: str, value: Any) -> float:
    number = _number(name, value)
    if number <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return number


def _non_negative(name: str, value: Any) -> float:
    number = _number(name, value)
    if number < 0:
        raise ConfigError(f"{name} must not be negative, got {value!r}")
    return number


def _port(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"kvproto_side_channel_port must be a TCP port, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _bidirectional(value: Any, lease: LeaseConfig) -> bool:
    on = _flag("bidirectional_kv_xfer", value)
    if on and lease.accept_legacy:
        # A stock engine's turn-2 read carries no ticket and gets no verdict; the mix
        # is untested, so it is refused rather than half-working.
        raise ConfigError("bidirectional_kv_xfer cannot be combined with accept_legacy")
    return on


def _optional_positive(name: str, value: Any) -> float | None:
    return None if value is None else _positive(name, value)
