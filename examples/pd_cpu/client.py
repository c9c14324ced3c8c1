"""A small OpenAI-style HTTP client (stdlib only) and a Prometheus text reader.

What the example prints and what the HTTP tests compare: completions and chat
completions, streamed or not, always greedy (temperature 0) so a
disaggregated answer can be compared with a plain engine's token for token.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Seconds one request may take end to end (a queued request on a busy CPU engine waits).
REQUEST_TIMEOUT_S = 300.0


class RequestFailed(RuntimeError):
    """The server answered with an HTTP error, cut the stream, or could not be reached."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """One request's result."""

    text: str
    """Generated text (streamed deltas joined)."""
    token_ids: tuple[int, ...] | None
    """Generated token ids where the server returned them (non-streamed completions)."""
    finish_reason: str | None
    """Why generation stopped ("length" for max_tokens)."""
    ttft_s: float
    """Seconds to the first generated text (the whole answer when not streamed)."""
    total_s: float
    """Seconds to the end of the answer."""
    tokens: tuple[str, ...] | None = None
    """Each generated token as text, where ``logprobs`` were asked for."""
    top_logprobs: tuple[tuple[float, ...], ...] | None = None
    """Per generated token, the model's largest log-probabilities there, largest first (as
    many as ``logprobs`` asked for): the next-token distribution the answer was drawn from."""


class _Logprobs:
    """Tokens and top log-probabilities of one choice, gathered over a stream's events."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.top: list[tuple[float, ...]] = []
        self.seen = False

    def add(self, choice: dict[str, Any], keep: int) -> None:
        got = choice.get("logprobs")
        if not got:
            return
        self.seen = True
        self.tokens += got.get("tokens") or []
        # The chosen token's own entry joins the top ones when it is not among them: keep
        # the ``keep`` largest, which describe the distribution whatever was drawn from it.
        self.top += [
            tuple(sorted((top or {}).values(), reverse=True)[:keep])
            for top in got.get("top_logprobs") or []
        ]

    def fields(self) -> dict[str, Any]:
        if not self.seen:
            return {}
        return {"tokens": tuple(self.tokens), "top_logprobs": tuple(self.top)}


def _body(model: str, max_tokens: int, stream: bool, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        **fields,
    }
    if not stream:
        body["return_token_ids"] = True
    return body


def complete(
    url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int = 8,
    stream: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    logprobs: int | None = None,
) -> Answer:
    """``POST /v1/completions`` (``kv_transfer_params`` when talking to an engine directly;
    ``logprobs``: the top log-probabilities of each generated token too)."""
    body = _body(model, max_tokens, stream, prompt=prompt)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if logprobs is not None:
        body["logprobs"] = logprobs
    return _post(url + "/v1/completions", body, chat=False)


def sample(
    url: str,
    model: str,
    prompt: str,
    *,
    n: int,
    seed: int,
    max_tokens: int = 8,
    stream: bool = False,
    temperature: float = 0.8,
    logprobs: int | None = None,
) -> list[Answer]:
    """``POST /v1/completions`` with ``n`` seeded samples: one Answer per choice, by index
    (``logprobs``: the top log-probabilities of each generated token too)."""
    body = _body(model, max_tokens, stream, prompt=prompt, n=n, seed=seed)
    body["temperature"] = temperature
    if logprobs is not None:
        body["logprobs"] = logprobs
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    texts: dict[int, list[str]] = {}
    ids: dict[int, tuple[int, ...] | None] = {}
    finish: dict[int, str | None] = {}
    probs: dict[int, _Logprobs] = {}
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            choices = (
                [c for event in _events(reply) for c in event.get("choices", [])]
                if stream
                else json.load(reply).get("choices", [])
            )
            for choice in choices:
                index = int(choice["index"])
                texts.setdefault(index, []).append(choice.get("text") or "")
                got = choice.get("token_ids")
                ids[index] = tuple(got) if got is not None else None
                finish[index] = choice.get("finish_reason") or finish.get(index)
                probs.setdefault(index, _Logprobs()).add(choice, logprobs or 0)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise RequestFailed(f"HTTP {exc.code} from {url}: {detail}") from exc
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise RequestFailed(f"{url}: {exc}") from exc
    total = time.monotonic() - t0
    if sorted(texts) != list(range(n)):
        raise RequestFailed(f"{url}: choices {sorted(texts)} for n={n}")
    return [
        Answer(
            text="".join(texts[i]),
            token_ids=None if stream else ids[i],
            finish_reason=finish[i],
            ttft_s=total,
            total_s=total,
            **probs[i].fields(),
        )
        for i in range(n)
    ]


def cancel_stream(
    url: str,
    model: str,
    prompt: str,
    *,
    after_chunks: int,
    hang_up: threading.Event | None = None,
    max_tokens: int = 64,
) -> int:
    """Start a streamed completion and hang up, as a client that gives up does.

    Reads ``after_chunks`` events of the stream (0: none, the request still prefilling
    or waiting for its KV), waits until ``hang_up`` is set (when given: the caller
    chooses the moment, e.g. once the request is claimed, rather than guessing a
    delay), then closes the connection. Returns the events read."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    body = json.dumps(_body(model, max_tokens, True, prompt=prompt))
    read = 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if after_chunks:
            reply = conn.getresponse()
            while read < after_chunks:
                line = reply.readline()
                if not line:
                    break
                read += line.startswith(b"data:")
        if hang_up is not None:
            hang_up.wait(REQUEST_TIMEOUT_S)
    finally:
        conn.close()
    return read


