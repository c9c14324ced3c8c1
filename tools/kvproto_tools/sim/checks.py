"""The oracles that watch holders and readers (spec/simulator.md lists them).

Safety, checked after every engine step and every free:

* S1 no use of freed blocks (``flows.use``), and the fence bound: a lease
  that expires must not be one its reader still believes live;
* S2 never shortened: a holder's deadline for a live lease never decreases;
* S3 no resurrection or leak: each holder rank holds exactly the engine's live holds;
* S4 no double free (``flows.rank_freed``, ``flows.end_hold``).

Liveness (``liveness=True``): L1 a silent dead reader's blocks are freed by
``max(grant + d, last heartbeat + e) + one holder step``; L2 a read whose data
arrived is used or failed within ``ack_timeout`` + two reader steps; L3 no
hold is left at the end of a run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvproto.tpmath import target_remote_ranks
from kvproto_tools.sim.model import Hold, Req, ReqState

if TYPE_CHECKING:
    from kvproto_tools.sim.books import Books
    from kvproto_tools.sim.cluster import Cluster
    from kvproto_tools.sim.context import ClusterView, LedgerView
    from kvproto_tools.sim.model import EngineState


def holder_oracles(books: Books, eng: EngineState) -> None:
    """S2 (never shortened) and S3 (no resurrection, no leak) for every holder rank."""
    side = eng.side
    counts = [0] * eng.tp
    for hold in eng.holds.values():
        for rank in hold.ranks_live:
            counts[rank] += 1
            d = side.holder_deadline(rank, hold.key)
            if d is None:
                continue
            prev = hold.deadlines.get(rank)
            if prev is not None and d < prev - 1e-9 and not eng.transports[rank].disturbed:
                books.violate(
                    "safety",
                    "S2 shortened",
                    f"{eng.name} rank {rank} moved {hold.key[:18]}'s deadline "
                    f"from {prev:.3f} back to {d:.3f}",
                )
            hold.deadlines[rank] = d
    for rank, tr in enumerate(eng.transports):
        tr.disturbed = False
        live = side.holder_live(rank)
        if live != counts[rank]:
            books.violate(
                "safety",
                "S3 resurrection",
                f"{eng.name} rank {rank} holds {live} leases, the engine {counts[rank]} live holds",
            )


def bound_oracle(ctx: LedgerView, hold: Hold, rank: int) -> None:
    """S1 (fence): an expiring lease must not be one its reader still believes live."""
    req = hold.req
    if req is None or req.reader is None or not req.reader.alive:
        return
    if req.state not in (ReqState.TRACKED, ReqState.READING) or req.finished:
        return
    reader = req.reader
    now = reader.clock.local(ctx.clock.t)
    for rr in range(reader.tp):
        if rank not in target_remote_ranks(rr, reader.tp, hold.engine.tp):
            continue
        bound = reader.side.reader_bound(now, rr, req.key)
        if bound is None or bound == -math.inf:
            continue
        if reader.clock.to_global(bound) > ctx.clock.t + 1e-6:
            ctx.books.violate(
                "safety",
                "S1 fence bound",
                f"{reader.name} rank {rr} believes {req.key[:18]} held until "
                f"{reader.clock.to_global(bound):.3f}, {hold.engine.name} rank {rank} "
                f"expired it at {ctx.clock.t:.3f}",
            )


def l1_bound(cluster: Cluster, hold: Hold) -> float:
    """Latest global time a dead reader's blocks may still be held (L1)."""
    eng = hold.engine
    req = hold.req
    best = hold.granted_local + hold.ttl
    ext = eng.side.renew_extension
    if ext is not None and req is not None and req.reader is not None:
        for rank in range(eng.tp):
            last = cluster.last_hb.get((eng.name, hold.incarnation, rank, req.reader.name))
            if last is not None:
                best = max(best, last + ext)
    return eng.clock.to_global(best) + eng.max_step + 1e-6


def check_l1(ctx: ClusterView, hold: Hold) -> None:
    """L1 at the bound's time: the dead reader's hold must have ended."""
    if hold.ended_at is not None:
        return
    bound = l1_bound(ctx.cluster, hold)
    if bound > ctx.clock.t:
        ctx.clock.at(bound, lambda: check_l1(ctx, hold))
        return
    ctx.books.violate(
        "liveness",
        "L1 dead reader",
        f"{hold.engine.name} still holds {hold.key[:18]} of dead "
        f"{hold.req.reader.name if hold.req and hold.req.reader else '?'} past its bound "
        f"{bound:.3f} (last heartbeat + extension + one step)",
    )


def check_l2(ctx: LedgerView, req: Req, copied: float) -> None:
    """L2: a read whose data arrived must be used or failed by now."""
    if req.state is ReqState.READING and req.reader is not None and req.reader.alive:
        ctx.books.violate(
            "liveness",
            "L2 read unresolved",
            f"{req.reader.name} neither used nor failed {req.key[:18]} "
            f"{ctx.clock.t - copied:.3f} s after its data arrived",
        )
