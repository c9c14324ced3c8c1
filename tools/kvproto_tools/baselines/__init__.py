"""Restatements of other systems' lease protocols, for comparison with kvproto."""

from kvproto_tools.baselines.vllm_lease import (
    VllmHolderStats,
    VllmLeaseConfig,
    VllmLeaseHolder,
    VllmLeaseReader,
    completion_frame,
    turn2_read_allowed,
    worker_heartbeats,
)

__all__ = [
    "VllmHolderStats",
    "VllmLeaseConfig",
    "VllmLeaseHolder",
    "VllmLeaseReader",
    "completion_frame",
    "turn2_read_allowed",
    "worker_heartbeats",
]
