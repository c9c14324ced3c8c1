"""Counters and gauges kept by the core, for bindings to export.

Plain integer attributes (cheap to bump on the hot path); ``snapshot()``
returns them with stable names that the vLLM adapter turns into Prometheus
metrics (``kvproto_<side>_<name>``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

_READERS: dict[tuple[type, str], tuple[tuple[str, ...], attrgetter[Any]]] = {}


def counts_of(counters: Any, prefix: str = "") -> dict[str, int]:
    """A flat dataclass of counters as ``{prefix + name: value}``.

    What ``dataclasses.asdict`` returns for these, without its recursive deep
    copy: bindings call this every engine step (vLLM asks for connector stats at
    each one), where asdict cost ~50 µs per counter class and this ~1 µs.
    The field names (and their prefixed keys) are read once per class.
    """
    key = (type(counters), prefix)
    entry = _READERS.get(key)
    if entry is None:
        names = tuple(f.name for f in fields(counters))
        entry = _READERS[key] = (tuple(prefix + n for n in names), attrgetter(*names))
    keys, read = entry
    values = read(counters)
    if len(keys) == 1:  # attrgetter of one name returns the bare value
        values = (values,)
    return dict(zip(keys, values, strict=True))


@dataclass(slots=True)
class HolderStats:
    """Holder-side counters; gauges are filled in by ``Holder.stats_snapshot``."""

    grants: int = 0
    """Leases granted or adopted."""
    claims: int = 0
    """Leases claimed by a reader (first proof)."""
    heartbeats: int = 0
    """Heartbeat frames applied (each renews every lease of its session)."""
    released_done: int = 0
    """Leases freed because every consumer finished."""
    expired: int = 0
    """Leases freed because they lapsed."""
    aborted: int = 0
    """Leases freed because the reader aborted."""
    revoked: int = 0
    """Leases freed by local revocation."""
    max_hold: int = 0
    """Leases freed at the hard hold cap."""
    peer_lost: int = 0
    """Leases freed because their readers' transport peers were lost."""
    write_fenced: int = 0
    """Writable leases (push mode) that ended while a writer was still armed: quarantined,
    freed once no write can land (``WriteFenced``, then ``FreeBlocks``)."""
    done_frames: int = 0
    """Done frames received."""
    arm_frames: int = 0
    """Arm frames received (push mode: a writer about to write)."""
    late_done: int = 0
    """Done frames for a lease that had already ended (answered LATE)."""
    duplicate_done: int = 0
    """Done frames from a consumer already counted."""
    unknown_lease: int = 0
    """Frames naming a lease this holder never granted (or forgot)."""
    bad_proof: int = 0
    """Claims whose proof did not match the token."""
    owner_mismatch: int = 0
    """Frames for a lease claimed by another reader engine."""
    malformed: int = 0
    """Frames that did not parse (dropped)."""
    oversize: int = 0
    """Frames larger than max_frame_bytes (dropped)."""
    rate_limited: int = 0
    """Frames dropped by a peer's rate limit."""
    replayed: int = 0
    """Heartbeats whose sequence number was already seen, or older Hellos (dropped)."""
    implausible_seq: int = 0
    """Authenticated heartbeats whose seq jumps too far ahead of the last accepted (dropped)."""
    bad_mac: int = 0
    """Frames not signed with their session's key (forged, or a crossed key): no state change."""
    bad_hello: int = 0
    """Hellos without a valid anchor (no ticket proven): nothing opened, nothing answered."""
    bad_rank_done: int = 0
    """Done frames from a rank outside the lease's expected consumers (never counted)."""
    no_session: int = 0
    """Frames from a peer without a session (answered Reject)."""
    limit_refusals: int = 0
    """Sessions or claims refused by a configured cap."""
    resyncs: int = 0
    """Heartbeats answered with a resync request."""
    legacy_frames: int = 0
    """Stock-vLLM text frames applied."""
    unexpected_frames: int = 0
    """Well-formed frames of a kind a holder never receives."""

    def snapshot(self) -> dict[str, int]:
        """Counter name → value."""
        return counts_of(self)


@dataclass(slots=True)
class ReaderStats:
    """Reader-side counters."""

    tracked: int = 0
    """Requests tracked from scheduler entry."""
    heartbeats_sent: int = 0
    """Heartbeat frames sent."""
    heartbeat_bytes: int = 0
    """Bytes of heartbeat frames sent."""
    acks: int = 0
    """Heartbeat acknowledgements applied."""
    reads_started: int = 0
    """Read orders handed to the binding."""
    writes_started: int = 0
    """Write orders handed to the binding (push mode; also counted in ``reads_started``)."""
    aborts_held: int = 0
    """Aborts held back while the lease's write was in flight (push mode, W3): sent only
    if the write fails."""
    reads_confirmed: int = 0
    """Requests whose reads every holder rank confirmed."""
    declined: int = 0
    """Reads not started because the lease might end first."""
    reads_after_failure: int = 0
    """``begin_read`` of a request that had failed since the caller's checks (a race):
    declined with the failure's reason."""
    deferred: int = 0
    """Reads put off for one early heartbeat instead of declined (at most once a request)."""
    fenced: int = 0
    """Reads discarded because the holder could not confirm the lease (LATE or no ack)."""
    lost: int = 0
    """Requests failed because the holder no longer held the lease."""
    done_resent: int = 0
    """Done frames re-sent for lack of an acknowledgement."""
    malformed: int = 0
    """Frames that did not parse (dropped)."""
    unexpected_frames: int = 0
    """Frames that make no sense in the current state (dropped)."""
    rejects: int = 0
    """Reject frames received."""
    bad_mac: int = 0
    """Frames not signed with the session's key, or a HELD without the lease's proof (dropped)."""
    resyncs: int = 0
    """Full lease lists sent on the holder's request."""
    late_read_results: int = 0
    """Read results for a request no longer tracked (finished while reading; ignored)."""
    untracked_finishes: int = 0
    """``finish`` of a request not tracked (finished twice, or never tracked; ignored)."""
    stale_connects: int = 0
    """``connected`` for a session that broke while connecting (ignored)."""
    fanout_joins: int = 0
    """Requests tracked on a ticket another tracked request reads (parallel sampling's
    children): they share its lease's claim, heartbeats and done."""
    fanout_late_reads: int = 0
    """Of those, reads declined because the lease's done had gone without them (they had
    not begun within ``ack_timeout`` of their siblings' reads): recomputed."""
    fanout_done_timeouts: int = 0
    """Lease dones held back ``ack_timeout`` for a sibling that had not begun its read
    (or not been tracked), then sent without it: the landed reads waited that long."""

    def snapshot(self) -> dict[str, int]:
        """Counter name → value."""
        return counts_of(self)
