"""T3 reads: one completion per read, data before notify, slices, failures, empty reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvproto.tpmath import read_slices
from kvproto.transport import (
    ReadCompleted,
    ReadId,
    Received,
    TransportEvent,
)
from kvproto_transports.conformance.harness import (
    Ctx,
    Net,
    must_fail,
    notify_problems,
    pattern,
    range_outcome,
)
from kvproto_transports.conformance.model import Level
from kvproto_transports.conformance.registry import Outcome, case

HOLDER, READER = 0, 1
REGIONS, BLOCK_LEN, BLOCKS = 2, 256, 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One read the cases issue: local/remote blocks and its notify."""

    local: tuple[int, ...]
    remote: tuple[int, ...]
    notify: bytes


PLANS = (
    Plan(local=(0, 1), remote=(0, 1), notify=b"done-0"),
    Plan(local=(2,), remote=(5,), notify=b"done-1"),
    Plan(local=(3, 4, 5), remote=(2, 3, 4), notify=b"done-2"),
    Plan(local=(6,), remote=(7,), notify=b"done-3"),
)
"""Disjoint remote blocks, so "freeing" one read's blocks cannot disturb another."""


def holder_reader(ctx: Ctx, *, holder_registers: bool = True) -> Net:
    """Slot 0 holds patterned blocks, slot 1 reads into zeroed blocks; both added."""
    net = ctx.net(2)
    net.memory(
        HOLDER,
        num_regions=REGIONS,
        block_len=BLOCK_LEN,
        num_blocks=BLOCKS,
        register=holder_registers,
    )
    net.memory(READER, num_regions=REGIONS, block_len=BLOCK_LEN, num_blocks=BLOCKS)
    net.fill(HOLDER, range(BLOCKS), "holder")
    net.link(HOLDER, READER)
    return net


def expected(rb: int, region: int, length: int = BLOCK_LEN) -> bytes:
    """What the holder's block ``rb`` of ``region`` holds (see :meth:`Net.fill`)."""
    return pattern(f"holder/{region}/{rb}", length)


def data_landed(net: Net, plan: Plan) -> bool:
    """Whether every local block of ``plan`` now holds the holder's bytes."""
    return all(
        net.block(READER, r, lb) == expected(rb, r)
        for r in range(REGIONS)
        for lb, rb in zip(plan.local, plan.remote, strict=True)
    )


def issue(net: Net, plan: Plan) -> ReadId:
    """Issue ``plan`` from the reader."""
    return net.ep(READER).read_blocks(
        net.ids[(READER, HOLDER)],
        local_blocks=list(plan.local),
        remote_blocks=list(plan.remote),
        notify=plan.notify,
    )


def terminal(net: Net, slot: int, ids: Sequence[ReadId]) -> bool:
    """Whether every read in ``ids`` has ended at ``slot``."""
    return all(net.read_events(slot, i) for i in ids)


@case(
    "T3.1",
    "Exactly one completion per read, with the data in place",
    Level.MUST,
    requirement="Each read ends in exactly one ReadCompleted (no ReadFailed, no second one), "
    "read ids are unique, the local blocks then hold the remote bytes, and the holder receives "
    "each notify (exactly once unless duplication is declared) attributed to the reader.",
    protects="The reader releases its side of a request on the completion; two completions "
    "double-count, none strands the request until the lease expires.",
)
def one_completion(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx)
    ids = [issue(net, p) for p in PLANS]
    notifies = {p.notify for p in PLANS}
    net.wait_until(lambda: terminal(net, READER, ids) and notifies <= set(net.payloads(HOLDER)))
    net.settle()
    problems = []
    if len(set(ids)) != len(ids):
        problems.append(f"read ids not unique: {ids}")
    for rid, plan in zip(ids, PLANS, strict=True):
        evs = net.read_events(READER, rid)
        kinds = [type(e).__name__ for e in evs]
        if kinds != ["ReadCompleted"]:
            problems.append(f"read {rid}: {kinds or 'no completion'}")
        elif not data_landed(net, plan):
            problems.append(f"read {rid}: completed but the data is wrong")
    problems += notify_problems(net, notifies, at=HOLDER, sender=READER)
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{len(ids)} reads, one completion and one notify each")


