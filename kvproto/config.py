"""One validated configuration object, with vLLM's names.

The two derived timings are vLLM's, kept bit-for-bit so that a kvproto peer
paces itself exactly like a stock NixlConnector peer:

* ``heartbeat_interval = kv_lease_duration // 6`` (5 s at the default 30 s)
* ``lease_extension = kv_lease_duration * 2 // 3`` (20 s at the default)

spec/timing.md derives why these ratios leave a margin of three missed ticks
before a live reader's lease can lapse. vLLM never validated them (a duration
below 6 gives interval 0, a duration of 1 gives extension 0); here nonsense
is a :class:`ConfigError` at construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from kvproto.errors import LocalProtocolError


class ConfigError(LocalProtocolError):
    """A configuration value is out of range or unknown."""


class LeaseParams(msgspec.Struct, frozen=True, array_like=True):
    """The timing a holder advertises to its readers (in tickets and Welcome frames)."""

    duration: float
    """Initial lease at grant, seconds (``kv_lease_duration``)."""
    interval: float
    """Heartbeat interval the reader must keep, seconds."""
    extension: float
    """How far past its arrival a heartbeat pushes the deadline, seconds."""
    max_hold: float | None = None
    """Hard cap on a lease's hold time from its grant, seconds (None: not advertised).

    Without it a reader could not know that a lease it keeps renewing ends at
    grant + max_hold anyway, and its pre-read deadline bound would exceed the truth."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseConfig:
    """Every tunable of the lease protocol, validated at construction."""

    kv_lease_duration: float = 30.0
    """The lease's length, seconds (vLLM's name and default): the heartbeat interval and
    extension derive from it, and a lease granted when prefill finishes lasts this long
    once claimed, at the latest until ``claim_window`` unclaimed."""
    claim_window: float | None = None
    """How long a lease granted when prefill finishes waits for its first claim, seconds
    (the ticket's ``expires_in``; a claim then keeps it as any heartbeat does). None: the
    lease extension, so a grant outlives a silent reader exactly as long as a claimed
    lease outlives its last heartbeat; with ``accept_legacy`` the whole lease, as stock
    decoders, which never see the ticket, expect. A request the router drops before any
    decoder tracks it holds the blocks this long (spec/timing.md, "Requests that never
    reach D")."""
    decoder_kv_blocks_ttl: float = 480.0
    """Lease for bidirectional turn-2 blocks held by the decoder, seconds (vLLM's name)."""
    max_hold: float = 1800.0
    """Hard cap on how long any lease may be held, renewals included, seconds."""
    read_margin: float = 5.0
    """A reader declines to start a read this close to the holder's deadline (vLLM: 5 s)."""
    ack_timeout: float = 5.0
    """How long a reader waits for the holder's done-acknowledgement before it fences the read."""
    done_retries: int = 2
    """How often a reader re-sends an unacknowledged done frame within ``ack_timeout``."""
    max_drift_ppm: float = 500.0
    """Assumed worst relative clock-rate difference between peers, parts per million."""
    tombstone_ttl: float = 120.0
    """How long an ended lease is remembered to answer late frames precisely, seconds."""
    max_tombstones: int = 100_000
    """Cap on remembered ended leases (oldest forgotten first)."""
    max_frame_bytes: int = 65_536
    """Largest frame accepted or produced; bigger inputs are refused and counted."""
    max_notification_size: int | None = None
    """Transport's notification cap; outgoing batches are split to fit, never truncated."""
    max_leases_per_session: int = 100_000
    """Cap on leases one reader session may claim."""
    max_sessions: int = 4096
    """Cap on reader sessions a holder keeps."""
    max_ids_per_frame: int = 8192
    """Cap on lease ids in one incoming frame."""
    rate_limit_per_s: float = 2000.0
    """Sustained frames per second accepted from one peer (token bucket)."""
    rate_limit_burst: float = 4000.0
    """Burst size of the per-peer token bucket, frames."""
    accept_legacy: bool = False
    """Accept stock vLLM text frames (``HB:a,b`` and ``id:n``); unauthenticated, see spec."""
    auth_secret: bytes | None = None
    """Optional shared secret, a layer on top of the default authentication.

    Without it every frame is still signed, with session keys derived from a ticket
    token (kvproto.auth). With it Hellos must carry its MAC and it keys every session
    key as well, so a forger needs a token *and* the secret."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f.name, str(f.type), getattr(self, f.name))
        if self.kv_lease_duration < 1:
            raise ConfigError(f"kv_lease_duration must be >= 1 s, got {self.kv_lease_duration}")
        if self.heartbeat_interval <= 0:
            raise ConfigError(
                f"kv_lease_duration {self.kv_lease_duration} gives a heartbeat interval of "
                f"{self.heartbeat_interval} (duration // 6); use at least 6 s"
            )
        if not math.isfinite(self.lease_extension):
            raise ConfigError(f"kv_lease_duration {self.kv_lease_duration} is too large")
        if self.lease_extension <= self.heartbeat_interval:
            raise ConfigError(
                f"lease extension {self.lease_extension} must exceed the heartbeat interval "
                f"{self.heartbeat_interval}"
            )
        if self.claim_window is not None and not 0 < self.claim_window <= self.kv_lease_duration:
            raise ConfigError(
                f"claim_window must be in (0, kv_lease_duration], got {self.claim_window}"
            )
        if self.decoder_kv_blocks_ttl <= 0:
            raise ConfigError("decoder_kv_blocks_ttl must be positive")
        if self.max_hold < max(self.kv_lease_duration, self.decoder_kv_blocks_ttl):
            raise ConfigError(
                "max_hold must be at least kv_lease_duration and decoder_kv_blocks_ttl"
            )
        if self.ack_timeout <= 0:
            raise ConfigError("ack_timeout must be positive")
        if self.read_margin >= self.lease_extension:
            raise ConfigError("read_margin must be shorter than the lease extension")
        if self.max_frame_bytes < 256:
            raise ConfigError("max_frame_bytes must be at least 256")
        if self.max_notification_size is not None and self.max_notification_size < 64:
            raise ConfigError("max_notification_size below 64 bytes cannot carry a frame")
        for name in ("max_sessions", "max_leases_per_session", "max_ids_per_frame"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.rate_limit_per_s <= 0 or self.rate_limit_burst < 1:
            raise ConfigError("rate limits must be positive")
        if self.auth_secret is not None and len(self.auth_secret) < 16:
            raise ConfigError("auth_secret must be at least 16 bytes")

    @property
    def heartbeat_interval(self) -> float:
        """``kv_lease_duration // 6``: how often a reader heartbeats each holder."""
        return self.kv_lease_duration // 6

    @property
    def lease_extension(self) -> float:
        """``kv_lease_duration * 2 // 3``: a heartbeat keeps a lease until arrival + this."""
        return self.kv_lease_duration * 2 // 3

    @property
    def grant_ttl(self) -> float:
        """How long a fresh grant lives unclaimed: ``claim_window``, else the lease extension
        (the whole lease with ``accept_legacy``)."""
        if self.claim_window is not None:
            return self.claim_window
        return self.kv_lease_duration if self.accept_legacy else self.lease_extension

    @property
    def drift(self) -> float:
        """``max_drift_ppm`` as a fraction (the factor the deadline maths stretches by)."""
        return self.max_drift_ppm * 1e-6

    @property
    def params(self) -> LeaseParams:
        """The timing this holder advertises."""
        return LeaseParams(
            duration=self.kv_lease_duration,
            interval=self.heartbeat_interval,
            extension=self.lease_extension,
            max_hold=self.max_hold,
        )

    @property
    def frame_budget(self) -> int:
        """Largest frame the core produces: the smaller of both caps."""
        if self.max_notification_size is None:
            return self.max_frame_bytes
        return min(self.max_frame_bytes, self.max_notification_size)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LeaseConfig:
        """Build from ``kv_connector_extra_config``-style keys; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown lease settings: {', '.join(unknown)}")
        kwargs = dict(values)
        secret = kwargs.get("auth_secret")
        if isinstance(secret, str):
            kwargs["auth_secret"] = secret.encode()
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc


def _check_field(name: str, annotation: str, value: object) -> None:
    """Type, finiteness and sign of one field (NaN compares false to everything,
    so without this ``kv_lease_duration=nan`` passed every range check below)."""
    if annotation == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")
        return
    if annotation == "bytes | None":
        if value is not None and not isinstance(value, bytes):
            raise ConfigError(f"{name} must be bytes, got {type(value).__name__}")
        return
    base, _, optional = annotation.partition("|")
    if value is None and optional.strip() == "None":
        return
    kinds: tuple[type, ...] = (int,) if base.strip() == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"{name} must be a number ({base.strip()}), got {value!r}")
    if kinds != (int,):
        try:
            finite = math.isfinite(float(value))  # type: ignore[arg-type]
        except OverflowError:  # an int too large for a float: time arithmetic would raise
            finite = False
        if not finite:
            raise ConfigError(f"{name} must be finite, got {value}")
    if value < 0:  # type: ignore[operator]  # int or float, checked above
        raise ConfigError(f"{name} must not be negative, got {value}")
