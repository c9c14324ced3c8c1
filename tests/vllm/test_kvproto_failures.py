"""Failure paths between real vLLM CPU engines, with a short lease (kv_lease_duration 6:
heartbeat every 1 s, a heartbeat keeps the lease 4 s).

One kvproto pair (P, and D with max_num_seqs=1 so a request can be made to
queue behind local work), then, with ``KVPROTO_STOCK_BESIDE=1``, one stock
NixlConnector pair for the side-by-side figure of C (CI skips it for time;
spec/vllm-adapter.md §4 has its figure):

A. Overload: D's request waits in the queue for three lease durations behind
   local requests; D heartbeats it from enqueue, so P never frees early; the
   read is confirmed and the output equals the baseline.
B. Slow D: D's request is claimed, then D's engine stalls (no steps, no
   heartbeats) past the lease; P frees (EXPIRED); when D resumes the read is
   refused or fenced, the request is recomputed, and the output still equals
   the baseline -- never decoded from freed blocks.
C. D killed while its request waits: P learns it from the transport (probe)
   and frees its blocks (PEER_LOST) within the bound; the same scenario with
   stock NixlConnector engines frees only when the heartbeat lease lapses.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config, stock_config  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LEASE = 6
MAX_TOKENS = 8
BUSY_TOKENS = 480  # a local request that keeps D's only slot for several seconds
FENCED = {"lease-lost", "deadline-too-close", "fenced-late", "fenced-no-ack", "bad-ticket"}


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - t0


class Busy:
    """Keeps D's only slot taken by more urgent local requests, so a P/D request queues.

    D runs with scheduling_policy "priority": local requests added with
    priority -1 always go first; whenever fewer than one waits, another is added.
    """

    def __init__(self, d: EngineProc, tag: str) -> None:
        self.d, self.tag, self.ids = d, tag, []  # type: ignore[var-annotated]

    def queue(self, prompt: str, params: dict[str, Any]) -> None:
        self.top_up(2)
        self.d.call(
            "add",
            request_ids=[self.tag],
            prompts=[prompt],
            sampling={"max_tokens": MAX_TOKENS},
            kv_transfer_params=[params],
        )

    def top_up(self, n: int = 1) -> None:
        state = self.d.call("state")
        # waiting counts the P/D request too; keep one urgent request behind the running one.
        if self.ids and state["waiting"] >= 2:
            return
        new = [f"{self.tag}-busy{len(self.ids) + i}" for i in range(n)]
        self.d.call(
            "add",
            request_ids=new,
            prompts=["Hello there."] * n,
            sampling={"max_tokens": BUSY_TOKENS},
            priority=-1,
        )
        self.ids += new

    def hold(self, seconds: float, check: Callable[[], None] = lambda: None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.top_up()
            check()
            time.sleep(0.2)

    def release(self) -> None:
        self.d.call("abort", request_ids=self.ids)


def holder_stats(p: EngineProc) -> dict[str, int]:
    return dict(p.call("connector_state")["worker"]["stats"])


def freed_at(p: EngineProc, request_id: str) -> tuple[float, str] | None:
    for t, _, rid, reason in events(p.call("connector_state"), "freed"):
        if rid == request_id:
            return t, reason
    return None


def is_request(event: tuple[Any, ...], tag: str) -> bool:
    """vLLM appends "-<8 hex>" to the id a client gives."""
    return re.fullmatch(re.escape(tag) + r"(-[0-9a-f]{8})?", event[2]) is not None


def collect(d: EngineProc, rid: str) -> dict[str, Any]:
    (out,) = d.call("collect", request_ids=[rid], timeout_s=120.0)
    return dict(out)


def scenario_overload(p: EngineProc, d: EngineProc, figures: dict[str, float]) -> None:
    prompt = make_prompt(8)
    (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
    params = prefill(p, prompt)
    granted = time.monotonic()
    busy = Busy(d, "over")
    busy.queue(prompt, params)

    def still_held() -> None:
        assert freed_at(p, params["remote_request_id"]) is None, "P freed a heartbeated lease"
        assert d.call("state")["waiting"] >= 1

    # Three lease durations in the queue: P must still hold the blocks.
    busy.hold(3 * LEASE, still_held)
    figures["A queued s"] = time.monotonic() - granted
    busy.release()
    out = collect(d, "over")
    assert out["token_ids"] == base["token_ids"]
    state = d.call("connector_state")
    assert any(is_request(e, "over") for e in events(state, "confirmed"))
    figures["A heartbeats"] = state["worker"]["stats"]["reader_heartbeats_sent"]
    assert wait_until("P frees", lambda: freed_at(p, params["remote_request_id"]) is not None) < 30
    assert freed_at(p, params["remote_request_id"])[1] == "DONE"  # type: ignore[index]
    assert holder_stats(p)["holder_expired"] == 0


def scenario_slow_decoder(p: EngineProc, d: EngineProc, figures: dict[str, float]) -> None:
    prompt = make_prompt(9)
    (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
    claims = holder_stats(p)["holder_claims"]
    params = prefill(p, prompt)
    busy = Busy(d, "slow")
    busy.queue(prompt, params)
    wait_until("claim", lambda: holder_stats(p)["holder_claims"] > claims, 30)
    busy.hold(1.5)  # a heartbeat or two after the claim
    stall_from = time.monotonic()
    d.call("stall", seconds=LEASE + 3)  # engine blocked: no steps, no heartbeats
    busy.release()
    out = collect(d, "slow")
    assert out["token_ids"] == base["token_ids"], "a fenced read must recompute, not corrupt"
    assert out["finish_reason"] == "length"
    failed = [e for e in events(d.call("connector_state"), "failed") if is_request(e, "slow")]
    assert failed and failed[0][3] in FENCED, failed
    assert not [e for e in events(d.call("connector_state"), "confirmed") if is_request(e, "slow")]
    free = freed_at(p, params["remote_request_id"])
    assert free is not None and free[1] == "EXPIRED", free
    figures["B freed after stall s"] = free[0] - stall_from
    print(f"\nslow decoder: request failed with {failed[0][3]!r}, recomputed")
    assert d.call("connector_state")["worker"]["stats"]["reader_failed_recving"] >= 1


def scenario_kill(
    p: EngineProc, d: EngineProc, figures: dict[str, float], *, label: str, kvproto: bool
) -> None:
    prompt = make_prompt(10)
    free_before = p.call("state")["free_blocks"]
    claims = holder_stats(p)["holder_claims"] if kvproto else 0
    params = prefill(p, prompt)
    busy = Busy(d, "kill")
    busy.queue(prompt, params)
    if kvproto:
        wait_until("claim", lambda: holder_stats(p)["holder_claims"] > claims, 30)
    # A few heartbeats (every 1 s) have renewed the lease while the request waits.
    busy.hold(2.0, lambda: None)
    assert p.call("state")["requests"] == 1
    killed = time.monotonic()
    d.kill()
    released = p.call("wait_idle", timeout_s=60.0)
    assert released["idle"], f"{label}: P never released the blocks of a dead decoder"
    figures[f"C {label} kill->free s"] = time.monotonic() - killed
    assert p.call("state")["free_blocks"] == free_before
    if kvproto:
        free = freed_at(p, params["remote_request_id"])
        assert free is not None and free[1] in ("PEER_LOST", "EXPIRED"), free
        figures["C kvproto reason PEER_LOST"] = float(free[1] == "PEER_LOST")
        # Bound: probe interval (1 s) + a send, or at worst the lease extension.
        assert free[0] - killed <= LEASE + 1, free[0] - killed


def engine(model: Path, cfg: dict[str, Any], name: str, **kw: Any) -> EngineProc:
    return EngineProc(
        EngineSpec(model=str(model), kv_transfer_config=cfg, side_channel_port=free_port(), **kw),
        name=name,
    )


def test_failure_paths(tiny_model_dir: Path) -> None:
    t0 = time.perf_counter()
    figures: dict[str, float] = {}
    p = engine(
        tiny_model_dir,
        kvproto_config("kv_producer", kv_lease_duration=LEASE),
        "P",
        prefix_caching=False,
    )
    d = engine(
        tiny_model_dir,
        kvproto_config("kv_consumer", kv_lease_duration=LEASE),
        "D",
        prefix_caching=False,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    try:
        p.wait_ready()
        d.wait_ready()
        scenario_overload(p, d, figures)
        scenario_slow_decoder(p, d, figures)
        scenario_kill(p, d, figures, label="kvproto", kvproto=True)
    finally:
        p.stop()
        d.stop()
    if os.environ.get("KVPROTO_STOCK_BESIDE") == "1":
        _stock_kill(tiny_model_dir, figures)
    print(
        f"\nfailure paths (kv_lease_duration {LEASE}): "
        + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
        + f", wall {time.perf_counter() - t0:.1f}s"
    )


def _stock_kill(tiny_model_dir: Path, figures: dict[str, float]) -> None:
    sp = engine(
        tiny_model_dir,
        stock_config("kv_producer", kv_lease_duration=LEASE),
        "stock-P",
        prefix_caching=False,
    )
    sd = engine(
        tiny_model_dir,
        stock_config("kv_consumer", kv_lease_duration=LEASE),
        "stock-D",
        prefix_caching=False,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    try:
        sp.wait_ready()
        sd.wait_ready()
        scenario_kill(sp, sd, figures, label="stock", kvproto=False)
    finally:
        sp.stop()
        sd.stop()
