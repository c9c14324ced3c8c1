"""Whether an answer is the plain engine's: equal, drawn differently from the same distribution,
or wrong.

Both the run and the plain engine ask for the top :data:`LOGPROBS` log-probabilities of
every generated token. An answer whose tokens equal the plain engine's is right. One whose
tokens part at some position is still right if, at every position up to and including
that one, the model's next-token distribution was the same in both (the largest
log-probabilities within :data:`TOLERANCE`): the run computed the same thing from the same
prompt KV, and the token drawn at the parting position differs because the two engines
batched the request differently, which moves the logits by float rounding, and a seeded
sampler's draw (or a greedy near-tie) sat at the edge between two tokens. After that
position the two answers continue from different text and are no longer comparable. A
wrong KV block changes the distribution from its first token on: that is wrong, as is an
answer whose distributions were not returned.
"""

from __future__ import annotations

import msgspec

LOGPROBS = 5
"""Log-probabilities asked per generated token (the largest ones)."""
TOLERANCE = 1e-3
"""Largest difference, in nats, between two log-probabilities the same model computed from
the same KV in two different batches."""


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """One generated sequence as the checker compares it."""

    text: str
    """Its text."""
    token_ids: tuple[int, ...] | None = None
    """Its token ids, where the server returned them (not in a stream)."""
    tokens: tuple[str, ...] | None = None
    """Each token as text (from the log-probabilities)."""
    top_logprobs: tuple[tuple[float, ...], ...] | None = None
    """Per token, the largest log-probabilities there, largest first."""


class Compared(msgspec.Struct, frozen=True, kw_only=True):
    """How one choice compares with the plain engine's."""

    verdict: str
    """``equal``, ``drawn`` (parted at ``position`` from the same distribution) or ``wrong``."""
    position: int = -1
    """Where the tokens part (-1: they do not)."""
    delta: float = 0.0
    """The largest log-probability difference up to there."""


def _delta(got: tuple[float, ...], want: tuple[float, ...]) -> float:
    n = min(len(got), len(want), LOGPROBS)
    if n == 0:
        return float("inf")
    return max(abs(a - b) for a, b in zip(got[:n], want[:n], strict=True))


def compare(got: Choice, want: Choice) -> Compared:
    """``got`` (the run's) against ``want`` (the plain engine's)."""
    same_ids = got.token_ids is None or got.token_ids == want.token_ids
    if got.tokens is None or want.tokens is None or got.top_logprobs is None:
        equal = got.text == want.text and same_ids
        return Compared(verdict="equal" if equal else "wrong")
    assert want.top_logprobs is not None
    part = next(
        (j for j, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)) if a != b),
        -1,
    )
    upto = len(got.tokens) if part < 0 else part + 1
    if len(got.top_logprobs) < upto or len(want.top_logprobs) < upto:
        return Compared(verdict="wrong", position=part)
    delta = max(
        (_delta(got.top_logprobs[j], want.top_logprobs[j]) for j in range(upto)), default=0.0
    )
    if part < 0:
        equal = got.text == want.text and same_ids and len(got.tokens) == len(want.tokens)
        return Compared(verdict="equal" if equal else "wrong", delta=delta)
    return Compared(verdict="drawn" if delta <= TOLERANCE else "wrong", position=part, delta=delta)
