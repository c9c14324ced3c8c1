"""T6 writes (push mode): one completion, data before notify and before completion, ranges,
slices, dead peers, empty writes. UNSUPPORTED for a transport that does not write.

In push mode the reader WRITEs the holder's blocks (spec/push-mode.md). The holder uses the
blocks (or lets them go) on the write's notify, and the writer stops holding an abort back
on its completion: both must come only once the data is in the holder's memory, and a
failed write must land nothing. Slot 0 is the holder (zeroed blocks), slot 1 the writer
(patterned blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproto.tpmath import read_slices
from kvproto.transport import Received, TransportError, TransportEvent, WriteCompleted, WriteId
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

HOLDER, WRITER = 0, 1
REGIONS, BLOCK_LEN, BLOCKS = 2, 256, 8
REUSED = b"\xee" * BLOCK_LEN
"""What the holder writes into blocks it reuses once a write's notify came."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One write the cases issue: the writer's blocks into the holder's, and its notify."""

    local: tuple[int, ...]
    remote: tuple[int, ...]
    notify: bytes


PLANS = (
    Plan(local=(0, 1), remote=(0, 1), notify=b"wdone-0"),
    Plan(local=(5,), remote=(2,), notify=b"wdone-1"),
    Plan(local=(2, 3, 4), remote=(3, 4, 5), notify=b"wdone-2"),
    Plan(local=(7,), remote=(6,), notify=b"wdone-3"),
)
"""Disjoint holder blocks, so the holder's reuse of one write's blocks cannot touch another's."""


def writer_holder(ctx: Ctx) -> Net:
    """Slot 1 writes patterned blocks into slot 0's zeroed ones; both added."""
    net = ctx.net(2)
    net.writer(WRITER)  # Unsupported before anything is allocated
    net.memory(HOLDER, num_regions=REGIONS, block_len=BLOCK_LEN, num_blocks=BLOCKS)
    net.memory(WRITER, num_regions=REGIONS, block_len=BLOCK_LEN, num_blocks=BLOCKS)
    net.fill(WRITER, range(BLOCKS), "writer")
    net.link(HOLDER, WRITER)
    return net


def written(lb: int, region: int) -> bytes:
    """What the writer's block ``lb`` of ``region`` holds (see :meth:`Net.fill`)."""
    return pattern(f"writer/{region}/{lb}", BLOCK_LEN)


def landed(net: Net, plan: Plan) -> bool:
    """Whether every holder block of ``plan`` now holds the writer's bytes."""
    return all(
        net.block(HOLDER, r, rb) == written(lb, r)
        for r in range(REGIONS)
        for lb, rb in zip(plan.local, plan.remote, strict=True)
    )


def issue(net: Net, plan: Plan) -> WriteId:
    """Issue ``plan`` from the writer."""
    return net.writer(WRITER).write_blocks(
        net.ids[(WRITER, HOLDER)],
        local_blocks=list(plan.local),
        remote_blocks=list(plan.remote),
        notify=plan.notify,
    )


def ended(net: Net, ids: list[WriteId]) -> bool:
    """Whether every write in ``ids`` has ended at the writer."""
    return all(net.write_events(WRITER, i) for i in ids)


def _kinds(net: Net, write_id: WriteId) -> list[str]:
    return [type(e).__name__ for e in net.write_events(WRITER, write_id)]


