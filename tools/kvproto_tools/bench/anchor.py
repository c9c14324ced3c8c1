"""The anchor side of every comparison: the restated vLLM lease v4 path.

Thin glue over :mod:`kvproto_tools.baselines.vllm_lease` (the one
restatement, shared with the simulator): it builds a prefill holder with N
granted leases, the ``HB:`` frame a decoder sends for them, and a decoder
whose every holder engine is already handshaken (the steady state).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproto import legacy
from kvproto_tools.baselines.vllm_lease import (
    Reaper,
    VllmLeaseConfig,
    VllmLeaseHolder,
    VllmLeaseReader,
    worker_heartbeats,
)


def vllm_prefill(request_ids: list[str], *, reaper: Reaper, now: float = 0.0) -> VllmLeaseHolder:
    """A P worker's lease table holding every id, granted at ``now``."""
    holder = VllmLeaseHolder(VllmLeaseConfig(reaper=reaper))
    for rid in request_ids:
        holder.grant(now, rid)
    return holder


@dataclass(slots=True)
class VllmPrefill:
    """The same N leases under both reapers, for the same ids kvproto holds."""

    request_ids: list[str]
    """The holder-side request ids (vLLM ``remote_request_id``)."""
    full_scan: VllmLeaseHolder
    """Corrected reaper: visits every entry each step (the figures' anchor)."""
    head_stop: VllmLeaseHolder
    """vLLM's reaper: stops at the first live entry (cheap, and wrong: #58222)."""


def prefill_pair(request_ids: list[str], *, now: float) -> VllmPrefill:
    """Both reapers' tables over ``request_ids``, granted at ``now``."""
    return VllmPrefill(
        request_ids=request_ids,
        full_scan=vllm_prefill(request_ids, reaper="full-scan", now=now),
        head_stop=vllm_prefill(request_ids, reaper="head-stop", now=now),
    )


def heartbeat_frame(request_ids: list[str]) -> bytes:
    """``HB:id1,id2,...``: what one decoder sends each tick for these waiting requests."""
    return legacy.encode_heartbeat(request_ids)


class _Everyone:
    """Every engine counts as handshaken: the steady state, no dropped ticks."""

    def __contains__(self, engine: object) -> bool:
        return True


class VllmDecode:
    """A decoder's scheduler throttle plus one worker's heartbeat build, every engine connected."""

    def __init__(self) -> None:
        self.scheduler = VllmLeaseReader(VllmLeaseConfig())
        self._all = _Everyone()

    def track(self, engine: str, request_id: str) -> None:
        """``on_new_request`` for a request whose blocks ``engine`` holds."""
        self.scheduler.on_new_request(request_id, engine)

    def tick(self, now: float) -> dict[str, bytes]:
        """One engine step: the frames sent (empty while the global throttle holds)."""
        meta = self.scheduler.build_meta(now)
        if meta is None:
            return {}
        frames, _ = worker_heartbeats(meta, self._all)
        return dict(frames)
