"""The policies compared by ``kvproto simulate`` (four by default, one historical)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvproto.config import LeaseConfig
from kvproto_tools.baselines.vllm_lease import VllmLeaseConfig
from kvproto_tools.sim.kvproto_side import KvprotoSide
from kvproto_tools.sim.sides import Side
from kvproto_tools.sim.vllm_side import VllmSide

if TYPE_CHECKING:
    from kvproto_tools.sim.transport import SimTransport

MAX_NOTIFICATION = 65_536
"""Notification size cap of every simulated endpoint (kvproto splits to fit; vLLM does not)."""

SideFactory = Callable[["list[SimTransport]", str, int, str], Side]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How an engine keeps blocks for a reader."""

    name: str
    """Command-line name."""
    summary: str
    """One line for the table legend."""
    turn1_ttl: float
    """Initial lease (or the only timeout) of prefill blocks, seconds."""
    turn2_ttl: float
    """Lease of decoder-held turn-2 blocks, seconds."""
    make: SideFactory
    """Builds one engine incarnation's side: (transports, engine name, incarnation, seed)."""


def _vllm(config: VllmLeaseConfig) -> SideFactory:
    def make(transports: list[SimTransport], name: str, incarnation: int, seed: str) -> Side:
        return VllmSide(transports, name, incarnation, config)

    return make


KVPROTO_CONFIG = LeaseConfig(max_notification_size=MAX_NOTIFICATION)
"""kvproto at its defaults (30 s lease, 5 s interval, 20 s extension, grants unclaimed
for at most 20 s, 480 s turn-2 TTL)."""


def kvproto_policy(config: LeaseConfig, *, name: str, summary: str) -> Policy:
    """kvproto's core with ``config`` (the default policy, or a real run's lease settings)."""

    def make(transports: list[SimTransport], engine: str, incarnation: int, seed: str) -> Side:
        return KvprotoSide(transports, engine, incarnation, config, seed)

    return Policy(
        name=name,
        summary=summary,
        turn1_ttl=config.grant_ttl,
        turn2_ttl=config.decoder_kv_blocks_ttl,
        make=make,
    )


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy(
            name="fixed-480",
            summary="vLLM before leases: one 480 s timeout, no heartbeat",
            turn1_ttl=480.0,
            turn2_ttl=480.0,
            make=_vllm(
                VllmLeaseConfig(
                    kv_lease_duration=480,
                    decoder_kv_blocks_ttl=480,
                    heartbeats=False,
                    clock_sync=False,
                )
            ),
        ),
        Policy(
            name="fixed-short",
            summary="one 30 s timeout, no heartbeat",
            turn1_ttl=30.0,
            turn2_ttl=30.0,
            make=_vllm(
                VllmLeaseConfig(
                    kv_lease_duration=30,
                    decoder_kv_blocks_ttl=30,
                    heartbeats=False,
                    clock_sync=False,
                )
            ),
        ),
        Policy(
            name="vllm-v4",
            summary="vLLM's first lease release (PR #41383): head-stopping reaper (#58222), "
            "turn-2 deadlines across unrelated clocks",
            turn1_ttl=30.0,
            turn2_ttl=480.0,
            make=_vllm(VllmLeaseConfig(reaper="head-stop", clock_sync=False)),
        ),
        Policy(
            name="vllm-lease",
            summary="vLLM 0.32.0 as shipped: text heartbeats, raw counting, full-scan reaper, "
            "clock-offset turn-2 check, no read fence",
            turn1_ttl=30.0,
            turn2_ttl=480.0,
            make=_vllm(VllmLeaseConfig()),
        ),
        kvproto_policy(
            KVPROTO_CONFIG,
            name="kvproto",
            summary="kvproto's core: sessions, fenced reads, distinct consumers",
        ),
    )
}

DEFAULT_POLICIES: tuple[str, ...] = ("fixed-480", "fixed-short", "vllm-lease", "kvproto")
"""What ``kvproto simulate`` compares with no ``--policy``: vLLM as shipped and kvproto.
``vllm-v4`` (historical, fixed upstream) runs with ``--policy vllm-v4`` or ``all``."""
