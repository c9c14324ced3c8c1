"""The model constants every scenario shares (spec/simulator.md explains each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Model constants shared by every scenario (spec/simulator.md explains each)."""

    pool_blocks: int = 16_384
    """KV blocks per engine."""
    proxy_delay: float = 0.005
    """Routing proxy hop from P to D (and client to P), seconds."""
    prefill_base: float = 0.01
    """Fixed part of a prefill step, seconds."""
    prefill_per_token: float = 40e-6
    """Prefill time per prompt token, seconds."""
    read_bandwidth: float = 800_000.0
    """Simulated bytes per second a read moves (64 B blocks stand for ~2 MiB at 25 GB/s)."""
    handshake_cost: float = 0.002
    """Side-channel handshake processing on top of one round trip, seconds."""
    handshake_timeout: float = 5.0
    """A handshake to a dead or unreachable holder fails after this (vLLM's RCVTIMEO)."""
    rank_skew: float = 0.005
    """A TP worker issues its read up to this long after the step boundary, seconds."""
    cap: float = 4000.0
    """Hard stop of a run, simulated seconds."""

    def prefill_time(self, tokens: int) -> float:
        """Seconds one prefill step takes for ``tokens`` prompt tokens."""
        return self.prefill_base + tokens * self.prefill_per_token