def prefill(url: str, model: str, prompt: str) -> dict[str, Any]:
    """Ask a prefill engine directly for ``prompt``'s KV, as the router does.

    Returns the ``kv_transfer_params`` the decoder needs (with kvproto's
    ticket); the prefill engine holds the blocks until the decoder reads them
    or the lease ends."""
    body = _body(model, 1, False, prompt=prompt, kv_transfer_params={"do_remote_decode": True})
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            data = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RequestFailed(f"{url}: {exc}") from exc
    params = data.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RequestFailed(f"{url}: no kv_transfer_params in the prefill answer")
    return params


def chat(
    url: str, model: str, content: str, *, max_tokens: int = 8, stream: bool = False
) -> Answer:
    """``POST /v1/chat/completions`` with one user message."""
    messages = [{"role": "user", "content": content}]
    return _post(
        url + "/v1/chat/completions", _body(model, max_tokens, stream, messages=messages), chat=True
    )


def _post(endpoint: str, body: dict[str, Any], *, chat: bool) -> Answer:
    request = urllib.request.Request(
        endpoint,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            if body["stream"]:
                return _read_stream(reply, t0, chat=chat, logprobs=body.get("logprobs") or 0)
            data = json.load(reply)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise RequestFailed(f"HTTP {exc.code} from {endpoint}: {detail}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RequestFailed(f"{endpoint}: {exc}") from exc
    total = time.monotonic() - t0
    if "choices" not in data or not data["choices"]:
        raise RequestFailed(f"{endpoint}: no choices in {str(data)[:300]}")
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    ids = choice.get("token_ids")
    probs = _Logprobs()
    probs.add(choice, body.get("logprobs") or 0)
    return Answer(
        text=text or "",
        token_ids=tuple(ids) if ids is not None else None,
        finish_reason=choice.get("finish_reason"),
        ttft_s=total,
        total_s=total,
        **probs.fields(),
    )


def _events(reply: Any) -> Iterator[dict[str, Any]]:
    for raw in reply:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise RequestFailed(f"error event in stream: {str(event['error'])[:300]}")
        yield event
    raise RequestFailed("stream ended without [DONE] (the server died mid-answer?)")


def _read_stream(reply: Any, t0: float, *, chat: bool, logprobs: int = 0) -> Answer:
    parts: list[str] = []
    ttft: float | None = None
    finish: str | None = None
    probs = _Logprobs()
    for event in _events(reply):
        for choice in event.get("choices", []):
            probs.add(choice, logprobs)
            delta = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if delta:
                parts.append(delta)
                if ttft is None:
                    ttft = time.monotonic() - t0
            finish = choice.get("finish_reason") or finish
    total = time.monotonic() - t0
    return Answer(
        text="".join(parts),
        token_ids=None,
        finish_reason=finish,
        ttft_s=total if ttft is None else ttft,
        total_s=total,
        **probs.fields(),
    )


def metrics(url: str) -> dict[str, float]:
    """``GET /metrics``: each sample summed over its labels, by metric name."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as reply:
        text = reply.read().decode()
    return parse_prometheus(text)


def metric_where(url: str, name: str, **labels: str) -> float:
    """``GET /metrics``: the samples of ``name`` whose labels include ``labels``, summed
    (``metric_where(url, "vllm:prompt_tokens_by_source_total", source="local_compute")``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as reply:
        text = reply.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        name_labels, _, value = line.rpartition(" ")
        inside = name_labels[len(name) :].strip("{}").split(",")
        if all(w in inside for w in want):
            total += float(value)
    return total


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name: sum of its samples over every label set}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out
