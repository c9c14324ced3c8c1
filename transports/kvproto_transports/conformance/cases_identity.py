"""T0 declarations, T1 identity and lifecycle."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kvproto.tpmath import BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    ThreadAffinity,
    Transport,
    TransportClosed,
    UnknownPeer,
)
from kvproto_transports.conformance.harness import Ctx
from kvproto_transports.conformance.model import Level
from kvproto_transports.conformance.registry import Outcome, Unsupported, case


def _describe(c: Capabilities) -> str:
    bound = f"<= {c.failure_detection_bound_s}s" if c.failure_detection_bound_s else "no bound"
    return (
        f"max={c.max_notification_size} ordered={c.ordered} may_duplicate={c.may_duplicate} "
        f"detects_peer_failure={c.detects_peer_failure} ({bound}) "
        f"one_sided_reads={c.one_sided_reads} affinity={c.thread_affinity.value}"
    )


def _cap_problems(c: object) -> list[str]:
    if not isinstance(c, Capabilities):
        return [f"capabilities is {type(c).__name__}, not Capabilities"]
    out = []
    m = c.max_notification_size
    if m is not None and (not isinstance(m, int) or m < 1):
        out.append(f"max_notification_size {m!r} is not a positive int or None")
    bound = c.failure_detection_bound_s
    if c.detects_peer_failure and (bound is None or bound <= 0):
        out.append("detects_peer_failure without a positive failure_detection_bound_s")
    if not c.detects_peer_failure and bound is not None:
        out.append("a failure_detection_bound_s without detects_peer_failure")
    if not isinstance(c.thread_affinity, ThreadAffinity):
        out.append(f"thread_affinity {c.thread_affinity!r} is not a ThreadAffinity")
    for flag in ("ordered", "may_duplicate", "detects_peer_failure", "one_sided_reads"):
        if not isinstance(getattr(c, flag), bool):
            out.append(f"{flag} is not a bool")
    return out


@case(
    "T0.1",
    "Capabilities are well formed and the same on every endpoint",
    Level.MUST,
    requirement="Every endpoint is a Transport, names itself, and declares well-formed "
    "Capabilities (positive size cap or None; a positive detection bound exactly when it "
    "detects peer failure); endpoints of one transport declare the same.",
    protects="The core sizes frames to max_notification_size and relies on the declared "
    "detection bound and ordering; a wrong declaration silently voids every other guarantee.",
)
def capabilities(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    problems: list[str] = []
    for i in range(net.size):
        ep = net.ep(i)
        if not isinstance(ep, Transport):
            problems.append(f"slot {i} does not implement kvproto.transport.Transport")
        if not isinstance(ep.name, str) or not ep.name:
            problems.append(f"slot {i} has no name")
        problems += [f"slot {i}: {p}" for p in _cap_problems(ep.capabilities)]
    if net.ep(0).capabilities != net.ep(1).capabilities or net.ep(0).name != net.ep(1).name:
        problems.append("two endpoints of one group declare different names or capabilities")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{net.ep(0).name}: {_describe(net.caps)}")


@case(
    "T1.1",
    "Metadata round trip names the peer by its local_peer",
    Level.MUST,
    requirement="add_peer(other.metadata()) returns other.local_peer, idempotently (same id "
    "for the same or a fresh metadata() of the same incarnation), and notifications from that "
    "endpoint arrive attributed to that id.",
    protects="Heartbeats and done messages are matched to (rank, incarnation) by peer id; "
    "an id that differs between add_peer and Received makes every message an unknown sender.",
)
def metadata_round_trip(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    a, b = net.ep(0), net.ep(1)
    meta = a.metadata()
    problems = []
    if not isinstance(meta, bytes):
        problems.append(f"metadata() returned {type(meta).__name__}, not bytes")
    first = b.add_peer(meta)
    again = b.add_peer(meta)
    fresh = b.add_peer(a.metadata())
    if first != a.local_peer:
        problems.append(f"add_peer returned {first!r} for local_peer {a.local_peer!r}")
    if again != first or fresh != first:
        problems.append(f"add_peer is not idempotent: {first!r}, {again!r}, {fresh!r}")
    back = a.add_peer(b.metadata())
    if back != b.local_peer:
        problems.append(f"add_peer returned {back!r} for local_peer {b.local_peer!r}")
    a.send(back, b"hello")
    if not net.wait_until(lambda: bool(net.received(1))):
        problems.append("a notification after the round trip never arrived")
    else:
        who = net.received(1)[0].peer
        if who != first:
            problems.append(f"notification attributed to {who!r}, add_peer said {first!r}")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{first!r} round-trips")


@case(
    "T1.2",
    "A peer id is stable within an incarnation",
    Level.MUST,
    requirement="An endpoint's local_peer does not change while it lives and sends; every "
    "notification it sends is attributed to that one id.",
    protects="The holder counts distinct (rank, incarnation) consumers; a sender whose id "
    "drifts is counted twice (early free) or never (lease held to expiry).",
)
def stable_peer_id(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    a, b = net.ep(0), net.ep(1)
    before = a.local_peer
    net.link(0, 1)
    n = 200
    for k in range(n):
        a.send(net.ids[(0, 1)], b"s%d" % k)
        if k % 20 == 19:
            net.poll_all()
    net.wait_until(lambda: len(set(net.payloads(1))) >= n)
    net.settle()
    senders = {r.peer for r in net.received(1)}
    problems = []
    if a.local_peer != before:
        problems.append(f"local_peer changed from {before!r} to {a.local_peer!r}")
    if senders != {before}:
        problems.append(f"{n} notifications attributed to {sorted(senders)!r}, not {before!r}")
    if b.add_peer(a.metadata()) != net.ids[(1, 0)]:
        problems.append("a fresh metadata() of the same incarnation resolves to another id")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{n} notifications, one id {before!r}")


@case(
    "T1.3",
    "A restarted peer is a new incarnation",
    Level.MUST,
    requirement="After a peer dies and restarts, its new endpoint has a new local_peer; "
    "add_peer of its new metadata returns that new id; its notifications are attributed to "
    "the new id; nothing sent to the old id reaches the new incarnation.",
    protects="A done or heartbeat from a dead incarnation must not count for, or keep alive, "
    "a lease of the new one (the core keys consumers by (rank, incarnation)).",
)
def restart_incarnation(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    if not net.group.can_restart:
        raise Unsupported("the factory cannot restart an endpoint")
    net.link(0, 1)
    old = net.ep(0).local_peer
    old_id = net.ids[(1, 0)]
    net.group.restart(0)
    a2, b = net.ep(0), net.ep(1)
    problems = []
    if a2.local_peer == old:
        problems.append(f"the new incarnation reuses the id {old!r}")
    new_id = b.add_peer(a2.metadata())
    if new_id != a2.local_peer:
        problems.append(f"add_peer returned {new_id!r} for {a2.local_peer!r}")
    if new_id == old_id:
        problems.append("the new metadata resolves to the old peer id")
    a2.send(a2.add_peer(b.metadata()), b"from-new")
    with contextlib.suppress(Exception):  # refusing to send to a dead incarnation is fine
        b.send(old_id, b"to-old")
    b.send(new_id, b"to-new")
    net.wait_until(lambda: b"from-new" in net.payloads(1) and b"to-new" in net.payloads(0))
    net.settle()
    got = [r for r in net.received(1) if r.payload == b"from-new"]
    if not got:
        problems.append("the new incarnation's notification never arrived")
    elif got[0].peer != a2.local_peer:
        problems.append(f"new incarnation's notification attributed to {got[0].peer!r}")
    if b"to-new" not in net.payloads(0):
        problems.append("a notification to the new incarnation never arrived")
    if b"to-old" in net.payloads(0):
        problems.append("a notification sent to the old id reached the new incarnation")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"{old!r} -> {a2.local_peer!r}")


@case(
    "T1.4",
    "close() is idempotent",
    Level.MUST,
    requirement="Calling close() twice raises nothing.",
    protects="Bindings close on every error path; a second close that raises turns an "
    "orderly shutdown into a crash that skips releasing leases.",
)
def close_idempotent(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    net.link(0, 1)
    net.ep(0).send(net.ids[(0, 1)], b"pending")
    net.ep(0).close()
    net.ep(0).close()
    return Outcome(ok=True, detail="closed twice without error")


@case(
    "T1.5",
    "send after close raises TransportClosed",
    Level.MUST,
    requirement="send() on a closed endpoint raises TransportClosed (a typed error) and "
    "sends nothing.",
    protects="A reader whose endpoint was closed (shutdown, reconnect) must learn it at the "
    "first heartbeat it sends; a send that silently succeeds lets the holder expire every lease "
    "while the reader believes it is renewing them.",
)
def send_after_close(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    net.link(0, 1)
    net.ep(0).close()
    try:
        net.ep(0).send(net.ids[(0, 1)], b"after-close")
    except TransportClosed:
        return Outcome(ok=True, detail="TransportClosed")
    except Exception as exc:
        return Outcome(ok=False, detail=f"raised {type(exc).__name__}: {exc}")
    net.settle()
    arrived = b"after-close" in net.payloads(1)
    return Outcome(
        ok=False, detail="accepted without error" + (" and delivered" if arrived else "")
    )


@case(
    "T1.6",
    "Every call after close raises TransportClosed",
    Level.SHOULD,
    requirement="metadata, add_peer, remove_peer, poll, register_blocks and read_blocks on a "
    "closed endpoint raise TransportClosed.",
    protects="Late completions polled from a closed endpoint would be applied to state the "
    "binding already tore down.",
)
def calls_after_close(ctx: Ctx) -> Outcome:
    net = ctx.net(2)
    net.link(0, 1)
    layout = net.group.allocate(0, num_regions=1, block_len=64, num_blocks=2)
    other_meta = net.ep(1).metadata()
    peer = net.ids[(0, 1)]
    ep = net.ep(0)
    ep.close()
    calls: dict[str, Callable[[], object]] = {
        "metadata": ep.metadata,
        "add_peer": lambda: ep.add_peer(other_meta),
        "remove_peer": lambda: ep.remove_peer(peer),
        "poll": ep.poll,
        "register_blocks": lambda: ep.register_blocks(layout),
        "read_blocks": lambda: ep.read_blocks(
            peer, local_blocks=[0], remote_blocks=[0], remote_slice=BlockSlice.FULL
        ),
    }
    wrong = []
    for name, call in calls.items():
        try:
            call()
            wrong.append(f"{name} succeeded")
        except TransportClosed:
            pass
        except Exception as exc:
            wrong.append(f"{name} raised {type(exc).__name__}")
    if wrong:
        return Outcome(ok=False, detail="; ".join(wrong))
    return Outcome(ok=True, detail=f"{len(calls)} calls raised TransportClosed")


@case(
    "T1.7",
    "Sending to a peer never added (or removed) raises UnknownPeer",
    Level.MUST,
    requirement="send() to a live endpoint that was never added, or was removed with "
    "remove_peer, raises UnknownPeer; remove_peer is idempotent; re-adding works.",
    protects="The reader must ask for a handshake when a holder is unknown (vLLM silently "
    "dropped that tick's heartbeat); it can only do so if the transport says so.",
)
def unknown_peer(ctx: Ctx) -> Outcome:
    net = ctx.net(3)
    a = net.ep(0)
    problems = []

    def expect_unknown(peer: str, what: str) -> None:
        try:
            a.send(peer, b"x")
            problems.append(f"send to {what} was accepted")
        except UnknownPeer:
            pass
        except Exception as exc:
            problems.append(f"send to {what} raised {type(exc).__name__}, not UnknownPeer")

    expect_unknown(net.ep(2).local_peer, "a never-added endpoint")
    net.link(0, 1)
    pid = net.ids[(0, 1)]
    a.remove_peer(pid)
    a.remove_peer(pid)
    a.remove_peer("no-such-peer")
    expect_unknown(pid, "a removed peer")
    if a.add_peer(net.ep(1).metadata()) != pid:
        problems.append("re-adding the peer returned another id")
    a.send(pid, b"re-added")
    if not net.wait_until(lambda: b"re-added" in net.payloads(1)):
        problems.append("send after re-adding never arrived")
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail="UnknownPeer for never-added and removed peers")


@case(
    "T1.8",
    "Bad metadata raises BadMetadata",
    Level.SHOULD,
    requirement="add_peer of empty or garbage bytes raises BadMetadata.",
    protects="A handshake that delivers corrupt metadata must fail as a typed error the "
    "binding handles (vLLM's listener thread died on an uncaught decode error).",
)
def bad_metadata(ctx: Ctx) -> Outcome:
    net = ctx.net(1)
    wrong = []
    for blob in (b"", b"\xff\x00garbage\x80", b"{}"):
        try:
            net.ep(0).add_peer(blob)
            wrong.append(f"{blob!r} accepted")
        except BadMetadata:
            pass
        except Exception as exc:
            wrong.append(f"{blob!r} raised {type(exc).__name__}")
    if wrong:
        return Outcome(ok=False, detail="; ".join(wrong))
    return Outcome(ok=True, detail="BadMetadata for 3 blobs")