@case(
    "T6.1",
    "Exactly one completion per write, with the data in the holder's memory",
    Level.MUST,
    requirement="Each write ends in exactly one WriteCompleted (no WriteFailed, no second one), "
    "write ids are unique, the holder's blocks then hold the writer's bytes, and the holder "
    "receives each notify (exactly once unless duplication is declared) attributed to the writer.",
    protects="The writer lets its source blocks go and stops holding an abort back on the "
    "completion; the holder counts the notify as the writer's done. Two completions or none "
    "strand either side until a lease ends.",
)
def one_completion(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    ids = [issue(net, p) for p in PLANS]
    notifies = {p.notify for p in PLANS}
    net.wait_until(lambda: ended(net, ids) and notifies <= set(net.payloads(HOLDER)))
    net.settle()
    problems = []
    if len(set(ids)) != len(ids):
        problems.append(f"write ids not unique: {ids}")
    for wid, plan in zip(ids, PLANS, strict=True):
        kinds = _kinds(net, wid)
        if kinds != ["WriteCompleted"]:
            problems.append(f"write {wid}: {kinds or 'no completion'}")
        elif not landed(net, plan):
            problems.append(f"write {wid}: completed but the holder's blocks are wrong")
    problems += notify_problems(net, notifies, at=HOLDER, sender=WRITER)
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{len(ids)} writes, one completion and one notify each")


@case(
    "T6.2",
    "A write's notify is never observed before its data is in the holder's memory",
    Level.MUST,
    requirement="When the holder observes a write's notify, its blocks already hold the data, "
    "and nothing of that write lands after: the holder may then reuse the blocks.",
    protects="The notify rides the write as the writer's done: the holder uses the blocks on "
    "it, or, if the lease had ended, lets them go. Seen before the data, the holder decodes "
    "half-written KV or reuses blocks a WRITE then overwrites: silent corruption "
    "(spec/push-mode.md §3).",
)
def notify_after_data(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    by_notify = {p.notify: p for p in PLANS}
    violations: list[str] = []
    seen: set[bytes] = set()

    def on_event(slot: int, ev: TransportEvent) -> None:
        if slot != HOLDER or not isinstance(ev, Received):
            return
        plan = by_notify.get(ev.payload)
        if plan is None or ev.payload in seen:
            return  # a duplicated notify (declared may_duplicate) finds the blocks reused
        seen.add(ev.payload)
        if not landed(net, plan):
            violations.append(f"{plan.notify!r} seen before its data landed")
        for r in range(REGIONS):  # the holder reuses the blocks at once
            for rb in plan.remote:
                net.group.write_block(HOLDER, net.layouts[HOLDER], r, rb, REUSED)

    net.hooks.append(on_event)
    ids = [issue(net, p) for p in PLANS]
    net.wait_until(lambda: ended(net, ids) and set(by_notify) <= set(net.payloads(HOLDER)))
    net.settle()
    for wid, plan in zip(ids, PLANS, strict=True):
        if _kinds(net, wid) != ["WriteCompleted"]:
            violations.append(f"write {wid}: {_kinds(net, wid) or 'no completion'}")
        elif any(net.block(HOLDER, r, rb) != REUSED for r in range(REGIONS) for rb in plan.remote):
            violations.append(f"write {wid}: data landed after its notify, over the reuse")
    missing = set(by_notify) - set(net.payloads(HOLDER))
    if missing:
        violations.append(f"notifies never delivered: {sorted(missing)}")
    if violations:
        return Outcome(ok=False, detail="; ".join(violations))
    return Outcome(ok=True, detail=f"{len(ids)} writes: data in place before every notify")


@case(
    "T6.3",
    "A write is reported complete only once its data is in the holder's memory",
    Level.MUST,
    requirement="When the writer observes WriteCompleted, the holder's blocks already hold "
    "the data (remote completion, not local: the source may be reused at once).",
    protects="On the completion the writer frees its source blocks and may send an abort it "
    "held back; a completion before the data landed lets the abort overtake it, and the "
    "holder reuses blocks the WRITE still fills.",
)
def complete_after_data(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    ids = [issue(net, p) for p in PLANS]
    by_id = dict(zip(ids, PLANS, strict=True))
    violations: list[str] = []

    def on_event(slot: int, ev: TransportEvent) -> None:
        if slot != WRITER or not isinstance(ev, WriteCompleted) or ev.write_id not in by_id:
            return
        if not landed(net, by_id[ev.write_id]):
            violations.append(f"write {ev.write_id} completed before its data landed")

    net.hooks.append(on_event)
    net.wait_until(lambda: ended(net, ids))
    net.settle()
    for wid in ids:
        if _kinds(net, wid) != ["WriteCompleted"]:
            violations.append(f"write {wid}: {_kinds(net, wid) or 'no completion'}")
    if violations:
        return Outcome(ok=False, detail="; ".join(violations))
    return Outcome(ok=True, detail=f"{len(ids)} writes: data in place at every completion")


def _must_fail(net: Net, what: str, *, local: list[int], remote: list[int]) -> str | None:
    """Issue a write that must not succeed; a problem description, or None if it failed well."""
    return must_fail(
        net,
        what,
        lambda: net.writer(WRITER).write_blocks(
            net.ids[(WRITER, HOLDER)], local_blocks=local, remote_blocks=remote, notify=b"no"
        ),
        lambda wid: net.write_events(WRITER, wid),
        watch=HOLDER,
    )


@case(
    "T6.4",
    "A write outside the registered layout ends in an error and lands nothing",
    Level.MUST,
    requirement="Writing into holder blocks past its layout, or from writer blocks past its "
    "own, raises a TransportError or ends in WriteFailed within the timeout, and changes "
    "nothing in the holder's memory.",
    protects="Block ids come from the holder's registration; a transport that wraps or clamps "
    "them writes one request's KV into another's blocks.",
)
def out_of_range(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    return range_outcome(
        lambda what, local, remote: _must_fail(net, what, local=local, remote=remote),
        BLOCKS,
        "writes",
    )


@case(
    "T6.5",
    "Sliced writes (heterogeneous TP) move exactly the right bytes",
    Level.MUST,
    requirement="With the slices a read between the same ranks would use (tpmath.read_slices "
    "from the writer's side): a writer with twice the holder's TP writes its blocks into its "
    "half of each holder block; a writer with half the holder's TP writes its half of each "
    "block into a whole holder block; bytes outside the slice are untouched.",
    protects="With heterogeneous TP each writer rank fills its heads of the holder's blocks; "
    "a transport that ignores the slice overwrites another rank's heads: wrong output, no error.",
)
def sliced_writes(ctx: Ctx) -> Outcome:
    half = BLOCK_LEN // 2
    net = ctx.net(4)
    w = net.writer(1)
    # A: slot 1 (rank 1 of writer TP 2, 128 B blocks) writes into slot 0 (holder TP 1, 256 B).
    # B: slot 2 (writer TP 1, 256 B blocks) writes its half 1 into slot 3 (rank 1 of TP 2).
    for slot, length in ((0, BLOCK_LEN), (1, half), (2, BLOCK_LEN), (3, half)):
        net.memory(slot, num_regions=1, block_len=length, num_blocks=4)
        net.fill(slot, range(4), f"s{slot}")
    net.mesh()
    ls_a, rs_a = read_slices(1, 2, 1, 0)
    a = w.write_blocks(
        net.ids[(1, 0)], local_blocks=[2], remote_blocks=[0], local_slice=ls_a, remote_slice=rs_a
    )
    ls_b, rs_b = read_slices(0, 1, 2, 1)
    b = net.writer(2).write_blocks(
        net.ids[(2, 3)], local_blocks=[1], remote_blocks=[3], local_slice=ls_b, remote_slice=rs_b
    )
    net.wait_until(lambda: bool(net.write_events(1, a)) and bool(net.write_events(2, b)))
    problems: list[str] = []
    if [type(e).__name__ for e in net.write_events(1, a)] != ["WriteCompleted"]:
        problems.append("TP 2 -> TP 1 write did not complete")
    else:
        got = net.block(0, 0, 0)
        if got[half:] != pattern("s1/0/2", half):
            problems.append("TP 2 -> TP 1: rank 1's block is not in the second half")
        if got[:half] != pattern("s0/0/0", BLOCK_LEN)[:half]:
            problems.append("TP 2 -> TP 1: the first half (rank 0's) was overwritten")
    if [type(e).__name__ for e in net.write_events(2, b)] != ["WriteCompleted"]:
        problems.append("TP 1 -> TP 2 write did not complete")
    elif net.block(3, 0, 3) != pattern("s2/0/1", BLOCK_LEN)[half:]:
        problems.append("TP 1 -> TP 2: holder rank 1 did not get the second half")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail="local and remote slices moved exactly")


@case(
    "T6.6",
    "A write to a dead holder never completes",
    Level.MUST,
    requirement="After the holder is killed, a write to it raises a TransportError or ends in "
    "WriteFailed within the timeout; never WriteCompleted.",
    protects="A completion for a write that landed nowhere lets the writer report its done as "
    "delivered; the holder's side is gone either way, but a false completion hides the loss.",
)
def dead_holder(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    net.kill(HOLDER)
    try:
        wid = issue(net, PLANS[0])
    except TransportError:
        return Outcome(ok=True, detail="refused at once")
    net.wait_until(lambda: bool(net.write_events(WRITER, wid)))
    kinds = _kinds(net, wid)
    if kinds == ["WriteFailed"]:
        return Outcome(ok=True, detail="WriteFailed")
    return Outcome(ok=False, detail=f"write to a dead holder: {kinds or 'no completion (hang)'}")


@case(
    "T6.7",
    "A zero-block write completes once and still delivers its notify",
    Level.MUST,
    requirement="write_blocks with no blocks ends in exactly one WriteCompleted and the holder "
    "receives its notify.",
    protects="A writer with nothing left to move (the holder hit its prefix cache) must still "
    "deliver its done, or the holder waits for the lease to end.",
)
def zero_block_write(ctx: Ctx) -> Outcome:
    net = writer_holder(ctx)
    wid = net.writer(WRITER).write_blocks(
        net.ids[(WRITER, HOLDER)], local_blocks=[], remote_blocks=[], notify=b"zero-wdone"
    )
    net.wait_until(
        lambda: bool(net.write_events(WRITER, wid)) and b"zero-wdone" in net.payloads(HOLDER)
    )
    net.settle()
    problems = []
    kinds = _kinds(net, wid)
    if kinds != ["WriteCompleted"]:
        problems.append(f"write ended with {kinds or 'nothing (hang)'}")
    problems += notify_problems(net, {b"zero-wdone"}, at=HOLDER, sender=WRITER)
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail="one WriteCompleted, notify delivered")
