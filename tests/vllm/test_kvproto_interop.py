"""Interop (legacy mode) between a kvproto engine and a stock NixlConnector engine.

Engine A runs KvprotoConnector with ``accept_legacy: true`` (its stock port
serves stock-format handshakes, its kvproto side channel moves to
``kvproto_side_channel_port``); engine B runs stock NixlConnector. Both are
``kv_both``, so one pair covers both directions:

1. Handshake: asked in stock's wire format, A answers with the same compat
   hash and the same NixlAgentMetadata layout fields as B (only the engine,
   the NIXL agent and the memory addresses differ).
2. kvproto P -> stock D works: B decodes A's prefill to the baseline output,
   every prompt token comes through B's NixlConnector with no failed
   transfer, and A's Holder frees on B's stock done frame (text frames applied
   by the core's legacy mode).
3. stock P -> kvproto D is refused by design (a stock prefill engine gives no
   lease ticket, so a kvproto reader could not have the read confirmed): A
   prefills locally to the same output, and B frees its blocks when its own
   lease lapses.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port  # noqa: E402
from .kvproto_config import events, kvproto_config, stock_config  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
STOCK_LEASE = 6
# Fields that name the engine or its memory; everything else must match stock.
PER_ENGINE = {"engine_id", "agent_metadata", "kv_caches_base_addr"}


def stock_handshake(port: int) -> tuple[str, dict[str, Any]]:
    """Stock's request on the wire: msgpack ("get_meta_msg", pp, tp) over REQ."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        payload_bytes, stamp = sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    assert isinstance(msgspec.msgpack.decode(stamp), float)
    payload = msgspec.msgpack.decode(payload_bytes, type=NixlHandshakePayload)
    md = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    return payload.compatibility_hash, {k: getattr(md, k) for k in md.__dataclass_fields__}


def generate(e: EngineProc, prompt: str, max_tokens: int, kvp: dict[str, Any]) -> dict[str, Any]:
    (out,) = e.call(
        "generate", prompts=[prompt], sampling={"max_tokens": max_tokens}, kv_transfer_params=[kvp]
    )
    return dict(out)


def check_handshake(a: EngineProc, b: EngineProc) -> None:
    a_hash, a_md = stock_handshake(a.spec.side_channel_port)
    b_hash, b_md = stock_handshake(b.spec.side_channel_port)
    assert a_hash == b_hash, "stock decoders would refuse the kvproto engine"
    assert {k: v for k, v in a_md.items() if k not in PER_ENGINE} == {
        k: v for k, v in b_md.items() if k not in PER_ENGINE
    }
    assert a_md["engine_id"] != b_md["engine_id"]


def check_kvproto_to_stock(a: EngineProc, b: EngineProc, base: list[int], prompt: str) -> None:
    pre = generate(a, prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params["remote_port"] == a.spec.side_channel_port  # the stock-format listener
    assert params["kvproto_side_channel_port"] != params["remote_port"]
    dec = generate(b, prompt, MAX_TOKENS, params)
    assert dec["token_ids"] == base
    m = b.call(
        "metrics", names=["vllm:external_prefix_cache_hits", "vllm:nixl_num_failed_transfers"]
    )
    assert m["vllm:external_prefix_cache_hits"] == len(dec["prompt_token_ids"])
    assert m["vllm:nixl_num_failed_transfers"] == 0
    assert a.call("wait_idle", timeout_s=30.0)["idle"], "A never freed after B's stock done"
    state = a.call("connector_state")
    freed = {e[2]: e[3] for e in events(state, "freed")}
    assert freed == {params["remote_request_id"]: "DONE"}
    assert state["worker"]["stats"]["holder_legacy_frames"] >= 1


def check_stock_to_kvproto(
    a: EngineProc, b: EngineProc, base: list[int], prompt: str, figures: dict[str, float]
) -> None:
    pre = generate(b, prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params is not None and "kvproto" not in params
    held_since = time.monotonic()
    dec = generate(a, prompt, MAX_TOKENS, params)
    assert dec["token_ids"] == base, "a stock prefill must be recomputed locally"
    assert a.call("connector_state")["scheduler"]["untracked"] == 1
    released = b.call("wait_idle", timeout_s=60.0)
    assert released["idle"]
    figures["stock P held s"] = time.monotonic() - held_since
    assert b.call("metrics", names=["vllm:nixl_num_kv_expired_reqs"]) == {
        "vllm:nixl_num_kv_expired_reqs": 1
    }


def test_interop_with_stock_nixl(tiny_model_dir: Path) -> None:
    t0 = time.perf_counter()
    a = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=kvproto_config(
                "kv_both", accept_legacy=True, kvproto_side_channel_port=free_port()
            ),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="A-kvproto",
    )
    b = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=stock_config("kv_both", kv_lease_duration=STOCK_LEASE),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="B-stock",
    )
    figures: dict[str, float] = {}
    try:
        a.wait_ready()
        b.wait_ready()
        check_handshake(a, b)
        prompt = make_prompt(8)
        (base,) = a.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
        check_kvproto_to_stock(a, b, base["token_ids"], prompt)
        check_stock_to_kvproto(a, b, base["token_ids"], prompt, figures)
    finally:
        a.stop()
        b.stop()
    print(
        "\ninterop: kvproto P -> stock D ok; stock P -> kvproto D recomputed, "
        + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
        + f", wall {time.perf_counter() - t0:.1f}s"
    )
