"""P/D between two real vLLM CPU engines over KvprotoConnector (child process per engine).

One engine pair, several checks (each engine start costs ~15-30 s here):

1. Full transfer: greedy decode on D equals the non-disaggregated baseline;
   every prompt token arrives through the connector (D's external prefix hits
   = prompt length *and* the reader confirmed the read -- the hit metric alone
   is counted at admission); P holds the blocks after prefill and frees them
   on D's done (reason DONE), no expiry; the lease counters reach vLLM's
   Prometheus metrics.
2. Partial prefix hit: a longer prompt sharing D's cached prefix reads only
   the tail blocks and still equals its baseline.
3. Abort while queued: a request aborted before D ever scheduled it aborts
   its lease; P frees at once (ABORTED), without waiting out the lease.
4. Handshake mismatch: a third engine loading the model from another path
   (compat hash differs, as with stock) cannot handshake; its request fails
   cleanly (clear log, counters) and is recomputed to the same output.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 16


def baseline(p: EngineProc, prompt: str) -> list[int]:
    (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
    return list(base["token_ids"])


def decode(d: EngineProc, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    (dec,) = d.call(
        "generate",
        prompts=[prompt],
        sampling={"max_tokens": MAX_TOKENS},
        kv_transfer_params=[params],
    )
    return dict(dec)


def freed(p: EngineProc) -> dict[str, str]:
    """P worker: request id -> why its lease ended."""
    return {e[2]: e[3] for e in events(p.call("connector_state"), "freed")}


def check_full_transfer(p: EngineProc, d: EngineProc, figures: dict[str, float]) -> list[int]:
    prompt = make_prompt(8)  # 104 tokens: 3 full blocks + 1 partial
    base = baseline(p, prompt)
    free_before = p.call("state")["free_blocks"]
    params = prefill(p, prompt)
    held = p.call("state")
    assert held["requests"] == 1, "P must keep the finished request for D"
    assert held["free_blocks"] == free_before - 4
    assert params["remote_port"] == p.spec.side_channel_port

    dec = decode(d, prompt, params)
    assert dec["token_ids"] == base
    n_prompt = len(dec["prompt_token_ids"])
    d_state = d.call("connector_state")
    (confirmed,) = events(d_state, "confirmed")
    assert confirmed[3] == "4 blocks"
    assert not events(d_state, "failed")
    stats = d_state["worker"]["stats"]
    assert stats["reader_reads_confirmed"] == 1 and stats["reader_failed_recving"] == 0
    assert stats["reader_heartbeats_sent"] >= 1  # the claim travelled in a heartbeat

    released = p.call("wait_idle", timeout_s=30.0)
    assert released["idle"], "P never released the blocks after D's read"
    assert p.call("state")["free_blocks"] == free_before
    assert freed(p) == {params["remote_request_id"]: "DONE"}
    p_stats = p.call("connector_state")["worker"]["stats"]
    assert p_stats["holder_released_done"] == 1 and p_stats["holder_expired"] == 0

    d_metrics = d.call(
        "metrics",
        names=[
            "vllm:external_prefix_cache_hits",
            "vllm:kvproto_reader_reads_confirmed",
            "vllm:kvproto_reader_failed_recving",
            "vllm:kvproto_worker_pump_gap_ms_max",
        ],
    )
    assert d_metrics["vllm:external_prefix_cache_hits"] == n_prompt
    assert d_metrics["vllm:kvproto_reader_reads_confirmed"] == 1
    assert d_metrics["vllm:kvproto_reader_failed_recving"] == 0
    p_metrics = p.call(
        "metrics", names=["vllm:kvproto_holder_grants", "vllm:kvproto_holder_released_done"]
    )
    assert p_metrics == {"vllm:kvproto_holder_grants": 1, "vllm:kvproto_holder_released_done": 1}
    figures["prompt tok"] = n_prompt
    figures["D external hits"] = d_metrics["vllm:external_prefix_cache_hits"]
    figures["D decode s"] = dec["generate_s"]
    figures["D pump gap ms (last interval max)"] = d_metrics["vllm:kvproto_worker_pump_gap_ms_max"]
    figures["track->confirmed ms"] = (confirmed[0] - events(d_state, "tracked")[0][0]) * 1e3
    return base


def check_partial_hit(p: EngineProc, d: EngineProc) -> None:
    long_prompt = make_prompt(12)
    long_base = baseline(p, long_prompt)
    long_params = prefill(p, long_prompt)
    n_remote = len(long_params["remote_block_ids"][0])
    dec = decode(d, long_prompt, long_params)
    assert dec["token_ids"] == long_base
    confirmed = events(d.call("connector_state"), "confirmed")[-1]
    # D had the first prompt's 3 full blocks cached; the shared prefix is local.
    assert confirmed[3] == f"{n_remote - 3} blocks", (confirmed, n_remote)
    assert p.call("wait_idle", timeout_s=30.0)["idle"]
    assert freed(p)[long_params["remote_request_id"]] == "DONE"


def check_abort_while_queued(p: EngineProc, d: EngineProc, figures: dict[str, float]) -> None:
    params = prefill(p, make_prompt(9))
    t_abort = time.perf_counter()
    d.call(
        "add",
        request_ids=["aborted-1"],
        prompts=[make_prompt(9)],
        sampling={"max_tokens": MAX_TOKENS},
        kv_transfer_params=[params],
        abort_now=True,
    )
    assert p.call("wait_idle", timeout_s=30.0)["idle"]
    assert freed(p)[params["remote_request_id"]] == "ABORTED"
    figures["abort->free s"] = time.perf_counter() - t_abort
    assert figures["abort->free s"] < 10, "must not wait out the 30 s lease"


def check_handshake_mismatch(
    p: EngineProc, other: EngineProc, base: list[int], figures: dict[str, float]
) -> None:
    prompt = make_prompt(8)
    params = prefill(p, prompt)
    dec = decode(other, prompt, params)
    assert dec["token_ids"] == base, "a refused handshake must recompute, not corrupt"
    assert dec["finish_reason"] == "length"
    state = other.call("connector_state")
    stats = state["worker"]["stats"]
    assert stats["reader_compat_mismatches"] == 1
    assert stats["reader_failed_recving"] == 1 and stats["reader_reads_started"] == 0
    assert [e[3] for e in events(state, "failed")] == ["connect-failed"]
    assert p.call("connector_state")["worker"]["stats"]["sidechannel_compat_mismatch"] >= 1
    figures["mismatch decode s"] = dec["generate_s"]


def test_kvproto_pd(tiny_model_dir: Path, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    p = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=kvproto_config("kv_producer"),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="P",
    )
    d = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=kvproto_config("kv_consumer"),
            side_channel_port=free_port(),
        ),
        name="D",
    )
    other: EngineProc | None = None
    try:
        p_info, d_info = p.wait_ready(), d.wait_ready()
        figures: dict[str, float] = {"P init s": p_info["init_s"], "D init s": d_info["init_s"]}
        base = check_full_transfer(p, d, figures)
        check_partial_hit(p, d)
        check_abort_while_queued(p, d, figures)
        d.stop()
        # A third engine loading the model from another path: compat hash differs.
        copy = tmp_path / "tinyllama-copy"
        shutil.copytree(tiny_model_dir, copy)
        other = EngineProc(
            EngineSpec(
                model=str(copy),
                kv_transfer_config=kvproto_config("kv_consumer"),
                side_channel_port=free_port(),
            ),
            name="D-other-path",
        )
        other.wait_ready()
        check_handshake_mismatch(p, other, base, figures)
        print(
            "\nkvproto P/D: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            + f", wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        p.stop()
        d.stop()
        if other is not None:
            other.stop()
