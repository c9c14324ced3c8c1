"""What engines do with requests: prefill and grant, route, track, read, use or recompute.

Free functions, each over the view of a run it needs (:mod:`.context`: the
clock and the books, the cluster, the step loop, the policy, the network), so
that the event loop (engine.py) stays small and none of this imports it. A
flow's view covers the flows it calls or schedules. Holder side: a prefill finishes, its
blocks get real bytes and a lease, the request goes to a decoder. Reader
side: the request is tracked, waits in the queue, reads at a step boundary,
and is used (kvproto: only after the holder confirmed) or recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvproto_tools.sim import checks
from kvproto_tools.sim.cluster import route
from kvproto_tools.sim.memory import block_bytes, rank_heads
from kvproto_tools.sim.model import Hold, Req, ReqState
from kvproto_tools.sim.sides import ReadStart
from kvproto_tools.sim.workload import Arrival, prompt_blocks

if TYPE_CHECKING:
    from kvproto.transport import ReadId
    from kvproto_tools.sim.context import (
        ClusterView,
        CopyView,
        FreeView,
        GrantView,
        LedgerView,
        PrefillView,
        RequestView,
        WakeView,
    )
    from kvproto_tools.sim.model import EngineState
    from kvproto_tools.sim.transport import SimTransport


def prefill_arrival(ctx: WakeView, a: Arrival) -> None:
    """A client request reaches the prefill tier: queue it at a live P."""
    eng = route(ctx.cluster.prefill, a.prefill)
    if eng is None:
        ctx.books.open_requests -= 1
        ctx.books.extra["lost"] += 1
        return
    eng.queue.append(a)
    ctx.steps.request_wake(eng, ctx.clock.t)


def prefill_work(ctx: PrefillView, eng: EngineState, now: float) -> None:
    """Finish the running prefill (grant its blocks) and start the next one."""
    t = ctx.clock.t
    if eng.current is not None and eng.busy_until is not None and t >= eng.busy_until:
        done, blocks = eng.current
        eng.current = None
        eng.busy_until = None
        prefill_done(ctx, eng, now, done, blocks)
    if eng.current is None and eng.queue:
        a = eng.queue[0]
        taken = eng.pool.allocate(prompt_blocks(a.prompt_tokens), a)
        if taken is None:
            return  # P is full: new work waits for blocks (vLLM #50789)
        eng.queue.popleft()
        eng.current = (a, taken)
        eng.busy_until = t + ctx.settings.prefill_time(a.prompt_tokens)
        ctx.steps.request_wake(eng, eng.busy_until)


def new_hold(
    ctx: LedgerView,
    eng: EngineState,
    *,
    now: float,
    key: str,
    blocks: list[int],
    content: int,
    ttl: float,
) -> Hold:
    """Write the blocks' bytes on every rank and grant them to a future reader."""
    hold = Hold(
        key=key,
        engine=eng,
        incarnation=eng.incarnation,
        blocks=blocks,
        content=content,
        granted_at=ctx.clock.t,
        granted_local=now,
        ttl=ttl,
        ranks_live=set(range(eng.tp)),
    )
    for b in blocks:
        eng.pool.owner[b] = hold
    for rank, tr in enumerate(eng.transports):
        heads = rank_heads(rank, eng.tp)
        for j, b in enumerate(blocks):
            tr.real.write_block(0, b, block_bytes(content, j, heads))
    hold.ticket = eng.side.grant(now, hold)
    eng.holds[key] = hold
    ctx.books.open_holds += 1
    ctx.books.held(hold.nblocks)
    return hold


