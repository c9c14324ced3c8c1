"""T4 peer failure: detection within the declared bound, reads from the dead, partial TP loss."""

from __future__ import annotations

import contextlib
import time

from kvproto.tpmath import read_slices
from kvproto.transport import ReadFailed, ReadId, TransportError
from kvproto_transports.conformance.cases_reads import (
    BLOCK_LEN,
    HOLDER,
    PLANS,
    READER,
    data_landed,
    holder_reader,
    issue,
)
from kvproto_transports.conformance.harness import Ctx, Net, pattern
from kvproto_transports.conformance.model import Level
from kvproto_transports.conformance.registry import Outcome, Unsupported, case

EPS = 1e-9
"""Float slack when comparing a virtual-clock delay with its bound."""


def _need_detection(net: Net) -> float:
    caps = net.caps
    if not caps.detects_peer_failure:
        raise Unsupported("the transport declares it does not detect peer failure")
    return caps.failure_detection_bound_s or net.factory.timeout_s


def _warm_pair(ctx: Ctx) -> Net:
    """Two endpoints that have exchanged a notification (real transports connect lazily)."""
    net = ctx.net(2)
    net.link(0, 1)
    net.ep(0).send(net.ids[(0, 1)], b"hello")
    net.ep(1).send(net.ids[(1, 0)], b"hello")
    net.wait_until(lambda: bool(net.received(0)) and bool(net.received(1)))
    return net


@case(
    "T4.1",
    "A killed peer surfaces as PeerLost within the declared bound",
    Level.MUST,
    requirement="After a peer is killed (kill -9), a survivor that keeps polling and sending "
    "to it reports PeerLost for exactly that peer within failure_detection_bound_s "
    "(+ detection_slack_s); the delay is measured and reported.",
    protects="The holder frees a dead reader's blocks early only on PeerLost; the declared "
    "bound is what a deployment uses to size its lease duration against.",
)
def detection_bound(ctx: Ctx) -> Outcome:
    net = _warm_pair(ctx)
    bound = _need_detection(net)
    victim = net.ids[(0, 1)]
    t0 = net.group.now()
    net.kill(1)
    step = max(bound / 20, 0.001)
    deadline = t0 + 2 * bound + ctx.factory.detection_slack_s + ctx.factory.settle_s
    lost_at: float | None = None
    while lost_at is None and net.group.now() < deadline:
        with contextlib.suppress(Exception):  # T4.2 judges what send does here
            net.ep(0).send(victim, b"probe")
        net.poll(0)
        if victim in net.lost(0):
            lost_at = net.group.now()
            break
        net.group.wait(min(step, deadline - net.group.now()))
    if lost_at is None:
        return Outcome(
            ok=False, detail=f"no PeerLost within {deadline - t0:.3f} s (declared bound {bound} s)"
        )
    delay = lost_at - t0
    limit = bound + ctx.factory.detection_slack_s
    wrong = [p for p in net.lost(0) if p != victim]
    detail = f"PeerLost after {delay:.3f} s (declared bound {bound} s)"
    if wrong:
        return Outcome(ok=False, detail=detail + f"; also reported {wrong}", measured=delay)
    return Outcome(ok=delay <= limit + EPS, detail=detail, measured=delay)


@case(
    "T4.2",
    "Sending to a dead peer never blocks and fails only with typed errors",
    Level.MUST,
    requirement="For the detection window after a peer is killed, every send() to it returns "
    "within send_block_bound_s, either accepted or refused with a TransportError.",
    protects="The holder keeps sending to readers that may be dead; a send that blocks or "
    "raises an untyped error takes the holder's step loop down with the reader.",
)
def send_to_dead(ctx: Ctx) -> Outcome:
    net = _warm_pair(ctx)
    caps = net.caps
    window = caps.failure_detection_bound_s or ctx.factory.settle_s
    victim = net.ids[(0, 1)]
    net.kill(1)
    deadline = net.group.now() + window + ctx.factory.settle_s
    outcomes: dict[str, int] = {}
    worst = 0.0
    untyped = []
    while net.group.now() < deadline:
        t0 = time.perf_counter()
        try:
            net.ep(0).send(victim, b"probe")
            key = "accepted"
        except TransportError as exc:
            key = type(exc).__name__
        except Exception as exc:
            key = type(exc).__name__
            untyped.append(key)
        worst = max(worst, time.perf_counter() - t0)
        outcomes[key] = outcomes.get(key, 0) + 1
        net.poll(0)
        net.group.wait(min(window / 20, deadline - net.group.now()))
    bound = ctx.factory.send_block_bound_s
    detail = f"sends: {outcomes}; longest {worst * 1e3:.3f} ms"
    problems = []
    if worst > bound:
        problems.append("send blocked")
    if untyped:
        problems.append(f"untyped errors {sorted(set(untyped))}")
    if problems:
        return Outcome(ok=False, detail=detail + ": " + "; ".join(problems), measured=worst)
    return Outcome(ok=True, detail=detail, measured=worst)


