"""Bidirectional turn 2 between two real vLLM CPU engines over KvprotoConnector.

Both engines run with ``bidirectional_kv_xfer`` (each hosts a holder and a
reader and serves its side channel) and a short ``decoder_kv_blocks_ttl`` so a
lapse fits in the test. Turn 1 goes P -> D as usual; D's finished request keeps
its blocks (prompt + output) under a turn-2 lease and its response carries the
ticket. The turn-2 prompt (turn-1 prompt + turn-1 output + new tokens) goes to
P with D's params:

A. P reads D's blocks through the connector: P's external prefix-cache hits
   equal D's ``remote_num_tokens`` and P's reader confirmed that read; P's
   output equals a non-disaggregated baseline for the turn-2 prompt; D frees
   its turn-2 blocks on P's done (reason DONE), seconds before the TTL. The loop
   closes with D decoding turn 2 from P's blocks (baseline again; the read ends
   where D's prompt ends although P's blocks cover 15 more tokens).
B. A turn-2 request whose D lease already lapsed (D freed it EXPIRED at the
   TTL): P refuses the ticket, recomputes, output = baseline.
C. A turn-2 read begun less than the read margin before D's deadline, the
   lease still live: P's reader does not decline it but sends its heartbeat at
   once (claiming the lease, which renews it on D) and defers the read; on D's
   answer the read goes, is confirmed HELD, D frees DONE, output = baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config  # noqa: E402
from .test_kvproto_pd import freed  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 16
TTL = 15
"""decoder_kv_blocks_ttl: long enough for turn 2 of A on a loaded 2-core box, short
enough that B's lapse costs the test ~TTL seconds (stock default 480)."""
NEW_TOKENS = 5
"""Turn-2 tokens after the conversation: 104 + 16 + 5 = 125, so P's turn-2 blocks
(125 + 15 tokens, 5 blocks) are one more than D's turn-2 prompt needs (4)."""
REFUSED = {"bad-ticket", "lease-lost", "deadline-too-close"}
HITS = "vllm:external_prefix_cache_hits"


def bidir(role: str) -> dict[str, Any]:
    return kvproto_config(role, bidirectional_kv_xfer=True, decoder_kv_blocks_ttl=TTL)


