"""Fault injection: kill -9 of a reader or a holder, restart, partition and heal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvproto_tools.sim import checks, flows
from kvproto_tools.sim.model import ReqState

if TYPE_CHECKING:
    from kvproto_tools.sim.engine import EngineState, Simulator
    from kvproto_tools.sim.scenarios import Scenario


def schedule_faults(sim: Simulator, sc: Scenario) -> None:
    """Put the scenario's faults on the timeline."""
    if sc.decode_crash is not None:
        name, when = sc.decode_crash
        sim.faults_pending += 1
        sim.at(when, lambda: crash_reader(sim, sim.engines[name]))
    if sc.prefill_restart is not None:
        name, when, down = sc.prefill_restart
        sim.faults_pending += 2
        sim.at(when, lambda: crash_holder(sim, sim.engines[name]))
        sim.at(when + down, lambda: restart(sim, sim.engines[name]))
    if sc.partition is not None:
        a, b, when, (lo, hi) = sc.partition
        length = sim.fault_rng.uniform(lo, hi)
        sim.faults_pending += 2
        sim.at(when, lambda: cut(sim, a, b, heal=False))
        sim.at(when + length, lambda: cut(sim, a, b, heal=True))


def cut(sim: Simulator, a: str, b: str, *, heal: bool) -> None:
    """Partition (or heal) every link between two engines' ranks."""
    sim.faults_pending -= 1
    ea, eb = sim.engines[a], sim.engines[b]
    for ra in range(ea.tp):
        for rb in range(eb.tp):
            if heal:
                sim.net.heal(f"{a}r{ra}", f"{b}r{rb}")
            else:
                sim.net.partition(f"{a}r{ra}", f"{b}r{rb}")
    sim.note(f"{'heal' if heal else 'partition'} {a} <-> {b}")


def kill(sim: Simulator, eng: EngineState) -> None:
    """``kill -9``: endpoints, memory and queued work of ``eng`` vanish at once."""
    eng.alive = False
    eng.next_wake = None
    for tr in eng.transports:
        sim.net.crash(tr.real.base_name)
    sim.live_transports = [tr for tr in sim.live_transports if tr.engine is not eng]
    # Requests this engine was reading for die with it.
    for req in list(sim.reqs.values()):
        if req.reader is not eng:
            continue
        if req.state.waiting_for_blocks:
            flows.lose(sim, req)
        elif req.state in (ReqState.USED, ReqState.FAILED):
            flows.request_done(sim, req)  # was decoding: gone with the engine
    # Blocks it held vanish with its memory (they are not "freed").
    for hold in list(eng.holds.values()):
        flows.end_hold(sim, hold, lost=True)
    lost_jobs = len(eng.queue) + (1 if eng.current is not None else 0)
    sim.open_requests -= lost_jobs
    sim.extra["lost"] += lost_jobs
    eng.queue.clear()
    eng.current = None
    eng.busy_until = None
    eng.arrivals.clear()
    eng.waiting.clear()
    eng.hs_results.clear()
    eng.hs_busy.clear()


def crash_reader(sim: Simulator, eng: EngineState) -> None:
    """A decoder dies for good; remember what it was going to read (reclaim_s, L1)."""
    sim.faults_pending -= 1
    sim.note(f"kill -9 {eng.name}")
    sim.crash_time = sim.t
    victims = [
        req.hold
        for req in sim.reqs.values()
        if req.reader is eng and req.state.waiting_for_blocks and req.hold.ended_at is None
    ]
    kill(sim, eng)
    sim.crash_holds = victims
    if sim.liveness:
        for hold in victims:
            checks.check_l1(sim, hold)


def crash_holder(sim: Simulator, eng: EngineState) -> None:
    """A prefill engine dies (it restarts later)."""
    sim.faults_pending -= 1
    sim.note(f"kill -9 {eng.name} (restarts later)")
    kill(sim, eng)


def restart(sim: Simulator, eng: EngineState) -> None:
    """The engine comes back as a new incarnation: new endpoints, empty memory."""
    sim.faults_pending -= 1
    sim.start_engine(eng)
    sim.note(f"{eng.name} restarted as incarnation {eng.incarnation}")
