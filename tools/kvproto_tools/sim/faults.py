"""Fault injection: kill -9 of a reader or a holder, restart, partition and heal."""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import TYPE_CHECKING

from kvproto_tools.sim import checks, flows
from kvproto_tools.sim.model import ReqState

if TYPE_CHECKING:
    from kvproto_tools.sim.context import FaultView
    from kvproto_tools.sim.model import EngineState
    from kvproto_tools.sim.scenarios import FaultEvent


def schedule_faults(ctx: FaultView, rng: random.Random) -> None:
    """Put the scenario's faults on the timeline (``rng`` draws the partition's length)."""
    sc = ctx.scenario
    if sc.decode_crash is not None:
        name, when = sc.decode_crash
        ctx.books.faults_pending += 1
        ctx.clock.at(when, lambda: crash_reader(ctx, ctx.cluster.engines[name]))
    if sc.prefill_restart is not None:
        name, when, down = sc.prefill_restart
        ctx.books.faults_pending += 2
        ctx.clock.at(when, lambda: crash_holder(ctx, ctx.cluster.engines[name]))
        ctx.clock.at(when + down, lambda: restart(ctx, ctx.cluster.engines[name]))
    if sc.partition is not None:
        a, b, when, (lo, hi) = sc.partition
        length = rng.uniform(lo, hi)
        ctx.books.faults_pending += 2
        ctx.clock.at(when, lambda: cut(ctx, a, b, heal=False))
        ctx.clock.at(when + length, lambda: cut(ctx, a, b, heal=True))
    for event in sc.events:
        ctx.books.faults_pending += 1
        ctx.clock.at(event.at, functools.partial(apply, ctx, event))


def apply(ctx: FaultView, event: FaultEvent) -> None:
    """One event of the scenario's timeline (:class:`~kvproto_tools.sim.scenarios.FaultEvent`)."""
    engines = ctx.cluster.engines
    if event.action == "kill":
        ctx.books.faults_pending -= 1
        eng = engines[event.engines[0]]
        ctx.books.note(f"kill -9 {eng.name}")
        kill(ctx, eng)
    elif event.action == "restart":
        restart(ctx, engines[event.engines[0]])
    elif event.action in ("cut", "heal"):
        cut(ctx, *event.engines, heal=event.action == "heal")
    elif event.action in ("loss", "lossless"):
        ctx.books.faults_pending -= 1
        a, b = (engines[name] for name in event.engines)
        lossy = dataclasses.replace(ctx.scenario.link, drop=event.drop)
        link = lossy if event.action == "loss" else ctx.scenario.link
        ctx.fabric.set_links(a, b, link)
        ctx.books.note(f"{event.action} {a.name} <-> {b.name}")
    else:
        raise ValueError(f"unknown fault action {event.action!r}")


def cut(ctx: FaultView, a: str, b: str, *, heal: bool) -> None:
    """Partition (or heal) every link between two engines' ranks."""
    ctx.books.faults_pending -= 1
    engines = ctx.cluster.engines
    ctx.fabric.cut(engines[a], engines[b], heal=heal)
    ctx.books.note(f"{'heal' if heal else 'partition'} {a} <-> {b}")


def kill(ctx: FaultView, eng: EngineState) -> None:
    """``kill -9``: endpoints, memory and queued work of ``eng`` vanish at once."""
    eng.alive = False
    eng.next_wake = None
    ctx.fabric.crash(eng)
    # Requests this engine was reading for die with it.
    for req in list(ctx.cluster.reqs.values()):
        if req.reader is not eng:
            continue
        if req.state.waiting_for_blocks:
            flows.lose(ctx, req)
        elif req.state in (ReqState.USED, ReqState.FAILED):
            flows.request_done(ctx, req)  # was decoding: gone with the engine
    # Blocks it held vanish with its memory (they are not "freed").
    for hold in list(eng.holds.values()):
        flows.end_hold(ctx, hold, lost=True)
    lost_jobs = len(eng.queue) + (1 if eng.current is not None else 0)
    ctx.books.open_requests -= lost_jobs
    ctx.books.extra["lost"] += lost_jobs
    eng.queue.clear()
    eng.current = None
    eng.busy_until = None
    eng.arrivals.clear()
    eng.waiting.clear()
    eng.hs_results.clear()
    eng.hs_busy.clear()


def crash_reader(ctx: FaultView, eng: EngineState) -> None:
    """A decoder dies for good; remember what it was going to read (reclaim_s, L1)."""
    ctx.books.faults_pending -= 1
    ctx.books.note(f"kill -9 {eng.name}")
    ctx.books.crash_time = ctx.clock.t
    victims = [
        req.hold
        for req in ctx.cluster.reqs.values()
        if req.reader is eng and req.state.waiting_for_blocks and req.hold.ended_at is None
    ]
    kill(ctx, eng)
    ctx.books.crash_holds = victims
    if ctx.liveness:
        for hold in victims:
            checks.check_l1(ctx, hold)


def crash_holder(ctx: FaultView, eng: EngineState) -> None:
    """A prefill engine dies (it restarts later)."""
    ctx.books.faults_pending -= 1
    ctx.books.note(f"kill -9 {eng.name} (restarts later)")
    kill(ctx, eng)


def restart(ctx: FaultView, eng: EngineState) -> None:
    """The engine comes back as a new incarnation: new endpoints, empty memory."""
    ctx.books.faults_pending -= 1
    ctx.steps.start_engine(eng)
    ctx.books.note(f"{eng.name} restarted as incarnation {eng.incarnation}")
