"""The side-channel handshake (ZMQ in deployments): make holder ranks reachable."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvproto_tools.sim.cluster import Cluster
    from kvproto_tools.sim.context import HandshakeView
    from kvproto_tools.sim.model import EngineState
    from kvproto_tools.sim.sides import HandshakeAsk


def resolve_engine(cluster: Cluster, engine_id: str) -> tuple[EngineState | None, int | None]:
    """(engine, incarnation) for an engine id (kvproto: name; vLLM: name.incarnation)."""
    name, _, inc = engine_id.partition(".")
    eng = cluster.engines.get(name)
    return eng, (int(inc) if inc else None)


def handshake(ctx: HandshakeView, eng: EngineState, ask: HandshakeAsk) -> None:
    """Connect a reader rank to holder ranks over the side channel (ZMQ in deployments)."""
    ctx.books.extra["handshakes"] += 1
    holder, inc = resolve_engine(ctx.cluster, ask.engine_id)
    s = ctx.settings
    rtt = 2 * ctx.scenario.link.delay + s.handshake_cost
    start = ctx.clock.t
    serial = not eng.side.uses_fence  # vLLM: one handshake thread per worker
    if serial:
        start = max(start, eng.hs_busy.get(ask.rank, start))
    reader_inc = eng.incarnation

    def ok() -> bool:
        if holder is None or not holder.alive or not eng.alive:
            return False
        if eng.incarnation != reader_inc or (inc is not None and holder.incarnation != inc):
            return False
        me = f"{eng.name}r{ask.rank}"
        return not any(
            ctx.fabric.net.partitioned(me, f"{holder.name}r{r}") for r in ask.holder_ranks
        )

    def done() -> None:
        if not eng.alive or eng.incarnation != reader_inc:
            return
        if ok():
            assert holder is not None
            meta: dict[int, bytes] = {}
            me = eng.transports[ask.rank]
            for r in ask.holder_ranks:
                htr = holder.transports[r]
                htr.real.add_peer(me.metadata())  # the holder learns the reader too
                meta[r] = htr.metadata()
            offset = holder.clock.local(ctx.clock.t) - eng.clock.local(ctx.clock.t)
            eng.hs_results.append((ask, meta, offset))
        else:
            ctx.books.extra["handshakes_failed"] += 1
            eng.hs_results.append((ask, None, 0.0))
        ctx.steps.request_wake(eng, ctx.clock.t)

    when = start + rtt
    if not ok():
        when = start + s.handshake_timeout
    if serial:
        eng.hs_busy[ask.rank] = when
    ctx.clock.at(when, done)