def prefill_done(
    ctx: PrefillView, eng: EngineState, now: float, a: Arrival, blocks: list[int]
) -> None:
    """Prefill finished: grant the blocks and send the request to a decoder."""
    hold = new_hold(
        ctx,
        eng,
        now=now,
        key=a.request_id,
        blocks=blocks,
        content=2 * a.index + 1,
        ttl=ctx.policy.turn1_ttl,
    )
    req = Req(key=hold.key, turn=1, arrival=a, hold=hold, tokens=a.prompt_tokens)
    hold.req = req
    ctx.cluster.reqs[req.key] = req
    reader = route(ctx.cluster.decode, a.decode)
    ctx.books.note(
        f"{eng.name} granted {hold.key[:18]} ({hold.nblocks} blocks) for "
        f"{reader.name if reader else 'nobody'}"
    )
    if reader is None:
        lose(ctx, req)
        return
    if a.dropped:
        ctx.clock.at(ctx.clock.t + ctx.settings.proxy_delay, lambda: drop(ctx, req))
        return
    req.reader = reader
    ctx.clock.at(ctx.clock.t + ctx.settings.proxy_delay, lambda: reader_arrival(ctx, req))


def drop(ctx: PrefillView, req: Req) -> None:
    """The router drops the request on its way to the decoder: nobody will claim it."""
    hold = req.hold
    req.state = ReqState.LOST
    mark_dead(hold, ctx.clock.t)
    ctx.books.extra["dropped"] += 1
    ctx.books.drops.append((ctx.clock.t, hold))
    ctx.books.note(f"router drops {req.key[:18]}")
    request_done(ctx, req)
    eng = hold.engine
    if ctx.scenario.router_release and eng.alive and hold.ended_at is None:
        eng.side.release(eng.clock.local(ctx.clock.t), hold)
        ctx.steps.effects(eng)
    if ctx.liveness:
        checks.check_l1(ctx, hold)


def rank_freed(ctx: FreeView, eng: EngineState, rank: int, key: str, reason: str) -> None:
    """One holder rank freed its lease; the engine frees the blocks when every rank has."""
    hold = eng.holds.get(key)
    if hold is None or rank not in hold.ranks_live:
        ctx.books.violate(
            "safety",
            "S4 double free",
            f"{eng.name} rank {rank} freed {key[:18]} that it does not hold",
        )
        return
    hold.ranks_live.discard(rank)
    hold.end_reason = reason
    if reason == "expired" and ctx.policy.name == "kvproto":
        checks.bound_oracle(ctx, hold, rank)
    if not hold.ranks_live:
        end_hold(ctx, hold, lost=False)


def end_hold(ctx: LedgerView, hold: Hold, *, lost: bool) -> None:
    """Every rank freed (or the holder died): the blocks are gone."""
    eng = hold.engine
    t = ctx.clock.t
    hold.ended_at = t
    hold.lost = lost
    if lost:
        hold.end_reason = "lost"
    del eng.holds[hold.key]
    if ctx.books.ended is not None:
        ctx.books.ended.append(hold)
    ctx.books.open_holds -= 1
    ctx.books.held(-hold.nblocks)
    req = hold.req
    if not lost:
        bad = eng.pool.release(hold.blocks, hold)
        if bad:
            ctx.books.violate(
                "safety",
                "S4 double free",
                f"{eng.name} freed {bad} blocks of {hold.key[:18]} twice",
            )
        if hold.dead_since is None and req is not None and req.state.waiting_for_blocks:
            ctx.books.metrics.premature_frees += 1
            ctx.books.note(
                f"{eng.name} freed {hold.key[:18]} ({hold.end_reason}) while its reader "
                f"{req.reader.name if req.reader else '?'} still needs it (premature)"
            )
        else:
            ctx.books.note(f"{eng.name} freed {hold.key[:18]} ({hold.end_reason})")
    if hold.dead_since is not None:
        ctx.books.metrics.dead_block_seconds += hold.nblocks * (t - hold.dead_since)


def mark_dead(hold: Hold, t: float) -> None:
    """From ``t`` on, no live reader will use ``hold``'s blocks."""
    if hold.dead_since is None and hold.ended_at is None:
        hold.dead_since = t


def reader_arrival(ctx: WakeView, req: Req) -> None:
    """The request reaches its reader engine: queue it for tracking at the next step."""
    reader = req.reader
    if req.state is not ReqState.TRANSIT or reader is None:
        return
    if not reader.alive:
        lose(ctx, req)
        return
    reader.arrivals.append(req)
    wait = req.arrival.queue_wait if req.turn == 1 else 0.0
    req.admit_at = ctx.clock.t + wait
    ctx.steps.request_wake(reader, ctx.clock.t)
    if wait > 0:
        ctx.clock.at(req.admit_at, lambda: ctx.steps.request_wake(reader, req.admit_at))


