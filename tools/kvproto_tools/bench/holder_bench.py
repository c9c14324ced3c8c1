"""Holder figures: idle step, steady heartbeat (bytes and decode+apply), claim phase and its floor.

kvproto side: a real :class:`~kvproto.holder.Holder` with N leases held by one
reader session in sync (:mod:`.fixtures`). Anchor side: the restated vLLM
lease v4 prefill path (:mod:`.anchor`) holding the same N request ids.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import statistics
import time

from kvproto import auth, wire
from kvproto.events import SendFrame
from kvproto.ticket import PROOF_BYTES, claim_message, claim_proof
from kvproto_tools.bench import anchor
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.fixtures import READER_PEER, HolderFixture
from kvproto_tools.bench.plan import Plan
from kvproto_tools.bench.timing import no_gc, paired_ns, quiet_gc

IDLE_TARGET_US = 10.0
BYTES_TARGET = 2.0
APPLY_TARGET_RATIO = 10.0
APPLY_TARGET_SIZE = 10_000
IDLE_TARGET_SIZE = 100_000
FLOOR_CLAIMS = 10_000
"""Claims the floor is timed over (at most): its per-claim cost does not depend on N."""


def measure(
    fx: HolderFixture, vllm: anchor.VllmPrefill, plan: Plan, *, claim: bool = True
) -> list[Figure]:
    """Every holder figure at ``fx.n`` live leases (claim figures only if ``claim``)."""
    figures: list[Figure] = []
    with quiet_gc():
        figures += _idle(fx, vllm, plan)
        hb = _heartbeat(fx, vllm, plan)
    figures += hb
    with quiet_gc():
        figures += _mac(fx, plan)
    if not claim:
        return figures
    apply = next(f for f in hb if f.name == "holder.heartbeat_apply")
    assert apply.anchor_value is not None
    figures += _claim(fx, vllm, apply.anchor_value * 1e3 / fx.n, plan)
    return figures


def _idle(fx: HolderFixture, vllm: anchor.VllmPrefill, plan: Plan) -> list[Figure]:
    holder = fx.holder
    at = fx.idle_time()
    full = vllm.full_scan
    head = vllm.head_stop

    def ours() -> None:
        holder.handle_timer(at)
        holder.get_timer()

    def theirs() -> None:
        full.get_finished(at)

    def theirs_head() -> None:
        head.get_finished(at)

    # The least any full scan costs: one bare pass over a dict of the same entries.
    table = dict.fromkeys(vllm.request_ids, at + 30.0)

    def bare() -> None:
        for _rid, expires in table.items():
            if at >= expires:
                raise RuntimeError("nothing may expire in the idle step")

    batch = plan.anchor_batch(fx.n)
    kv, vf = paired_ns(
        ours, theirs, batch=plan.fast_batch, anchor_batch=batch, repeats=plan.repeats_for(fx.n)
    )
    kv_h, vh = paired_ns(ours, theirs_head, batch=plan.fast_batch, repeats=plan.fast_repeats)
    kv_b, vb = paired_ns(
        ours, bare, batch=plan.fast_batch, anchor_batch=batch, repeats=plan.repeats_for(fx.n)
    )
    if holder.drain():
        raise RuntimeError("the idle step produced output: something expired")
    target = fx.n >= IDLE_TARGET_SIZE
    return [
        Figure(
            name="holder.idle_step",
            size=fx.n,
            value=kv / 1e3,
            unit="us",
            anchor="vllm-lease full-scan reaper (vLLM 0.32.0)",
            anchor_value=vf / 1e3,
            target=f"<= {IDLE_TARGET_US:g} us (>= 100k)" if target else "O(1)",
            met=kv / 1e3 <= IDLE_TARGET_US if target else None,
        ),
        Figure(
            name="holder.idle_step.vs_bare_scan",
            size=fx.n,
            value=kv_b / 1e3,
            unit="us",
            anchor="one bare dict pass (floor of any full scan)",
            anchor_value=vb / 1e3,
        ),
        Figure(
            name="holder.idle_step.vs_head_stop",
            size=fx.n,
            value=kv_h / 1e3,
            unit="us",
            anchor="vllm-v4 head-stop reaper (incorrect, #58222)",
            anchor_value=vh / 1e3,
        ),
    ]


def _heartbeat(fx: HolderFixture, vllm: anchor.VllmPrefill, plan: Plan) -> list[Figure]:
    n = fx.n
    holder = fx.holder
    calls = 2 * (plan.repeats_for(n) + 1) * plan.hb_batch
    frames = fx.steady_frames(calls)
    frame_iter = iter(frames)
    # Frames arrive 1 ms apart: inside the holder's rate limit, after the last tick.
    times = itertools.count()
    base = fx.now
    ack_bytes: list[int] = []

    def ours() -> None:
        holder.handle_frame(base + next(times) * 1e-3, READER_PEER, next(frame_iter))
        for out in holder.drain():
            if isinstance(out, SendFrame):
                ack_bytes.append(len(out.payload))

    text = anchor.heartbeat_frame(vllm.request_ids)
    full = vllm.full_scan
    renew_at = fx.now

    def theirs() -> None:
        full.handle_notification(renew_at, text)

    # The least a text heartbeat costs: decode, split, max-update, no validation.
    table = dict.fromkeys(vllm.request_ids, renew_at + 30.0)
    extension = full.config.extension

    def bare() -> None:
        msg = text.decode("utf-8")
        if msg.startswith("HB:"):
            renewed = renew_at + extension
            for rid in msg[3:].split(","):
                old = table.get(rid)
                if old is not None:
                    table[rid] = max(old, renewed)

    kv, vv = paired_ns(
        ours,
        theirs,
        batch=plan.hb_batch,
        anchor_batch=plan.anchor_batch(n),
        repeats=plan.repeats_for(n),
    )
    kv_b, vb = paired_ns(
        ours,
        bare,
        batch=plan.hb_batch,
        anchor_batch=plan.anchor_batch(n),
        repeats=plan.repeats_for(n),
    )
    if holder.stats.replayed or holder.stats.rate_limited or holder.stats.malformed:
        raise RuntimeError(f"steady heartbeats were refused: {holder.stats_snapshot()}")
    hb_bytes = sum(map(len, frames)) / len(frames)
    ack = sum(ack_bytes) / max(1, len(ack_bytes))
    at_target = n == APPLY_TARGET_SIZE
    ratio = vv / kv if kv > 0 else 0.0
    return [
        Figure(
            name="holder.heartbeat_bytes_per_lease",
            size=n,
            value=hb_bytes / n,
            unit="B",
            anchor="vllm-lease HB: text frame",
            anchor_value=len(text) / n,
            target=f"<= {BYTES_TARGET:g} B",
            met=hb_bytes / n <= BYTES_TARGET,
        ),
        Figure(
            name="holder.heartbeat_wire_bytes_per_lease",
            size=n,
            value=(hb_bytes + ack) / n,
            unit="B",
            anchor="vllm-lease HB: text frame (no ack)",
            anchor_value=len(text) / n,
        ),
        Figure(
            name="holder.heartbeat_apply",
            size=n,
            value=kv / 1e3,
            unit="us",
            anchor="vllm-lease decode + max-update",
            anchor_value=vv / 1e3,
            target=f">= {APPLY_TARGET_RATIO:g}x vllm at 10k" if at_target else None,
            met=ratio >= APPLY_TARGET_RATIO if at_target else None,
        ),
        Figure(
            name="holder.heartbeat_apply.vs_bare_parse",
            size=n,
            value=kv_b / 1e3,
            unit="us",
            anchor="bare decode + split + max-update (floor)",
            anchor_value=vb / 1e3,
        ),
    ]


def _mac(fx: HolderFixture, plan: Plan) -> list[Figure]:
    """What the session MAC costs: per heartbeat, per claim, per done.

    Timed as the holder pays it: one keyed BLAKE2b to check the incoming frame and one to
    sign its answer (the answer's MAC is the same hash over a frame of similar size). A
    claim pays its share of its frame's MAC; a done pays the frame's MAC, the HELD
    verdict's per-lease proof (its message's engine and rank part packed once a session,
    as the holder does) and the answer's MAC. None of it grows with N.
    """
    key = fx.session_key()
    ids = [x.lease for x in fx.tickets]
    steady = wire.Heartbeat(seq=2**20, claims=[], aborts=[], count=fx.n, digest=wire.digest(ids))
    beat = wire.encode(steady, key)  # the size of the reader's steady frame
    ack = wire.encode(wire.HeartbeatAck(seq=1, clock=fx.now, held=[], lost=[]), key)
    t = fx.tickets[0]
    proof = claim_proof(t.token, "D", t.lease)
    room = wire.frame_room(fx.holder.config.frame_budget, wire.CLAIM_BYTES)
    claims = [wire.Claim(lease=x.lease, proof=proof) for x in fx.tickets[:room]]
    claim_frame = wire.encode(
        wire.Heartbeat(seq=1, claims=claims, aborts=[], count=len(claims), digest=0), key
    )
    done = wire.encode(wire.Done(claim=wire.Claim(lease=t.lease, proof=proof)), key)
    done_ack = wire.encode(wire.DoneAck(lease=t.lease, verdict=0, proof=proof), key)
    repeats = plan.repeats_for(fx.n)

    def per_heartbeat() -> None:
        wire.verify(key, beat)
        wire.verify(key, ack)

    def per_claim_frame() -> None:
        wire.verify(key, claim_frame)

    prove_verdict = auth.verdict_prover("D", 0)  # as the holder makes it, once a session

    def per_done() -> None:
        wire.verify(key, done)
        prove_verdict(t.token, t.lease, 0)
        wire.verify(key, done_ack)

    hb_ns, _ = paired_ns(per_heartbeat, per_heartbeat, batch=plan.hb_batch, repeats=repeats)
    claim_ns, _ = paired_ns(per_claim_frame, per_claim_frame, batch=plan.hb_batch, repeats=repeats)
    done_ns, _ = paired_ns(per_done, per_done, batch=plan.hb_batch, repeats=repeats)
    return [
        Figure(name="holder.heartbeat_mac", size=fx.n, value=hb_ns, unit="ns"),
        Figure(
            name="holder.claim_mac_per_lease",
            size=fx.n,
            value=claim_ns / len(claims),
            unit="ns",
        ),
        Figure(name="holder.done_mac", size=fx.n, value=done_ns, unit="ns"),
    ]


def _claim(
    fx: HolderFixture, vllm: anchor.VllmPrefill, vllm_ns_per_lease: float, plan: Plan
) -> list[Figure]:
    """The one-off cost of getting N leases into a session, beside one vLLM tick."""
    n = fx.n
    c = fx.claim
    floor = _claim_floor_ns(fx, plan.repeats_for(n))
    text = anchor.heartbeat_frame(vllm.request_ids)
    return [
        Figure(name="holder.claim_ticks", size=n, value=c.ticks, unit="ticks"),
        Figure(
            name="holder.claim_bytes_per_lease",
            size=n,
            value=c.heartbeat_bytes / n,
            unit="B",
            anchor="vllm-lease HB: text, one tick",
            anchor_value=len(text) / n,
        ),
        Figure(
            name="holder.claim_ack_bytes_per_lease",
            size=n,
            value=c.ack_bytes / n,
            unit="B",
        ),
        Figure(
            name="holder.claim_apply_per_lease",
            size=n,
            value=c.holder_ns / n,
            unit="ns",
            anchor="vllm-lease one tick's apply, per lease",
            anchor_value=vllm_ns_per_lease,
        ),
        Figure(
            name="holder.claim_floor",
            size=n,
            value=floor,
            unit="ns",
            anchor="vllm-lease one tick's apply, per lease",
            anchor_value=vllm_ns_per_lease,
        ),
    ]


def _claim_floor_ns(fx: HolderFixture, repeats: int) -> float:
    """Per claim: what any authenticated claim must do -- find the lease's token by its
    id and check the claim's proof (a keyed BLAKE2b under that token, compared in
    constant time).

    The proof is keyed by each lease's own token, so no two claims share the hash: the
    key is the hash's first block, and it differs per lease. What does not depend on
    the lease is prepared once, as the holder prepares it once a session (the
    message's engine part, :func:`~kvproto.ticket.claim_message`). This is the floor
    under ``holder.claim_apply_per_lease``, which adds the frame's decoding, its MAC
    share (``holder.claim_mac_per_lease``), the acknowledgement and the lease
    bookkeeping."""
    tickets = fx.tickets[:FLOOR_CLAIMS]
    tokens = {t.lease: t.token for t in tickets}
    claims = [wire.Claim(lease=t.lease, proof=claim_proof(t.token, "D", t.lease)) for t in tickets]
    message = claim_message("D")
    blake2b, compare = hashlib.blake2b, hmac.compare_digest
    samples = []
    with no_gc():
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for claim in claims:
                lease = claim.lease
                proof = blake2b(message(lease), key=tokens[lease], digest_size=PROOF_BYTES)
                if not compare(proof.digest(), claim.proof):
                    raise RuntimeError("a claim of the fixture's own tickets did not check")
            samples.append((time.perf_counter_ns() - start) / len(claims))
    return statistics.median(samples)
