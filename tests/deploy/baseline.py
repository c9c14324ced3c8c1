"""Answers of a plain ``vllm serve``, asked once per request and remembered."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from examples.pd_cpu.client import Answer, chat, complete
from examples.pd_cpu.cluster import Proc


@dataclass(slots=True)
class Baseline:
    """The non-disaggregated engine every P/D answer is compared with (greedy, same seed)."""

    url: str
    model: str
    proc: Proc
    _seen: dict[tuple[str, str, int], Answer] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, kind: str, prompt: str, max_tokens: int) -> Answer:
        """The baseline's non-streamed answer ("completion" or "chat") to ``prompt``."""
        key = (kind, prompt, max_tokens)
        with self._lock:
            known = self._seen.get(key)
        if known is not None:
            return known
        ask = complete if kind == "completion" else chat
        got = ask(self.url, self.model, prompt, max_tokens=max_tokens)
        with self._lock:
            self._seen[key] = got
        return got

    def check(self, kind: str, prompt: str, max_tokens: int, got: Answer) -> None:
        """Assert ``got`` (streamed or not) equals the baseline's answer."""
        want = self.answer(kind, prompt, max_tokens)
        # Token ids and finish reasons in the message: a shorter text can be an early stop
        # or bytes the detokenizer held back, and only these tell which.
        assert got.text == want.text, (
            kind,
            prompt[:40],
            got.text,
            want.text,
            got.token_ids,
            want.token_ids,
            got.finish_reason,
            want.finish_reason,
        )
        if got.token_ids is not None:
            assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason == "length"
