"""The answers a single plain engine gives: what every P/D answer of the run must equal.

After the run, one non-disaggregated ``vllm serve`` (same model, same seed,
same engine arguments, no KV transfer) answers every distinct request that
was answered during the run: greedy completions with their token ids, seeded
samples choice by choice. Asked after the run, so it takes no core from the
deployment while the faults run.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import msgspec

from kvproto_tools.chaos.answers import LOGPROBS, Choice
from kvproto_tools.chaos.schedule import Request


class Expected(msgspec.Struct, frozen=True, kw_only=True):
    """The plain engine's answer to one request."""

    choices: tuple[Choice, ...]
    """One per choice, with the log-probabilities of each token."""


def choice_of(answer: Any) -> Choice:
    """An answer of examples/pd_cpu's client, as the checker compares it."""
    ids = answer.token_ids
    return Choice(
        text=answer.text,
        token_ids=None if ids is None else tuple(ids),
        tokens=answer.tokens,
        top_logprobs=answer.top_logprobs,
    )


def key_of(req: Request) -> str:
    """What makes two requests the same question (their answers must be equal)."""
    return f"{req.n}/{req.sample_seed}/{req.max_tokens}/{req.prompt}"


def answers(
    client: ModuleType, url: str, model: str, requests: Iterable[Request], *, threads: int = 8
) -> dict[str, Expected]:
    """The plain engine at ``url`` asked every distinct request once."""
    distinct = {key_of(r): r for r in requests}

    def ask(req: Request) -> Expected:
        if req.n == 1:
            got = [
                client.complete(
                    url, model, req.prompt, max_tokens=req.max_tokens, logprobs=LOGPROBS
                )
            ]
        else:
            got = client.sample(
                url,
                model,
                req.prompt,
                n=req.n,
                seed=req.sample_seed,
                max_tokens=req.max_tokens,
                logprobs=LOGPROBS,
            )
        return Expected(choices=tuple(choice_of(a) for a in got))

    with ThreadPoolExecutor(threads, thread_name_prefix="chaos-baseline") as pool:
        return dict(zip(distinct, pool.map(ask, distinct.values()), strict=True))
