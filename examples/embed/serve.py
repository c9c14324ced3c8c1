"""One request served over any transport pair: the step loop an embedding runs.

Prefill holds a request's KV blocks under a lease; decode tracks the lease from
the moment the request is queued, heartbeats it while it waits, reads the blocks
and confirms the read; prefill frees the blocks on the done. Each side is one
:class:`kvproto_binding.Binding` (a core and a transport); the embedding owns
the clock and calls ``step(now)`` on both, as an engine would once per step.
"""

from __future__ import annotations

from collections.abc import Callable

from kvproto import Holder, LeaseConfig, Reader, ReadGo, Transport
from kvproto_binding import Binding

STEP_S = 0.1
"""Seconds between two steps (an engine steps far more often; the cores do not mind)."""


def one_request(
    prefill_wire: Transport,
    decode_wire: Transport,
    *,
    queued_s: float = 60.0,
    clock_moved: Callable[[float], None] = lambda now: None,
) -> list[str]:
    """Serve request ``req-1``: queued at decode for ``queued_s`` seconds, then read
    (prefill blocks 5, 6 into decode blocks 0, 1). Returns what happened, in order.

    ``now`` starts at 0 and moves ``STEP_S`` a step: a simulated clock, so that a
    minute of lease time runs in a blink; a server passes ``time.monotonic()``.
    ``clock_moved(now)`` is called before each step (a simulated network moves
    its wire there).
    """
    config = LeaseConfig()  # vLLM's timing: a 30 s lease, a heartbeat every 5 s
    holder = Holder(config, engine="prefill", incarnation=1)  # prefill's core
    reader = Reader(config, engine="decode", incarnation=1)  # decode's core
    prefill = Binding(prefill_wire, holder=holder)
    decode = Binding(decode_wire, reader=reader)
    # The holder must be able to answer the reader: in a deployment the side channel
    # hands prefill decode's metadata (and decode prefill's, on Connect below).
    prefill_wire.add_peer(decode_wire.metadata())
    happened: list[str] = []
    now = 0.0

    def step() -> None:
        clock_moved(now)
        for freed in prefill.step(now).freed:
            happened.append(f"{now:.1f} s: prefill freed {freed.request_id} ({freed.reason.name})")
        result = decode.step(now)
        for connect in result.connects:  # decode asks to reach prefill's holder rank
            decode.connected(
                now, engine=connect.engine, rank=connect.rank, metadata=prefill_wire.metadata()
            )
        for rid in result.confirmed:  # the blocks read are safe to use: the request is done
            happened.append(f"{now:.1f} s: decode read {rid}, confirmed")
            reader.finish(now, rid)
        happened.extend(f"{now:.1f} s: decode failed {f.request_id}" for f in result.failed)

    ticket = holder.grant(now, request_id="req-1")  # travels with the request
    reader.track(now, request_id="req-1", ticket=ticket)  # queued at decode
    while now < queued_s:  # twice the lease: the heartbeats keep it
        now += STEP_S
        step()
    held = holder.is_live(ticket.lease)
    happened.append(f"{now:.1f} s: still held after {queued_s:.0f} s queued: {held}")
    go = decode.start_read(now, "req-1", local_blocks=[0, 1], remote_blocks=[5, 6])
    assert isinstance(go, ReadGo), go  # the lease is safely live: read now
    while (holder.live_leases() or reader.tracked()) and now < 2 * queued_s:
        now += STEP_S
        step()
    return happened
