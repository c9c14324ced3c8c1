"""T5 resources: memory stays bounded over many send/poll cycles."""

from __future__ import annotations

import gc
import tracemalloc

from kvproto.transport import PeerId
from kvproto_transports.conformance.harness import Ctx, Net
from kvproto_transports.conformance.model import Level
from kvproto_transports.conformance.registry import Outcome, case

BATCH = 100
"""Cycles between drains: each drain waits until everything sent so far arrived."""
ONE_OFF = 4096
"""Bytes allowed whatever the cycle count: a cache filled once is not growth."""


@case(
    "T5.1",
    "10^5 send/poll cycles keep memory bounded",
    Level.MUST,
    requirement="Over resource_cycles (10^5) cycles of send + poll with the receiver draining, "
    "the Python memory still allocated by the last twentieth of the cycles (traced with "
    "tracemalloc, after draining and gc) is at most 4 KiB + memory_growth_per_cycle bytes "
    "per cycle; the rate is reported.",
    protects="A holder and its readers exchange heartbeats for the life of the server; a few "
    "bytes leaked per message is an out-of-memory kill after days, which drops every lease.",
)
def bounded_memory(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    net.link(0, 1)
    peer = net.ids[(0, 1)]
    cycles = ctx.factory.resource_cycles
    window = max(cycles // 20, BATCH)
    # The first 95% run untraced (tracemalloc slows Python code ~8x) and warm every cache;
    # whatever the last 5% allocate and still hold at the end is the leak rate.
    lost = _cycles(net, peer, 0, cycles - window)
    was_tracing = tracemalloc.is_tracing()
    gc.collect()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        lost += _cycles(net, peer, cycles - window, cycles)
        _quiesce(net)  # what is still in flight is not a leak
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    rate = retained / window
    bound = ctx.factory.memory_growth_per_cycle
    allowed = ONE_OFF + bound * window
    detail = (
        f"{cycles} cycles; the last {window} left {retained} B allocated "
        f"({rate:.2f} B/cycle; allowed {ONE_OFF} B + {bound} B/cycle)"
    )
    if lost:
        detail += f"; {lost} notifications never arrived"
    return Outcome(ok=retained <= allowed, detail=detail, measured=rate)


def _cycles(net: Net, peer: PeerId, start: int, stop: int) -> int:
    """Run cycles ``start..stop``; returns how many notifications never arrived."""
    a, b = net.ep(0), net.ep(1)
    outstanding = 0
    lost = 0
    for k in range(start, stop):
        a.send(peer, b"heartbeat %08d" % k)
        outstanding += 1
        a.poll()  # events are not kept: the kit would be measuring itself
        outstanding -= len(b.poll())
        if k % BATCH == BATCH - 1 or k == stop - 1:
            outstanding, stuck = _drain(net, outstanding)
            lost += stuck
    return lost


def _drain(net: Net, outstanding: int) -> tuple[int, int]:
    """Let time pass until the receiver got everything sent; (still outstanding, given up)."""
    left = outstanding
    deadline = net.group.now() + net.factory.timeout_s
    while left > 0:
        net.ep(0).poll()
        left -= len(net.ep(1).poll())
        if left <= 0:
            break
        remaining = deadline - net.group.now()
        if remaining <= 0:
            return 0, left
        net.group.wait(remaining)
    return 0, 0


def _quiesce(net: Net) -> None:
    """Poll both endpoints (keeping nothing) for ``settle_s`` of group time."""
    deadline = net.group.now() + net.factory.settle_s
    while True:
        net.ep(0).poll()
        net.ep(1).poll()
        remaining = deadline - net.group.now()
        if remaining <= 0:
            return
        net.group.wait(remaining)