def reader_work(ctx: RequestView, eng: EngineState, now: float) -> None:
    """Track new arrivals; start the reads of requests whose queue wait is over."""
    side = eng.side
    arrivals, eng.arrivals = eng.arrivals, []
    for req in arrivals:
        if req.state is not ReqState.TRANSIT:
            continue
        req.state = ReqState.TRACKED
        side.track(now, req)
        ctx.books.note(f"{eng.name} tracks {req.key[:18]}")
        eng.waiting.append(req)
        ctx.steps.effects(eng)
    t = ctx.clock.t
    still: list[Req] = []
    for req in eng.waiting:
        if req.state is not ReqState.TRACKED:
            continue
        if req.admit_at > t:
            still.append(req)
            continue
        if req.local_blocks is None:
            n = len(req.hold.blocks)
            req.local_blocks = eng.pool.allocate(n, req)
            if req.local_blocks is None:
                still.append(req)
                continue
        outcome = side.try_read(now, req)
        if outcome is ReadStart.STARTED:
            req.state = ReqState.READING
            ctx.books.note(f"{eng.name} reads {req.key[:18]} from {req.hold.engine.name}")
            if len(req.ranks_ok) == eng.tp:
                use(ctx, req)  # the ranks that read first were confirmed while one waited
        elif outcome is ReadStart.WAIT:
            still.append(req)
        ctx.steps.effects(eng)
        if outcome is ReadStart.DECLINED and req.state.waiting_for_blocks:
            fail(ctx, req, "declined")
    eng.waiting = still


def copied(ctx: CopyView, tr: SimTransport, read_id: ReadId) -> None:
    """The loopback copied a read's data just now: did it overlap a free?"""
    rec = ctx.fabric.reads.pop((tr.real.local_peer, read_id), None)
    if rec is None:
        return
    t = ctx.clock.t
    rec.copied_at = t
    req = rec.req
    hold = req.hold
    rec.intact = (
        hold.ended_at is None
        and hold.engine.incarnation == hold.incarnation
        and hold.engine.pool.owns(hold.blocks, hold)
    )
    if not rec.intact:
        ctx.books.note(
            f"{tr.real.local_peer} copied {req.key[:18]} AFTER {hold.engine.name} freed it"
        )
    req.reads_copied += 1
    if req.reads_copied == len(req.reads) and req.state is ReqState.READING:
        mark_dead(hold, t)  # the data has moved: the holder's copy serves nobody now
    if ctx.liveness and req.reader is not None:
        wait = 2 * req.reader.max_step + 1e-6
        if req.reader.side.uses_fence:
            wait += 5.0  # ack_timeout
        ctx.clock.at(t + wait, lambda: checks.check_l2(ctx, req, t))


def use(ctx: RequestView, req: Req) -> None:
    """Every reader rank may use its blocks: the model computes with them."""
    eng = req.reader
    assert eng is not None
    req.state = ReqState.USED
    ctx.books.extra["used"] += 1
    overlapped = [r for r in req.reads if r.intact is not True]
    corrupted = not bytes_ok(req)
    if corrupted:
        ctx.books.extra["corrupted"] += 1
    if overlapped:
        ctx.books.metrics.overlapped_reads += 1
        ctx.books.violate(
            "safety",
            "S1 use after free",
            f"{eng.name} used {req.key[:18]} read from {req.hold.engine.name} (granted at "
            f"{req.hold.granted_at:.3f}) after it was freed at {req.hold.ended_at:.3f} "
            f"({req.hold.end_reason})" + ("; the bytes differ" if corrupted else ""),
        )
    elif corrupted:
        ctx.books.violate(
            "safety",
            "S0 simulator",
            f"{req.key[:18]}: bytes differ though no free overlapped the read",
        )
    ctx.books.note(f"{eng.name} uses {req.key[:18]}")
    resolve(ctx, req)


