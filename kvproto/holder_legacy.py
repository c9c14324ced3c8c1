"""Stock vLLM peers: their heartbeats and done notifications, applied to the holder's leases.

A stock peer (``accept_legacy``) has no session: it names requests, not
leases, renews each lease on its own and counts raw done notifications
against the count it sends (:mod:`kvproto.legacy`). Its leases move through
the same lease table as any other; the peer's name is their owner.
"""

from __future__ import annotations

from kvproto import legacy
from kvproto.errors import RemoteProtocolError
from kvproto.events import ReleaseReason
from kvproto.holder_book import LeaseBook
from kvproto.states import LeaseInput
from kvproto.transport import PeerId


def handle_legacy(book: LeaseBook, now: float, peer: PeerId, data: bytes) -> None:
    """Apply a frame that is not kvproto's; drop (and count) it unless it is a stock one."""
    config, stats = book.config, book.stats
    if not config.accept_legacy:
        stats.malformed += 1
        return
    try:
        frame = legacy.parse(data)
    except RemoteProtocolError:
        stats.malformed += 1
        return
    stats.legacy_frames += 1
    owner = "legacy:" + peer
    ids = frame.request_ids if isinstance(frame, legacy.LegacyHeartbeat) else (frame.request_id,)
    if len(ids) > config.max_ids_per_frame:
        stats.limit_refusals += 1
        return
    table = book.leases
    for request_id in ids:
        slot = table.slot_of_request(request_id)
        if slot is None:
            stats.unknown_lease += 1
            continue
        claimed_by = table.owner(slot)
        if claimed_by is not None and claimed_by != owner:
            stats.owner_mismatch += 1
            continue
        if table.terminal(slot):
            if isinstance(frame, legacy.LegacyDone):
                stats.late_done += 1
            continue
        if claimed_by is None:
            table.set_claimer(slot, owner)
            book.transition(slot, LeaseInput.CLAIM)
        if isinstance(frame, legacy.LegacyHeartbeat):
            # Stock peers renew per lease; there is no session to renew.
            table.own[slot] = max(table.own[slot], now + config.lease_extension)
            continue
        # Stock vLLM counts raw notifications against the count the reader sends.
        done = table.legacy_done.get(slot, 0) + 1
        table.legacy_done[slot] = done
        if done >= frame.expected:
            book.end(now, slot, LeaseInput.LAST_DONE, ReleaseReason.DONE)
        else:
            book.transition(slot, LeaseInput.DONE)