@case(
    "T4.3",
    "An in-flight read from a peer that dies ends in ReadFailed",
    Level.MUST,
    requirement="A read issued just before the holder is killed ends in ReadFailed within the "
    "timeout; never a hang and never ReadCompleted without the data. (If it completed with the "
    "right data before the kill took effect the case is inconclusive and reported as INFO.)",
    protects="The reader must recompute when the holder dies mid-read; a hang strands the "
    "request, a fake completion serves garbage KV.",
)
def read_from_dead(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx)
    if not net.group.can_kill:
        raise Unsupported("the factory cannot kill an endpoint")
    plan = PLANS[2]
    rid = issue(net, plan)
    net.kill(HOLDER)
    net.wait_until(lambda: bool(net.read_events(READER, rid)))
    evs = net.read_events(READER, rid)
    if not evs:
        return Outcome(ok=False, detail="no completion and no failure (hang)")
    first = evs[0]
    if isinstance(first, ReadFailed):
        return Outcome(ok=True, detail=f"ReadFailed: {first.reason}")
    if data_landed(net, plan):
        return Outcome(
            ok=True,
            informational=True,
            detail="completed with correct data before the kill took effect",
        )
    return Outcome(ok=False, detail="ReadCompleted without the data")


@case(
    "T4.4",
    "Partial TP failure is reported per rank",
    Level.MUST,
    requirement="A reader reading from two holder ranks (TP 1 <- TP 2) when rank 1 is killed: "
    "rank 0's read completes with its data and its notify arrives; rank 1's read fails "
    "(ReadFailed or a TransportError); PeerLost names rank 1 only (the reader keeps sending to "
    "both, as a binding's heartbeats do).",
    protects="With heterogeneous TP one request spans several holder ranks; the reader must "
    "recompute exactly what the dead rank held and keep the live rank's leases, not drop all.",
)
def partial_tp_failure(ctx: Ctx) -> Outcome:
    half = BLOCK_LEN // 2
    net = ctx.net(3)  # slots 0, 1: holder ranks of TP 2; slot 2: reader of TP 1
    for slot, length in ((0, half), (1, half), (2, BLOCK_LEN)):
        net.memory(slot, num_regions=1, block_len=length, num_blocks=4)
        net.fill(slot, range(4), f"s{slot}")
    net.mesh()
    for rank in (0, 1):
        net.ep(2).send(net.ids[(2, rank)], b"hello")
    net.wait_until(lambda: bool(net.received(0)) and bool(net.received(1)))
    net.kill(1)
    results: dict[int, str] = {}
    ids: dict[int, ReadId] = {}
    for rank in (0, 1):
        ls, rs = read_slices(0, 1, 2, rank)
        try:
            ids[rank] = net.ep(2).read_blocks(
                net.ids[(2, rank)],
                local_blocks=[0],
                remote_blocks=[rank],
                local_slice=ls,
                remote_slice=rs,
                notify=b"done-rank%d" % rank,
            )
        except TransportError as exc:
            results[rank] = f"refused ({type(exc).__name__})"
    detects = net.caps.detects_peer_failure
    bound = net.caps.failure_detection_bound_s or ctx.factory.timeout_s
    last_probe = [net.group.now()]

    def finished() -> bool:
        # Like a binding's heartbeats: some transports notice a death only when sending.
        if net.group.now() - last_probe[0] >= bound / 20:
            last_probe[0] = net.group.now()
            for rank in (0, 1):
                with contextlib.suppress(Exception):
                    net.ep(2).send(net.ids[(2, rank)], b"probe")
        reads = all(net.read_events(2, i) for i in ids.values())
        notify = b"done-rank0" in net.payloads(0)
        return reads and notify and (not detects or net.ids[(2, 1)] in net.lost(2))

    net.wait_until(finished, timeout=2 * bound + ctx.factory.settle_s)
    net.settle()
    return _judge_partial(net, ids, results, detects, half)


def _judge_partial(
    net: Net, ids: dict[int, ReadId], results: dict[int, str], detects: bool, half: int
) -> Outcome:
    problems = []
    for rank, rid in ids.items():
        evs = net.read_events(2, rid)  # the first terminal event; counting them is T3.1's job
        results[rank] = type(evs[0]).__name__ if evs else "nothing"
    block = net.block(2, 0, 0)
    if results.get(0) != "ReadCompleted":
        problems.append(f"rank 0 (alive): {results.get(0)}")
    elif block[:half] != pattern("s0/0/0", half):
        problems.append("rank 0 (alive): completed without its data")
    if b"done-rank0" not in net.payloads(0):
        problems.append("rank 0 (alive) never got its notify")
    if "ReadCompleted" in results.get(1, "") or results.get(1) == "nothing":
        problems.append(f"rank 1 (dead): {results.get(1)}")
    lost = net.lost(2)
    if net.ids[(2, 0)] in lost:
        problems.append("rank 0 (alive) reported lost")
    if detects and net.ids[(2, 1)] not in lost:
        problems.append("rank 1 (dead) never reported lost")
    detail = f"rank 0: {results.get(0)}; rank 1: {results.get(1)}; lost: {lost}"
    if problems:
        return Outcome(ok=False, detail=detail + " -- " + "; ".join(problems))
    return Outcome(ok=True, detail=detail)