def bytes_ok(req: Req) -> bool:
    """Whether every reader rank received exactly the bytes the holder wrote."""
    eng = req.reader
    assert eng is not None and req.local_blocks is not None
    content = req.hold.content
    for rank, tr in enumerate(eng.transports):
        heads = rank_heads(rank, eng.tp)
        for j, b in enumerate(req.local_blocks):
            if tr.real.read_block(0, b) != block_bytes(content, j, heads):
                return False
    return True


def fail(ctx: RequestView, req: Req, reason: str) -> None:
    """The reader cannot use the blocks: it recomputes them."""
    req.state = ReqState.FAILED
    ctx.books.metrics.wasted_prefill_tokens += req.tokens
    ctx.books.extra["recomputed"] += 1
    mark_dead(req.hold, ctx.clock.t)
    ctx.books.note(f"{req.reader.name if req.reader else '?'} recomputes {req.key[:18]} ({reason})")
    resolve(ctx, req)


def resolve(ctx: RequestView, req: Req) -> None:
    """The request no longer needs the holder: tell the side, then decode or finish."""
    eng = req.reader
    assert eng is not None
    if not req.finished:
        req.finished = True
        eng.side.finish(eng.clock.local(ctx.clock.t), req)
    if req.turn == 1:
        duration = req.arrival.output_tokens * ctx.scenario.d_steps.step
        end = eng.boundary(ctx.clock.t + duration)
        ctx.clock.at(end, lambda: decode_done(ctx, req))
    else:
        release_local(req)
        request_done(ctx, req)


def release_local(req: Req) -> None:
    """Free the reader-side blocks the request read into."""
    eng = req.reader
    if req.local_blocks is not None and eng is not None and eng.alive:
        eng.pool.release(req.local_blocks, req)
    req.local_blocks = None


def request_done(ctx: ClusterView, req: Req) -> None:
    """The request left the system."""
    ctx.cluster.reqs.pop(req.key, None)
    ctx.books.open_requests -= 1


def lose(ctx: ClusterView, req: Req) -> None:
    """The request died with an engine (not counted as recomputed)."""
    req.state = ReqState.LOST
    mark_dead(req.hold, ctx.clock.t)
    ctx.books.extra["lost"] += 1
    request_done(ctx, req)


def decode_done(ctx: GrantView, req: Req) -> None:
    """Decoding ended: free the blocks, or keep them as turn-2 blocks for the client."""
    eng = req.reader
    assert eng is not None
    if req.key not in ctx.cluster.reqs or not eng.alive:
        return  # lost with its engine
    a = req.arrival
    if not a.turn2:
        release_local(req)
        request_done(ctx, req)
        return
    # Bidirectional: D keeps the conversation's KV (prompt + output) for turn 2.
    now = eng.clock.local(ctx.clock.t)
    need = prompt_blocks(a.prompt_tokens + a.output_tokens)
    mine = req.local_blocks or []
    more = eng.pool.allocate(max(0, need - len(mine)), req) if need > len(mine) else []
    request_done(ctx, req)
    if more is None:
        release_local(req)
        return
    req.local_blocks = None
    hold = new_hold(
        ctx,
        eng,
        now=now,
        key="t2-" + a.request_id,
        blocks=mine + more,
        content=2 * a.index + 2,
        ttl=ctx.policy.turn2_ttl,
    )
    req2 = Req(
        key=hold.key,
        turn=2,
        arrival=a,
        hold=hold,
        tokens=a.prompt_tokens + a.output_tokens,
        state=ReqState.THINKING,
    )
    hold.req = req2
    ctx.cluster.reqs[req2.key] = req2
    ctx.books.open_requests += 1
    ctx.books.extra["turn2"] += 1
    ctx.clock.at(ctx.clock.t + a.think, lambda: client_returns(ctx, req2))


def client_returns(ctx: GrantView, req: Req) -> None:
    """The client sends turn 2: a prefill engine will read the decoder's blocks."""
    reader = route(ctx.cluster.prefill, req.arrival.turn2_prefill)
    if reader is None:
        lose(ctx, req)
        return
    req.reader = reader
    req.state = ReqState.TRANSIT
    ctx.clock.at(ctx.clock.t + ctx.settings.proxy_delay, lambda: reader_arrival(ctx, req))
