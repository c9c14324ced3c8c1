"""The workload: request arrivals and sizes, drawn up front from the run's seed.

The same seed gives the same requests under every policy, so a comparison
between policies is a comparison on identical traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvproto_tools.sim.scenarios import QueueWait, Scenario

BLOCK_TOKENS = 16
"""Tokens per KV block (vLLM's default block size)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    """One client request as it reaches the prefill tier."""

    index: int
    """Sequence number (also the content tag of its KV blocks)."""
    at: float
    """Arrival time at the prefill tier, global seconds."""
    prefill: int
    """Preferred prefill engine (index among P engines; the router skips dead ones)."""
    decode: int
    """Preferred decode engine (index among D engines)."""
    prompt_tokens: int
    """Prompt length: prefilled by P, read by D, recomputed if the read is not usable."""
    output_tokens: int
    """Tokens D generates."""
    queue_wait: float
    """Seconds the request waits in D's queue before it is scheduled."""
    request_id: str
    """The holder's request id (vLLM's ``remote_request_id``, ~48 bytes like vLLM's)."""
    turn2: bool
    """Whether the client comes back for a second turn."""
    think: float
    """Client think time before turn 2, seconds."""
    turn2_prefill: int
    """Preferred prefill engine for turn 2."""
    dropped: bool
    """The router drops it between the prefill's answer and the decoder."""


def prompt_blocks(tokens: int) -> int:
    """KV blocks for ``tokens`` tokens."""
    return max(1, math.ceil(tokens / BLOCK_TOKENS))


def _wait(q: QueueWait, rng: random.Random) -> float:
    if q.kind == "uniform":
        return rng.uniform(q.a, q.b)
    return min(rng.expovariate(1.0 / q.a), q.b)


def generate(
    scenario: Scenario, rng: random.Random, n_prefill: int, n_decode: int
) -> list[Arrival]:
    """Every request of one run, in arrival order."""
    out: list[Arrival] = []
    t = 0.0
    lo, hi = scenario.prompt_tokens
    while True:
        t += rng.expovariate(scenario.arrival_rate)
        if t >= scenario.arrival_window:
            return out
        prompt = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append(
            Arrival(
                index=len(out),
                at=t,
                prefill=rng.randrange(n_prefill),
                decode=rng.randrange(n_decode),
                prompt_tokens=prompt,
                output_tokens=rng.randint(*scenario.output_tokens),
                queue_wait=_wait(scenario.queue_wait, rng),
                request_id=f"cmpl-{rng.getrandbits(128):032x}-0-{rng.getrandbits(32):08x}",
                turn2=rng.random() < scenario.turn2_fraction,
                think=rng.expovariate(1.0 / scenario.think_mean),
                turn2_prefill=rng.randrange(n_prefill),
                # Drawn only where drops happen: every other scenario's draws stay as they were.
                dropped=scenario.drop_fraction > 0 and rng.random() < scenario.drop_fraction,
            )
        )