@case(
    "T3.2",
    "A read's notify is never observed before its data is visible",
    Level.MUST,
    requirement="When the holder observes a read's notify, the reader's local blocks already "
    "hold the data; the holder may then overwrite (free and reuse) those blocks without "
    "changing what the reader got.",
    protects="The notify is the holder's proof that it may free the blocks. Seen before the "
    "data left, the holder frees and reuses them and the reader gets another request's KV: "
    "silent corruption (aws-do-eks #84: 8 of 42 answers from freed blocks).",
)
def notify_after_data(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx)
    by_notify = {p.notify: p for p in PLANS}
    violations: list[str] = []

    def on_event(slot: int, ev: TransportEvent) -> None:
        if slot == HOLDER and isinstance(ev, Received) and ev.payload in by_notify:
            plan = by_notify[ev.payload]
            if not data_landed(net, plan):
                violations.append(f"{plan.notify!r} seen before its data was visible")
            for r in range(REGIONS):  # the holder frees and reuses the blocks at once
                for rb in plan.remote:
                    net.group.write_block(HOLDER, net.layouts[HOLDER], r, rb, b"\xee" * BLOCK_LEN)

    net.hooks.append(on_event)
    ids = [issue(net, p) for p in PLANS]
    net.wait_until(
        lambda: terminal(net, READER, ids) and set(by_notify) <= set(net.payloads(HOLDER))
    )
    net.settle()
    for rid, plan in zip(ids, PLANS, strict=True):
        if not any(isinstance(e, ReadCompleted) for e in net.read_events(READER, rid)):
            violations.append(f"read {rid} did not complete")
        elif not data_landed(net, plan):
            violations.append(f"read {rid}: data changed by the holder's reuse after the notify")
    missing = set(by_notify) - set(net.payloads(HOLDER))
    if missing:
        violations.append(f"notifies never delivered: {sorted(missing)}")
    if violations:
        return Outcome(ok=False, detail="; ".join(violations))
    return Outcome(ok=True, detail=f"{len(ids)} reads: data visible before every notify")


@case(
    "T3.3",
    "Sliced reads (heterogeneous TP) move exactly the right bytes",
    Level.MUST,
    requirement="With tpmath.read_slices: a reader with twice the holder's TP reads its half "
    "of each remote block; a reader with half the holder's TP reads whole remote blocks into "
    "its halves of each local block; bytes outside the slice are untouched.",
    protects="With heterogeneous TP each reader rank reads its slice; a transport that ignores "
    "the slice hands a rank another rank's heads: wrong output with no error.",
)
def sliced_reads(ctx: Ctx) -> Outcome:
    half = BLOCK_LEN // 2
    net = ctx.net(4)
    # A: slot 1 (rank 1 of reader TP 2, 128 B blocks) reads from slot 0 (holder TP 1, 256 B).
    # B: slot 2 (reader TP 1, 256 B blocks) reads from slot 3 (rank 1 of holder TP 2, 128 B).
    for slot, length in ((0, BLOCK_LEN), (1, half), (2, BLOCK_LEN), (3, half)):
        net.memory(slot, num_regions=1, block_len=length, num_blocks=4)
        net.fill(slot, range(4), f"s{slot}")
    net.mesh()
    ls_a, rs_a = read_slices(1, 2, 1, 0)
    a = net.ep(1).read_blocks(
        net.ids[(1, 0)], local_blocks=[0], remote_blocks=[2], local_slice=ls_a, remote_slice=rs_a
    )
    ls_b, rs_b = read_slices(0, 1, 2, 1)
    b = net.ep(2).read_blocks(
        net.ids[(2, 3)], local_blocks=[1], remote_blocks=[3], local_slice=ls_b, remote_slice=rs_b
    )
    net.wait_until(lambda: terminal(net, 1, [a]) and terminal(net, 2, [b]))
    problems: list[str] = []
    if not _completed(net, 1, a):
        problems.append(f"TP 2 <- TP 1 read: {_kinds(net, 1, a)}")
    elif net.block(1, 0, 0) != pattern("s0/0/2", BLOCK_LEN)[half:]:
        problems.append("TP 2 <- TP 1: rank 1 did not get the second half of the remote block")
    if not _completed(net, 2, b):
        problems.append(f"TP 1 <- TP 2 read: {_kinds(net, 2, b)}")
    else:
        got = net.block(2, 0, 1)
        if got[half:] != pattern("s3/0/3", half):
            problems.append("TP 1 <- TP 2: local half 1 does not hold holder rank 1's block")
        if got[:half] != pattern("s2/0/1", BLOCK_LEN)[:half]:
            problems.append("TP 1 <- TP 2: local half 0 was overwritten")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(
        ok=True,
        detail=f"remote slice {rs_a.index}/{rs_a.parts} and local slice "
        f"{ls_b.index}/{ls_b.parts} moved exactly",
    )


