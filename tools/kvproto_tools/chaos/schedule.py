"""The seeded schedule of a chaos run: a steady mixed load, bursts, and a sequence of faults.

Everything is drawn up front from the seed and the duration (nothing from the
clock), so the same seed gives the same schedule and a run can be replayed
(:func:`make_schedule`, :func:`digest`).

The load is open-loop: requests arrive at the planned times whatever the
deployment does (a Poisson stream plus bursts), in these kinds:

* ``complete`` / ``stream``: a greedy completion, returned whole or streamed;
* ``sample`` / ``sample-stream``: ``n`` = 2-4 seeded samples of one prompt (vLLM's
  parallel sampling: one lease read by every child);
* ``cancel-queued``: a streamed request whose client hangs up after a delay, most
  often while it waits on D (claimed, heartbeated, unread) or is still at P;
* ``cancel-stream``: a client that hangs up after its first tokens;
* ``repeat``: the exact prompt of an earlier request (D may hold it all locally).

Half the prompts start with one of a few shared prefixes of two KV blocks, so
P and D hit their prefix caches and D reads only the tail from P (a partial read).

The faults come as a sequence, each after a gap of steady load; the run walks
it, leaving out a fault whose window no longer fits before the load ends, and
waits after each fault for the bound within which its effect must be gone
(:mod:`.bounds`), so two faults' windows never overlap. Kinds cycle through
a shuffled order, so every kind comes once in each cycle:

* ``kill-decode`` / ``kill-prefill``: ``kill -9`` of the engine's process tree, a
  restart (same command and ports) after ``length_s``;
* ``partition``: the KV fabric between one prefill host and the decode host cut
  for ``length_s`` (half the draws shorter than the renewal margin, half
  longer than the lease);
* ``loss``: ``loss`` of the packets between them dropped, each way, for ``length_s``;
* ``flap``: the decode or a prefill host's fabric link down ``down_s``, up ``up_s``,
  ``flaps`` times.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from kvproto.config import LeaseConfig

PREFILLS = ("prefill-0", "prefill-1")
"""The prefill engines (two share the first core)."""
DECODE = "decode-0"
"""The decode engine (the last core to itself)."""
ENGINES = (*PREFILLS, DECODE)
HOST_OF = {"prefill-0": "p0", "prefill-1": "p1", "decode-0": "d0"}
"""Each engine's host (namespace) name."""

REQUEST_KINDS = (
    "complete",
    "stream",
    "sample",
    "sample-stream",
    "cancel-queued",
    "cancel-stream",
    "repeat",
)
_KIND_WEIGHTS = (34, 24, 8, 6, 10, 8, 10)
FAULT_KINDS = ("kill-decode", "kill-prefill", "partition", "loss", "flap")

SHARED_PREFIXES = 5
"""Shared prompt prefixes (each about two 32-token KV blocks)."""


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One planned client request."""

    index: int
    """Its place in the schedule (also in its prompt, which makes the prompt unique)."""
    at: float
    """Seconds after the load starts."""
    kind: str
    """One of :data:`REQUEST_KINDS`."""
    prompt: str
    """The prompt."""
    max_tokens: int
    """Tokens to generate (``ignore_eos``: exactly this many)."""
    n: int = 1
    """Samples (``sample`` kinds)."""
    sample_seed: int = 0
    """The sampling seed (``sample`` kinds; greedy otherwise)."""
    hang_up_s: float = 0.0
    """``cancel-queued``: seconds after sending when the client closes the connection."""
    hang_up_chunks: int = 0
    """``cancel-stream``: stream events read before the client closes the connection."""
    burst: int = -1
    """The burst it belongs to (-1: the steady stream)."""


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One planned fault."""

    index: int
    """Its place in the sequence."""
    kind: str
    """One of :data:`FAULT_KINDS`."""
    target: tuple[str, ...]
    """The engines it hits: one to kill or flap, (prefill, decode) for a cut or loss."""
    gap_s: float
    """Seconds of steady load before it, after the previous fault's window closed."""
    length_s: float
    """Partition or loss: how long; kill: downtime before the restart; flap: total."""
    loss: float = 0.0
    """``loss``: the fraction of packets dropped each way."""
    down_s: float = 0.0
    """``flap``: each down period."""
    up_s: float = 0.0
    """``flap``: each up period."""
    flaps: int = 0
    """``flap``: how many times the link goes down."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What a chaos run does: its load and its faults."""

    seed: int
    """The seed it was drawn from."""
    sentences: tuple[str, ...]
    """What its prompts are made of (the tiny model's tokenizer corpus: a few tokens a word)."""
    duration_s: float
    """Seconds of load."""
    lease_s: int
    """``kv_lease_duration`` of the engines (the fault lengths are drawn against it)."""
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    """The kinds the faults are drawn from (a subset of :data:`FAULT_KINDS`)."""
    requests: tuple[Request, ...]
    """The load, in time order."""
    faults: tuple[Fault, ...]
    """The fault sequence (the run injects a prefix of it, as time allows)."""


def make_schedule(
    seed: int,
    duration_s: float,
    *,
    sentences: tuple[str, ...],
    lease_s: int,
    rate: float,
    warmup_s: float,
    fault_kinds: tuple[str, ...] = FAULT_KINDS,
) -> Plan:
    """The schedule for ``seed``: load over ``duration_s`` at ``rate`` requests per second
    plus bursts, prompts made of ``sentences``, and enough faults of ``fault_kinds`` to
    fill the run after ``warmup_s`` (all kinds: the same draw as before the choice
    existed, so a seed keeps its faults)."""
    fault_kinds = checked_kinds(fault_kinds)
    rng = random.Random(f"kvproto-chaos/{seed}")
    requests = _load(random.Random(f"{rng.random()}/load"), duration_s, rate, sentences)
    faults = _faults(
        random.Random(f"{rng.random()}/faults"), duration_s - warmup_s, lease_s, fault_kinds
    )
    return Plan(
        seed=seed,
        sentences=sentences,
        duration_s=duration_s,
        lease_s=lease_s,
        fault_kinds=fault_kinds,
        requests=requests,
        faults=faults,
    )