def generate(
    engine: EngineProc, ids: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One greedy request given as token ids (turn 2 must repeat turn 1's exact tokens)."""
    (out,) = engine.call(
        "generate",
        prompts=[{"prompt_token_ids": list(ids)}],
        sampling={"max_tokens": max_tokens},
        kv_transfer_params=[params],
    )
    return dict(out)


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.1)


class Conversation:
    """One client: turn-1 prompt, baselines, and the turn-2 prompt built from them."""

    def __init__(self, p: EngineProc, sentences: int) -> None:
        self.text = make_prompt(sentences)
        (base1,) = p.call("generate", prompts=[self.text], sampling={"max_tokens": MAX_TOKENS})
        self.ids1: list[int] = list(base1["prompt_token_ids"])
        self.base1: list[int] = list(base1["token_ids"])
        self.ids2 = [*self.ids1, *self.base1, *self.ids1[:NEW_TOKENS]]
        self.base2: list[int] = generate(p, self.ids2, MAX_TOKENS)["token_ids"]
        self.d_params: dict[str, Any] = {}
        self.granted_at = 0.0

    def turn1(self, p: EngineProc, d: EngineProc) -> None:
        """P prefills, D decodes; D's answer carries the turn-2 ticket."""
        params = prefill(p, self.text)
        out = generate(d, self.ids1, MAX_TOKENS, params)
        self.granted_at = time.monotonic()  # D minted just before answering
        assert out["token_ids"] == self.base1
        self.d_params = dict(out["kv_transfer_params"])

    @property
    def d_request(self) -> str:
        return str(self.d_params["remote_request_id"])


def check_turn2_read(
    p: EngineProc, d: EngineProc, conv: Conversation, figures: dict[str, float]
) -> None:
    params = conv.d_params
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_port"] == d.spec.side_channel_port
    assert params["remote_num_tokens"] == len(conv.ids1) + MAX_TOKENS - 1
    assert params["kvproto"]["expires_in"] == TTL
    (blocks,) = params["remote_block_ids"]
    assert d.call("state")["requests"] == 1, "D must keep the finished request for turn 2"

    hits0 = p.call("metrics", names=[HITS])[HITS]
    out = p.call(
        "generate",
        prompts=[{"prompt_token_ids": conv.ids2}],
        sampling={"max_tokens": MAX_TOKENS},
        kv_transfer_params=[dict(params)],
    )[0]
    assert out["token_ids"] == conv.base2, "turn 2 from D's blocks must equal the baseline"
    hits = p.call("metrics", names=[HITS])[HITS] - hits0
    assert hits == params["remote_num_tokens"], (hits, params["remote_num_tokens"])

    p_state = p.call("connector_state")
    p_rid = out["kv_transfer_params"]["remote_request_id"]  # P granted D the turn-2 prefill
    (confirmed,) = [e for e in events(p_state, "confirmed") if e[2] == p_rid]
    assert confirmed[3] == f"{len(blocks)} blocks"
    assert not [e for e in events(p_state, "failed") if e[2] == p_rid]
    (tracked,) = [e for e in events(p_state, "tracked") if e[2] == p_rid]
    assert p_state["worker"]["stats"]["reader_reads_confirmed"] == 1

    # D frees on P's done, not at the TTL (CLOCK_MONOTONIC is shared by both processes).
    wait_until("D freed its turn-2 blocks", lambda: conv.d_request in freed(d), 2.0 * TTL)
    d_state = d.call("connector_state")
    (d_free,) = [e for e in events(d_state, "freed") if e[2] == conv.d_request]
    assert d_free[3] == "DONE"
    (granted,) = [e for e in events(d_state, "granted") if e[2] == conv.d_request]
    held_s = d_free[0] - granted[0]
    assert held_s < TTL - 2, f"held {held_s:.1f} s: freed by the TTL, not by P's done"
    assert d_state["worker"]["stats"]["holder_released_done"] >= 1
    assert d.call("wait_idle", timeout_s=30.0)["idle"]

    figures["turn-2 tokens read by P"] = hits
    figures["P turn-2 track->confirmed ms"] = (confirmed[0] - tracked[0]) * 1e3
    figures["D freed after P's track ms"] = (d_free[0] - tracked[0]) * 1e3
    figures["D turn-2 hold s"] = held_s

    # Close the loop: D decodes turn 2 from P's blocks (tail read trimmed to D's prompt).
    back = generate(d, conv.ids2, MAX_TOKENS, dict(out["kv_transfer_params"]))
    assert back["token_ids"] == conv.base2
    d_confirmed = events(d.call("connector_state"), "confirmed")[-1]
    figures["D turn-2 decode blocks read"] = int(d_confirmed[3].split()[0])
    wait_until("P freed its turn-2 prefill", lambda: freed(p).get(p_rid) == "DONE", 30.0)


def check_turn2_refused(p: EngineProc, d: EngineProc, conv: Conversation) -> str:
    """Turn 2 is sent to P; P must not read D's blocks. Returns P's failure reason."""
    before = p.call("connector_state")["worker"]["stats"]["reader_reads_confirmed"]
    out = generate(p, conv.ids2, MAX_TOKENS, dict(conv.d_params))
    assert out["token_ids"] == conv.base2, "a refused turn-2 read must recompute, not corrupt"
    p_state = p.call("connector_state")
    assert p_state["worker"]["stats"]["reader_reads_confirmed"] == before
    p_rid = out["kv_transfer_params"]["remote_request_id"]
    (failed,) = [e for e in events(p_state, "failed") if e[2] == p_rid]
    assert failed[3] in REFUSED, failed
    wait_until(f"D freed {conv.d_request}", lambda: conv.d_request in freed(d), 2.0 * TTL + 10.0)
    # Declined while the lease was live: the reader aborts it, D frees at once. Any
    # other refusal means the lease had already lapsed on D.
    expected = "ABORTED" if failed[3] == "deadline-too-close" else "EXPIRED"
    assert freed(d)[conv.d_request] == expected
    return str(failed[3])


def check_turn2_renewed(p: EngineProc, d: EngineProc, conv: Conversation) -> str:
    """Turn 2 sent to P with less than the read margin left on D: renewed, then read."""
    before = p.call("connector_state")["worker"]["stats"]["reader_reads_confirmed"]
    out = generate(p, conv.ids2, MAX_TOKENS, dict(conv.d_params))
    assert out["token_ids"] == conv.base2
    p_state = p.call("connector_state")
    assert p_state["worker"]["stats"]["reader_reads_confirmed"] == before + 1
    p_rid = out["kv_transfer_params"]["remote_request_id"]
    assert not [e for e in events(p_state, "failed") if e[2] == p_rid]
    assert [e for e in events(p_state, "confirmed") if e[2] == p_rid]
    wait_until(f"D freed {conv.d_request}", lambda: conv.d_request in freed(d), 2.0 * TTL + 10.0)
    assert freed(d)[conv.d_request] == "DONE"
    # Deferred unless a regular heartbeat happened to renew the lease just before the read.
    deferred = [e for e in events(p_state, "deferred") if e[2] == p_rid]
    return "deferred, renewed, read" if deferred else "read"


def test_kvproto_bidirectional(tiny_model_dir: Path) -> None:
    t0 = time.perf_counter()
    p = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=bidir("kv_producer"),
            side_channel_port=free_port(),
            prefix_caching=False,  # baselines run on P; turn 2 must load, not hit locally
        ),
        name="P",
    )
    d = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=bidir("kv_consumer"),
            side_channel_port=free_port(),
        ),
        name="D",
    )
    try:
        p_info, d_info = p.wait_ready(), d.wait_ready()
        figures: dict[str, float] = {"P init s": p_info["init_s"], "D init s": d_info["init_s"]}
        a = Conversation(p, 8)
        a.turn1(p, d)
        check_turn2_read(p, d, a, figures)

        b, c = Conversation(p, 9), Conversation(p, 10)
        b.turn1(p, d)
        c.turn1(p, d)
        # C: sent when D's lease has less than the read margin (5 s) left, still live.
        time.sleep(max(0.0, c.granted_at + TTL - 3.5 - time.monotonic()))
        reason_c = check_turn2_renewed(p, d, c)
        # B: D's lease lapsed (nobody tracked it): D freed EXPIRED at the TTL.
        wait_until("B's turn-2 lease lapsed", lambda: b.d_request in freed(d), 2.0 * TTL)
        reason_b = check_turn2_refused(p, d, b)
        assert freed(d)[b.d_request] == "EXPIRED"
        d_events = d.call("connector_state")
        (b_free,) = [e for e in events(d_events, "freed") if e[2] == b.d_request]
        (b_grant,) = [e for e in events(d_events, "granted") if e[2] == b.d_request]
        figures["D lapse after grant s (TTL 15)"] = b_free[0] - b_grant[0]
        assert TTL - 0.5 <= figures["D lapse after grant s (TTL 15)"] <= TTL + 10
        print(
            "\nkvproto bidirectional: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            + f", near-deadline turn 2: {reason_c}, lapsed turn 2: {reason_b}"
            + f", wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        p.stop()
        d.stop()
