"""Reader figures: tracking cost, idle step and heartbeat tick, N waiting requests over E holders.

kvproto side: one real :class:`~kvproto.reader.Reader` and E real holders, a
request per ticket spread round-robin over the holders, every session
brought to the steady state (claims acknowledged). Anchor side: the restated
vLLM decode path, which tracks request ids per engine and, each tick,
sends every engine the whole ``HB:`` list.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from kvproto import wire
from kvproto.events import Connect, SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket, claim_prover, ticket_problem
from kvproto_tools.bench import anchor
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.fixtures import bench_config, vllm_request_ids
from kvproto_tools.bench.plan import Plan
from kvproto_tools.bench.timing import no_gc, paired_ns, quiet_gc

_READER_PEER = "D#1"


@dataclass(slots=True)
class _Cluster:
    reader: Reader
    holders: dict[str, Holder]
    """Holder by the peer name the reader uses for it."""
    tickets: list[LeaseTicket]
    engines: list[str]
    """Holder engine of each ticket (the anchor tracks by engine too)."""
    now: float = 0.0


def _peer(engine: str) -> str:
    return engine + "#1"


def _build(n: int, engines: int) -> _Cluster:
    config = bench_config(n)
    names = [f"P{e}" for e in range(engines)]
    holders = {_peer(name): Holder(config, engine=name, incarnation=1) for name in names}
    ids = vllm_request_ids(n)
    reader = Reader(config, engine="D", incarnation=2)
    with no_gc():
        tickets = []
        owner = []
        for i, rid in enumerate(ids):
            name = names[i % engines]
            tickets.append(holders[_peer(name)].grant(0.0, request_id=rid))
            owner.append(name)
    return _Cluster(reader=reader, holders=holders, tickets=tickets, engines=owner)


def _track_all(reader: Reader, tickets: list[LeaseTicket]) -> int:
    start = time.perf_counter_ns()
    for i, ticket in enumerate(tickets):
        reader.track(0.0, request_id=f"d-{i}", ticket=ticket)
    return time.perf_counter_ns() - start


def _settle(cl: _Cluster) -> None:
    """Connect every session and deliver ticks until heartbeats carry no claims."""
    interval = next(iter(cl.holders.values())).config.heartbeat_interval
    now = 0.0
    for _ in range(64):
        pending = deque(cl.reader.drain())
        steady = True
        while pending:
            out = pending.popleft()
            if isinstance(out, Connect):
                cl.reader.connected(now, engine=out.engine, rank=out.rank, peer=_peer(out.engine))
                pending.extend(cl.reader.drain())
                continue
            if not isinstance(out, SendFrame):
                continue
            msg = wire.decode(out.payload)
            if not isinstance(msg, wire.Heartbeat) or msg.claims or msg.full is not None:
                steady = False
            holder = cl.holders[out.peer]
            holder.handle_frame(now, _READER_PEER, out.payload)
            for answer in holder.drain():
                if isinstance(answer, SendFrame):
                    cl.reader.handle_frame(now, out.peer, answer.payload)
            pending.extend(cl.reader.drain())
        if steady and now > 0:
            cl.now = now
            return
        now += interval
        cl.reader.handle_timer(now)
    raise RuntimeError("reader sessions did not reach the steady state")


def measure(n: int, engines: int, plan: Plan) -> list[Figure]:
    """Reader figures for ``n`` waiting requests over ``engines`` holder engines."""
    cl = _build(n, engines)
    tag = f"e{engines}"

    # Tracking: a fresh reader per repetition, the same tickets.
    track_reps = max(3, plan.repeats // 2)
    ours_track: list[float] = []
    theirs_track: list[float] = []
    with no_gc():
        for _ in range(track_reps):
            probe = Reader(cl.reader.config, engine="D", incarnation=2)
            ours_track.append(_track_all(probe, cl.tickets) / n)
            d = anchor.VllmDecode()
            start = time.perf_counter_ns()
            for rid, engine in zip(anchor_ids(cl), cl.engines, strict=True):
                d.track(engine, rid)
            theirs_track.append((time.perf_counter_ns() - start) / n)
        _track_all(cl.reader, cl.tickets)
        _settle(cl)

    floor = _track_floor_ns(cl.tickets, track_reps)

    vd = anchor.VllmDecode()
    for rid, engine in zip(anchor_ids(cl), cl.engines, strict=True):
        vd.track(engine, rid)

    reader = cl.reader
    interval = next(iter(cl.holders.values())).config.heartbeat_interval
    clock = {"ours": cl.now, "theirs": cl.now}
    sizes: list[int] = []
    vsizes: list[int] = []

    def ours_tick() -> None:
        clock["ours"] += interval
        reader.handle_timer(clock["ours"])
        out = reader.drain()
        sizes.append(sum(len(o.payload) for o in out if isinstance(o, SendFrame)))

    def theirs_tick() -> None:
        clock["theirs"] += interval
        frames = vd.tick(clock["theirs"])
        vsizes.append(sum(len(f) for f in frames.values()))

    with quiet_gc():
        kv_tick, vv_tick = paired_ns(
            ours_tick,
            theirs_tick,
            batch=plan.hb_batch,
            anchor_batch=plan.anchor_batch(n),
            repeats=plan.repeats,
        )
        # Half an interval after the last tick nothing is due on either side.
        idle_at = clock["ours"] + interval / 2
        vidle_at = clock["theirs"] + interval / 2

        def ours_idle() -> None:
            reader.handle_timer(idle_at)
            reader.get_timer()

        def theirs_idle() -> None:
            vd.tick(vidle_at)

        kv_idle, vv_idle = paired_ns(
            ours_idle, theirs_idle, batch=plan.fast_batch, repeats=plan.fast_repeats
        )
    if reader.drain():
        raise RuntimeError("the reader's idle step produced output")
    if max(sizes) > 64 * engines:
        raise RuntimeError(f"reader heartbeats were not steady: up to {max(sizes)} B per tick")
    return [
        Figure(
            name=f"reader.track.{tag}",
            size=n,
            value=statistics.median(ours_track),
            unit="ns",
            anchor="vllm-lease on_new_request",
            anchor_value=statistics.median(theirs_track),
        ),
        Figure(
            name=f"reader.track_floor.{tag}",
            size=n,
            value=floor,
            unit="ns",
            anchor="vllm-lease on_new_request",
            anchor_value=statistics.median(theirs_track),
        ),
        Figure(
            name=f"reader.idle_step.{tag}",
            size=n,
            value=kv_idle / 1e3,
            unit="us",
            anchor="vllm-lease throttled step",
            anchor_value=vv_idle / 1e3,
        ),
        Figure(
            name=f"reader.heartbeat_tick.{tag}",
            size=n,
            value=kv_tick / 1e3,
            unit="us",
            anchor="vllm-lease HB: build, all engines",
            anchor_value=vv_tick / 1e3,
        ),
        Figure(
            name=f"reader.heartbeat_bytes_per_request.{tag}",
            size=n,
            value=statistics.median(sizes) / n,
            unit="B",
            anchor="vllm-lease HB: text",
            anchor_value=statistics.median(vsizes) / n,
        ),
    ]


def _track_floor_ns(tickets: list[LeaseTicket], repeats: int) -> float:
    """Per ticket: what any authenticated track must do -- validate it, compute its claim proof.

    The proof is keyed by the ticket's own token, so no two tickets share the keyed
    hash; only the reader's engine in its message is prepared once (``claim_prover``,
    as the reader does). This is the floor under ``reader.track``."""
    prove = claim_prover("D")
    samples = []
    with no_gc():
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for ticket in tickets:
                ticket_problem(ticket)
                prove(ticket.token, ticket.lease)
            samples.append((time.perf_counter_ns() - start) / len(tickets))
    return statistics.median(samples)


def anchor_ids(cl: _Cluster) -> list[str]:
    """The holder-side request ids the vLLM decoder heartbeats (``remote_request_id``)."""
    return [t.request_id for t in cl.tickets]