def checked_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """``kinds`` in their order, each once, or ValueError naming what is not a fault kind."""
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"{', '.join(unknown) or 'no kind'}; choose from {', '.join(FAULT_KINDS)}")
    return tuple(dict.fromkeys(kinds))


def digest(plan: Plan) -> str:
    """A short hash of the whole schedule: equal schedules, equal digests."""
    return hashlib.sha256(msgspec.json.encode(plan)).hexdigest()[:16]


def _prefix(k: int, sentences: tuple[str, ...]) -> str:
    words = random.Random(f"prefix/{k}").choices(sentences, k=6)
    return f"Context {k}: " + " ".join(words)


def _load(
    rng: random.Random, duration_s: float, rate: float, sentences: tuple[str, ...]
) -> tuple[Request, ...]:
    times: list[tuple[float, int]] = []
    t = 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        times.append((t, -1))
    t, burst = 0.0, 0
    while (t := t + rng.uniform(30.0, 75.0)) < duration_s:
        times += [(t, burst)] * rng.randint(6, 12)
        burst += 1
    times.sort()
    out: list[Request] = []
    for index, (at, in_burst) in enumerate(times):
        kind = rng.choices(REQUEST_KINDS, _KIND_WEIGHTS)[0]
        earlier = [r for r in out[-50:] if r.kind in ("complete", "stream")]
        if kind == "repeat" and earlier:
            # The same question again: the same prompt and length, so the same answer.
            original = rng.choice(earlier)
            prompt, max_tokens = original.prompt, original.max_tokens
        else:
            kind = "complete" if kind == "repeat" else kind
            tail = f"#{index} " + " ".join(rng.choices(sentences, k=rng.randint(2, 5)))
            shared = rng.random() < 0.5
            prompt = (
                f"{_prefix(rng.randrange(SHARED_PREFIXES), sentences)} {tail}" if shared else tail
            )
            # A client hanging up mid-stream needs a stream longer than its first chunks.
            max_tokens = 64 if kind == "cancel-stream" else rng.randint(4, 16)
        sampled = kind.startswith("sample")
        out.append(
            Request(
                index=index,
                at=round(at, 4),
                kind=kind,
                prompt=prompt,
                max_tokens=max_tokens,
                n=rng.randint(2, 4) if sampled else 1,
                sample_seed=rng.randrange(1 << 20) if sampled else 0,
                hang_up_s=round(rng.uniform(0.2, 3.0), 3) if kind == "cancel-queued" else 0.0,
                hang_up_chunks=rng.randint(1, 3) if kind == "cancel-stream" else 0,
                burst=in_burst,
            )
        )
    return tuple(out)


def _faults(
    rng: random.Random, span_s: float, lease_s: int, fault_kinds: tuple[str, ...]
) -> tuple[Fault, ...]:
    """More faults than fit in ``span_s`` (a fault a lease at least): the run stops early."""
    out: list[Fault] = []
    kinds: list[str] = []
    while len(out) < max(4, int(span_s / lease_s)):
        if not kinds:
            kinds = rng.sample(fault_kinds, len(fault_kinds))
        kind = kinds.pop()
        gap = round(rng.uniform(2.0, 8.0), 3)
        out.append(Fault(index=len(out), kind=kind, gap_s=gap, **_fault(kind, rng, lease_s)))
    return tuple(out)


def _fault(kind: str, rng: random.Random, lease_s: int) -> dict[str, Any]:
    """The target and lengths of one fault of ``kind``."""
    if kind in ("kill-decode", "kill-prefill"):
        target = DECODE if kind == "kill-decode" else rng.choice(PREFILLS)
        return {"target": (target,), "length_s": round(rng.uniform(1.0, 8.0), 3)}
    pair = (rng.choice(PREFILLS), DECODE)
    if kind == "partition":
        # Half shorter than the renewal margin e - i (leases survive), half past the lease.
        lease = LeaseConfig(kv_lease_duration=lease_s)
        margin = lease.lease_extension - lease.heartbeat_interval
        short = rng.random() < 0.5
        lo, hi = (0.5, margin - 1.0) if short else (lease_s, 2.0 * lease_s)
        return {"target": pair, "length_s": round(rng.uniform(lo, hi), 3)}
    if kind == "loss":
        return {
            "target": pair,
            "length_s": round(rng.uniform(3.0, 2.0 * lease_s), 3),
            "loss": round(rng.uniform(0.05, 0.3), 3),
        }
    down, up = round(rng.uniform(0.3, 2.0), 3), round(rng.uniform(0.5, 3.0), 3)
    flaps = rng.randint(2, 5)
    return {
        "target": (rng.choice(ENGINES),),
        "length_s": round(flaps * (down + up), 3),
        "down_s": down,
        "up_s": up,
        "flaps": flaps,
    }


def kinds_of(faults: Sequence[Fault]) -> dict[str, int]:
    """How many faults of each kind, in :data:`FAULT_KINDS` order (kinds with none left out)."""
    counts = {k: sum(f.kind == k for f in faults) for k in FAULT_KINDS}
    return {k: n for k, n in counts.items() if n}