def _completed(net: Net, slot: int, rid: ReadId) -> bool:
    # Only the first terminal event matters here; counting them is T3.1's job.
    evs = net.read_events(slot, rid)
    return bool(evs) and isinstance(evs[0], ReadCompleted)


def _kinds(net: Net, slot: int, rid: ReadId) -> str:
    evs = net.read_events(slot, rid)
    if not evs:
        return "no completion (hang)"
    return ", ".join(f"{type(e).__name__}({getattr(e, 'reason', '')})" for e in evs)


def _must_fail(net: Net, what: str, *, local: list[int], remote: list[int]) -> str | None:
    """Issue a read that must not succeed; a problem description, or None if it failed well."""
    return must_fail(
        net,
        what,
        lambda: net.ep(READER).read_blocks(
            net.ids[(READER, HOLDER)], local_blocks=local, remote_blocks=remote, notify=b"must-not"
        ),
        lambda rid: net.read_events(READER, rid),
        watch=READER,
    )


@case(
    "T3.4",
    "A read outside the registered layout ends in an error, not done and not a hang",
    Level.MUST,
    requirement="Reading remote blocks past the holder's layout, or into local blocks past the "
    "reader's, raises a TransportError or ends in ReadFailed within the timeout, and writes "
    "nothing locally.",
    protects="Block ids come from the peer; a transport that wraps, clamps or hangs turns a "
    "bad id into a done for data that was never read, or a request stuck forever.",
)
def out_of_range(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx)
    return range_outcome(
        lambda what, local, remote: _must_fail(net, what, local=local, remote=remote),
        BLOCKS,
        "reads",
    )


@case(
    "T3.5",
    "A read from a peer that registered no memory ends in an error",
    Level.MUST,
    requirement="Reading from a peer that never registered memory raises a TransportError or "
    "ends in ReadFailed within the timeout; never ReadCompleted.",
    protects="A holder that restarted lost its registration; a done for such a read would let "
    "the reader decode uninitialised memory as KV.",
)
def unregistered_peer(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx, holder_registers=False)
    problem = _must_fail(net, "read from an unregistered peer", local=[0], remote=[0])
    if problem:
        return Outcome(ok=False, detail=problem)
    return Outcome(ok=True, detail="refused or failed")


@case(
    "T3.6",
    "A zero-block read completes once and still delivers its notify",
    Level.MUST,
    requirement="read_blocks with no blocks (a full prefix hit) ends in exactly one "
    "ReadCompleted and the holder receives its notify.",
    protects="On a full prefix hit the reader reads nothing but must still send done; without "
    "it the holder keeps the blocks until the lease expires (vLLM #46283-style leaks).",
)
def zero_block_read(ctx: Ctx) -> Outcome:
    net = holder_reader(ctx)
    rid = net.ep(READER).read_blocks(
        net.ids[(READER, HOLDER)], local_blocks=[], remote_blocks=[], notify=b"zero-done"
    )
    net.wait_until(
        lambda: bool(net.read_events(READER, rid)) and b"zero-done" in net.payloads(HOLDER)
    )
    net.settle()
    problems = []
    kinds = [type(e).__name__ for e in net.read_events(READER, rid)]
    if kinds != ["ReadCompleted"]:
        problems.append(f"read ended with {kinds or 'nothing (hang)'}")
    problems += notify_problems(net, {b"zero-done"}, at=HOLDER, sender=READER)
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail="one ReadCompleted, notify delivered")
