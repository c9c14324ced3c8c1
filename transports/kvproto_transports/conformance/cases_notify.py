"""T2 notifications: bytes, size limits, order, duplication, delivery, blocking, fan-in."""

from __future__ import annotations

import contextlib
import itertools
import time

from kvproto.transport import FrameTooLarge, TransportError
from kvproto_transports.conformance.harness import Ctx, Net, pattern, plural, short
from kvproto_transports.conformance.model import Level
from kvproto_transports.conformance.registry import Outcome, Unsupported, case

UNBOUNDED_PROBE = 64 * 1024
"""Payload size used where a cap would be, for transports that declare none."""


def _pair(ctx: Ctx) -> tuple[Net, str]:
    net = ctx.net(2)
    net.link(0, 1)
    return net, net.ids[(0, 1)]


def _cap(net: Net) -> int | None:
    return net.caps.max_notification_size


def _fit(net: Net, n: int) -> int:
    cap = _cap(net)
    return n if cap is None else min(n, cap)


@case(
    "T2.1",
    "Payloads arrive byte-exact (NUL, non-UTF-8, every byte value)",
    Level.MUST,
    requirement="Every payload arrives exactly as sent: NUL bytes, invalid UTF-8, all 256 "
    "byte values, CR/LF; nothing arrives that was not sent.",
    protects="The wire format is binary (msgspec); a transport that treats payloads as C "
    "strings or text corrupts lease ids and turns a done into garbage or into another lease.",
)
def byte_exact(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    sent = [
        b"\x00",
        b"\x00\x00\x00",
        b"a\x00b",
        b"\xff\xfe\xfd",
        b"\x80",
        b"\xc3\x28",
        b"\r\n\x1b[0m",
        b"HB:1,2",
        bytes(range(256))[: _fit(net, 256)],
        pattern("T2.1", _fit(net, 300)),
    ]
    for p in sent:
        net.ep(0).send(peer, p)
    net.wait_until(lambda: set(sent) <= set(net.payloads(1)))
    net.settle()
    got = net.payloads(1)
    missing = [short(p) for p in sent if p not in got]
    extra = [short(p) for p in got if p not in sent]
    if missing or extra:
        return Outcome(ok=False, detail=f"missing {missing}; altered/unexpected {extra}")
    return Outcome(ok=True, detail=f"{len(sent)} payloads byte-exact")


@case(
    "T2.2",
    "An empty payload is delivered empty or refused with a typed error",
    Level.MUST,
    requirement="send(peer, b'') either raises a TransportError or delivers exactly b''; it is "
    "never silently lost or altered.",
    protects="Zero-length frames are where framing layers hide off-by-one bugs; a silently "
    "lost frame is a lost heartbeat or done that nobody notices.",
)
def empty_payload(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    try:
        net.ep(0).send(peer, b"")
    except TransportError as exc:
        return Outcome(ok=True, detail=f"refused with {type(exc).__name__}")
    arrived = net.wait_until(lambda: bool(net.received(1)))
    got = net.payloads(1)
    if not arrived:
        return Outcome(ok=False, detail="accepted but never delivered")
    if got[0] != b"":
        return Outcome(ok=False, detail=f"delivered as {short(got[0])}")
    return Outcome(ok=True, detail="delivered as b''")


@case(
    "T2.3",
    "A payload of exactly max_notification_size is delivered byte-exact",
    Level.MUST,
    requirement="A payload of exactly the declared maximum is accepted and arrives byte-exact "
    "(64 KiB if the transport declares no maximum).",
    protects="The core packs heartbeat batches up to the declared maximum; an off-by-one cap "
    "loses the fullest (most important) batch.",
)
def exactly_max(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    size = _cap(net) or UNBOUNDED_PROBE
    payload = pattern("T2.3", size)
    try:
        net.ep(0).send(peer, payload)
    except Exception as exc:
        return Outcome(ok=False, detail=f"{size} B refused: {type(exc).__name__}: {exc}")
    net.wait_until(lambda: bool(net.received(1)))
    got = net.payloads(1)
    if not got:
        return Outcome(ok=False, detail=f"{size} B accepted but never delivered")
    if got[0] != payload:
        return Outcome(ok=False, detail=f"{size} B sent, {short(got[0])} arrived altered")
    return Outcome(ok=True, detail=f"{size} B delivered byte-exact", measured=float(size))


@case(
    "T2.4",
    "A payload of max+1 bytes is refused at send with FrameTooLarge",
    Level.MUST,
    requirement="send() of max+1 (and 2*max) bytes raises FrameTooLarge and sends nothing; the "
    "endpoint keeps working afterwards.",
    protects="The core splits oversize batches only if the transport refuses them; a transport "
    "that accepts and drops them loses heartbeats silently (uccl #1015: leases expired).",
)
def over_max_refused(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    cap = _cap(net)
    if cap is None:
        raise Unsupported("the transport declares no maximum notification size")
    problems = []
    accepted = []
    for size in (cap + 1, 2 * cap):
        try:
            net.ep(0).send(peer, pattern("T2.4", size))
            accepted.append(size)
        except FrameTooLarge:
            pass
        except Exception as exc:
            problems.append(f"{size} B raised {type(exc).__name__}, not FrameTooLarge")
    net.ep(0).send(peer, b"after")
    net.wait_until(lambda: b"after" in net.payloads(1))
    net.settle()
    got = [p for p in net.payloads(1) if p != b"after"]
    if accepted:
        fate = (
            f"{plural(len(got), 'payload')} of {[len(p) for p in got]} B delivered"
            if got
            else "silently dropped"
        )
        problems.append(
            f"{' and '.join(f'{n} B' for n in accepted)} accepted without FrameTooLarge; {fate}"
        )
    if b"after" not in net.payloads(1):
        problems.append("a normal notification after the refusal never arrived")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{cap + 1} B and {2 * cap} B refused with FrameTooLarge")


@case(
    "T2.5",
    "An oversize payload is never delivered truncated",
    Level.MUST,
    requirement="Whatever send() does with a payload over the maximum, the receiver never "
    "sees a truncated or altered version of it.",
    protects="A truncated heartbeat renews a prefix of the leases and silently drops the rest; "
    "a truncated done can parse as a done for a different lease.",
)
def never_truncated(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    cap = _cap(net)
    if cap is None:
        raise Unsupported("the transport declares no maximum notification size")
    sent = [pattern("T2.5a", cap + 1), pattern("T2.5b", cap + 7)]
    for p in sent:
        with contextlib.suppress(TransportError):
            net.ep(0).send(peer, p)
    net.ep(0).send(peer, b"marker")
    net.wait_until(lambda: b"marker" in net.payloads(1))
    net.settle()
    bad = [
        _describe_alteration(p, sent) for p in net.payloads(1) if p != b"marker" and p not in sent
    ]
    if bad:
        return Outcome(ok=False, detail="delivered altered: " + "; ".join(bad))
    return Outcome(ok=True, detail="no truncated or altered oversize payload delivered")


def _describe_alteration(got: bytes, sent: list[bytes]) -> str:
    for p in sent:
        if p.startswith(got):
            return f"truncated to {len(got)} of {len(p)} B"
    return f"unknown payload {short(got)}"


def _numbered_traffic(ctx: Ctx, n: int = 1000) -> tuple[Net, list[bytes], list[bytes]]:
    net, peer = _pair(ctx)
    sent = [b"%06d" % k for k in range(n)]
    for k, p in enumerate(sent):
        net.ep(0).send(peer, p)
        if k % 100 == 99:
            net.poll_all()
    net.wait_until(lambda: len(set(net.payloads(1))) >= n)
    net.settle()
    return net, sent, net.payloads(1)


@case(
    "T2.6",
    "Ordering is as declared",
    Level.MUST,
    requirement="If the transport declares ordered, 1000 notifications between one pair arrive "
    "in send order. Otherwise the observed reorderings are reported.",
    protects="Nothing in the lease protocol needs order (heartbeats use max(), done counts "
    "distinct consumers); but a binding that trusts a false 'ordered' may drop what it "
    "believes is stale.",
)
def ordering(ctx: Ctx) -> Outcome:
    net, _sent, got = _numbered_traffic(ctx)
    first: list[bytes] = []
    seen: set[bytes] = set()
    for p in got:
        if p not in seen:
            seen.add(p)
            first.append(p)
    inversions = sum(1 for x, y in itertools.pairwise(first) if y < x)
    detail = f"{plural(inversions, 'inversion')} over {len(first)} notifications"
    if not net.caps.ordered:
        return Outcome(
            ok=True,
            detail=detail + " (not declared ordered)",
            measured=float(inversions),
            informational=True,
        )
    return Outcome(ok=inversions == 0, detail=detail, measured=float(inversions))


@case(
    "T2.7",
    "Duplication is as declared",
    Level.MUST,
    requirement="If the transport declares may_duplicate false, no notification is delivered "
    "twice. Otherwise the observed duplicates are reported.",
    protects="The holder counts distinct consumers so duplicates are harmless to it, but a "
    "transport that lies about duplication breaks bindings that count raw messages "
    "(vLLM freed early on a duplicated done).",
)
def duplication(ctx: Ctx) -> Outcome:
    net, _sent, got = _numbered_traffic(ctx)
    dups = len(got) - len(set(got))
    detail = f"{plural(dups, 'duplicate')} over {len(got)} deliveries"
    if net.caps.may_duplicate:
        return Outcome(
            ok=True,
            detail=detail + " (duplication declared)",
            measured=float(dups),
            informational=True,
        )
    return Outcome(ok=dups == 0, detail=detail, measured=float(dups))


@case(
    "T2.8",
    "Every accepted notification is delivered",
    Level.MUST,
    requirement="Without injected faults, each of 1000 notifications that send() accepted "
    "arrives at least once within the timeout.",
    protects="Lost heartbeats expire live leases (the reader recomputes); a lost done holds "
    "blocks until expiry. Loss must be a fault, not the transport's normal behaviour.",
)
def delivery(ctx: Ctx) -> Outcome:
    _net, sent, got = _numbered_traffic(ctx)
    missing = sorted(set(sent) - set(got))
    detail = f"{len(sent) - len(missing)}/{len(sent)} delivered"
    if missing:
        detail += f"; missing e.g. {[m.decode() for m in missing[:5]]}"
    return Outcome(ok=not missing, detail=detail, measured=float(len(missing)))


@case(
    "T2.9",
    "poll() never blocks",
    Level.MUST,
    requirement="poll() returns within poll_block_bound_s wall seconds, idle (1000 calls) or "
    "with traffic in flight; the longest call is reported.",
    protects="The binding polls from the engine's step loop; a blocking poll stalls forward "
    "passes, heartbeats go out late and the holder expires live leases.",
)
def poll_never_blocks(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    for _ in range(1000):
        net.poll(1)
    for k in range(100):
        net.ep(0).send(peer, b"p%d" % k)
    net.wait_until(lambda: len(net.received(1)) >= 100)
    worst = net.max_poll_s
    bound = ctx.factory.poll_block_bound_s
    return Outcome(
        ok=worst <= bound,
        detail=f"longest poll {worst * 1e3:.3f} ms (bound {bound * 1e3:.0f} ms)",
        measured=worst,
    )


@case(
    "T2.10",
    "Fan-in: 8 senders x 1000 notifications, each attributed to its sender",
    Level.MUST,
    requirement="One receiver gets 8000 notifications from 8 senders; each arrives attributed "
    "to the sender's peer id, none is missing, duplicates and per-sender order are as declared.",
    protects="A holder serves many reader ranks; a done or heartbeat attributed to the wrong "
    "rank renews or releases another reader's lease.",
)
def fan_in(ctx: Ctx) -> Outcome:
    senders, per = 8, 1000
    net = ctx.net(senders + 1)
    for s in range(1, senders + 1):
        net.link(0, s)
    names = {s: net.ep(s).local_peer for s in range(1, senders + 1)}
    t0 = time.perf_counter()
    for k in range(per):
        for s in range(1, senders + 1):
            net.ep(s).send(net.ids[(s, 0)], b"%d:%d" % (s, k))
        if k % 50 == 49:
            net.poll_all()
    net.wait_until(lambda: len(set(net.payloads(0))) >= senders * per)
    wall = time.perf_counter() - t0
    net.settle()
    problems = _fan_in_problems(net, names, per)
    detail = f"{senders}x{per} in {wall:.2f} s wall"
    if problems:
        return Outcome(ok=False, detail=detail + ": " + "; ".join(problems), measured=wall)
    return Outcome(ok=True, detail=detail + ", all attributed correctly", measured=wall)


def _fan_in_problems(net: Net, names: dict[int, str], per: int) -> list[str]:
    caps = net.caps
    wrong = 0
    seqs: dict[int, list[int]] = {s: [] for s in names}
    for r in net.received(0):
        s_str, k_str = r.payload.split(b":")
        s = int(s_str)
        if r.peer != names[s]:
            wrong += 1
        seqs[s].append(int(k_str))
    problems = []
    if wrong:
        problems.append(f"{wrong} misattributed")
    missing = sum(per - len(set(v)) for v in seqs.values())
    if missing:
        problems.append(f"{missing} missing")
    dups = sum(len(v) - len(set(v)) for v in seqs.values())
    if dups and not caps.may_duplicate:
        problems.append(f"{dups} duplicated (declared may_duplicate=False)")
    if caps.ordered:
        out = sum(1 for v in seqs.values() for x, y in itertools.pairwise(v) if y < x)
        if out:
            problems.append(f"{out} out of order (declared ordered)")
    return problems


STALLS_TOLERATED = 2
"""T2.11: sends that may overrun the bound before it fails (process stalls, not blocking)."""


@case(
    "T2.11",
    "Back-pressure, not blocking: 10^4 sends to a receiver that does not poll",
    Level.MUST,
    requirement="10000 sends to a receiver that does not poll return within "
    "send_block_bound_s wall seconds, either accepted or refused with a TransportError (at most "
    f"{STALLS_TOLERATED} isolated sends may overrun: a loaded machine deschedules a whole process "
    "now and then, while a transport that blocks does so on every send past its backlog); every "
    "accepted one is delivered once the receiver polls.",
    protects="A holder that blocks in send behind a slow reader stops renewing and releasing "
    "every other reader's leases; back-pressure must be an error the binding can act on.",
)
def back_pressure(ctx: Ctx) -> Outcome:
    net, peer = _pair(ctx)
    size = _fit(net, 1024)
    filler = b"." * size  # byte-exactness is T2.1's job; here only delivery counts
    accepted: list[bytes] = []
    refused: dict[str, int] = {}
    untyped: list[str] = []
    bound = ctx.factory.send_block_bound_s
    worst = 0.0
    overruns = 0
    for k in range(10_000):
        p = (b"%06d" % k + filler)[:size]
        t0 = time.perf_counter()
        try:
            net.ep(0).send(peer, p)
            accepted.append(p)
        except TransportError as exc:
            refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
        except Exception as exc:
            untyped.append(type(exc).__name__)
        took = time.perf_counter() - t0
        worst = max(worst, took)
        overruns += took > bound
    want = set(accepted)
    net.wait_until(lambda: want <= set(net.payloads(1)))
    missing = len(want - set(net.payloads(1)))
    detail = (
        f"{len(accepted)} accepted, refused {refused or 'none'}, longest send "
        f"{worst * 1e3:.3f} ms, {overruns} over the bound of {bound * 1e3:.0f} ms"
    )
    problems = []
    if overruns > STALLS_TOLERATED:
        problems.append("send blocked")
    if untyped:
        problems.append(f"untyped errors {sorted(set(untyped))}")
    if missing:
        problems.append(f"{missing} accepted but never delivered")
    if problems:
        return Outcome(ok=False, detail=detail + ": " + "; ".join(problems), measured=worst)
    return Outcome(ok=True, detail=detail, measured=worst)
