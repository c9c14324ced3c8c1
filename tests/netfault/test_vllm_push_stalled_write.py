"""Push mode on two real vLLM CPU engines: P's WRITE stalls on the wire past D's lease.

P (kv_producer) and D (kv_consumer) run ``"transfer_mode": "push"`` on two namespace hosts
(:mod:`tests.netfault.vllm_hosts`). After one request whose KV P writes normally, every packet
of 1,000 bytes or more arriving at D is dropped (:meth:`~tests.netfault.netns.Faults.stall_bulk`):
D's registration and P's claim and arm (small) pass, P's WRITE (16 KiB blocks) stops on the
wire, and what P sends after it on the same connection (its heartbeats of D's lease, the
done) waits behind it in TCP's order. D's writable lease lapses with a write that may still
land: D fences it (the blocks stay quarantined, the request keeps waiting, nothing is
reported). Once the link heals, TCP's retransmission lands the stalled write and the late done;
D answers that done LATE (P records the write ``fenced-late``), then recomputes the request,
and its answer equals the baseline: no token came from a write that landed after the lease. A
later request is written by P again.

The same stall, then ``kill -9`` of P once it started the write: the loss report ends D's lease
PEER_LOST at once (proof that nothing more of P's lands, spec/push-mode.md section 5), with
no fence, and D recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.vllm_required import require_vllm

require_vllm()

from tests.vllm.engine_proc import EngineProc, prefill  # noqa: E402
from tests.vllm.kvproto_config import events  # noqa: E402
from tests.vllm.tiny_model import make_prompt  # noqa: E402

from .netns import Link  # noqa: E402
from .vllm_hosts import NsEngine, ns_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LEASE = 6.0
EXTENSION = LEASE * 2 // 3
MAX_TOKENS = 8
STALL_MIN_BYTES = 1000
"""Smaller than one MTU-sized TCP segment of a WRITE, larger than any control frame here."""
HELD_S = 3.0
"""How long after the fence the test checks that D reported nothing (the write may land)."""


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, module_link: Link) -> Iterator[tuple[NsEngine, NsEngine]]:
    """P and D, shared by the module's tests in order (the last one kills P)."""
    link = module_link
    push = {"transfer_mode": "push"}
    p = ns_engine(tiny_model_dir, link, link.p, "kv_producer", lease_s=LEASE, connector_extra=push)
    d = ns_engine(tiny_model_dir, link, link.d, "kv_consumer", lease_s=LEASE, connector_extra=push)
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        link.faults.heal()
        d.stop()
        p.stop()


def _add(d: EngineProc, rid: str, prompt: str, params: dict[str, Any]) -> None:
    d.call(
        "add",
        request_ids=[rid],
        prompts=[prompt],
        sampling={"max_tokens": MAX_TOKENS},
        kv_transfer_params=[params],
    )


def _outcomes(d: EngineProc, rid: str) -> list[tuple[str, str]]:
    """D's push events for request ``rid``: (kind, detail) in order."""
    state = d.call("connector_state")
    return [
        (kind, detail)
        for kind in ("fenced", "written", "load-failed")
        for _, _, subject, detail in events(state, kind)
        # vLLM appends a suffix of its own to the request id it was given.
        if subject == rid or subject.startswith(rid + "-")
    ]


def _p_writes(p: EngineProc, source: str) -> list[tuple[str, str]]:
    """P's push events for the writes out of request ``source``'s blocks (tracked per
    writable lease: ``<source>#<D engine>#<lease>``): (kind, detail) in order."""
    return [
        (kind, detail)
        for _, kind, subject, detail in p.call("connector_state")["worker"]["events"]
        if subject.startswith(source + "#")
    ]


def _wait(check: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _healthy_first(p: EngineProc, d: EngineProc, prompts: dict[str, str]) -> dict[str, list[int]]:
    """Every prompt's plain answer (P alone), then the first prompt pushed on a healthy link:
    the side channel and UCX's connection are up before the fault, and P's write fills D."""
    base = {
        rid: list(
            p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})[0][
                "token_ids"
            ]
        )
        for rid, prompt in prompts.items()
    }
    first = next(iter(prompts))
    _add(d, first, prompts[first], prefill(p, prompts[first]))
    (out,) = d.call("collect", request_ids=[first], timeout_s=60.0)
    assert out["token_ids"] == base[first]
    assert _outcomes(d, first) == [("written", "filled")]
    return base


def test_a_write_stalled_on_the_wire_past_ds_lease_is_fenced_and_recomputed(
    engines: tuple[NsEngine, NsEngine], module_link: Link
) -> None:
    link = module_link
    p, d = engines
    prompts = {f"w{k}": make_prompt(4 + k) for k in range(4)}
    base = _healthy_first(p, d, prompts)

    params = prefill(p, prompts["w1"])
    link.faults.stall_bulk(STALL_MIN_BYTES)
    stalled = time.monotonic()
    _add(d, "w1", prompts["w1"], params)
    fenced_s = _wait(
        lambda: ("fenced", "EXPIRED") in _outcomes(d, "w1"), EXTENSION + 20.0, "D's fence"
    )
    # Fenced, not reported: the write may still land, so the blocks stay D's request's.
    time.sleep(HELD_S)
    assert _outcomes(d, "w1") == [("fenced", "EXPIRED")]
    assert d.call("state")["waiting"] + d.call("state")["running"] >= 1
    link.faults.heal()
    healed = time.monotonic()
    (out,) = d.call("collect", request_ids=["w1"], timeout_s=120.0)
    reported_s = time.monotonic() - healed
    assert out["token_ids"] == base["w1"]  # recomputed: nothing decoded from the late write
    assert _outcomes(d, "w1")[0] == ("fenced", "EXPIRED")
    assert ("written", "filled") not in _outcomes(d, "w1")
    assert [k for k, _ in _outcomes(d, "w1")][1:] == ["load-failed"], _outcomes(d, "w1")

    # P writes again once TCP has recovered (the first try may meet its backed-off
    # retransmission and be recomputed; bounded tries).
    written_again = None
    for rid in ("w2", "w3"):
        _add(d, rid, prompts[rid], prefill(p, prompts[rid]))
        (out,) = d.call("collect", request_ids=[rid], timeout_s=60.0)
        assert out["token_ids"] == base[rid], rid
        if _outcomes(d, rid) == [("written", "filled")]:
            written_again = rid
            break
    assert written_again is not None, (_outcomes(d, "w2"), _outcomes(d, "w3"))
    d_stats = d.call("worker_states")[0]["stats"]
    p_writes = _p_writes(p, params["remote_request_id"])
    # P did write (the bytes were on the wire), and its late done was answered LATE.
    assert [k for k, _ in p_writes] == ["registration", "writing", "write-failed"], p_writes
    assert p_writes[-1][1] == "fenced-late", p_writes
    print(
        f"\nNETFAULT | vLLM engines, push, bulk stalled {healed - stalled:.1f} s | nixl | "
        f"fenced {fenced_s:.1f} s after D got the request (lease {LEASE:.0f} s, extension "
        f"{EXTENSION:.0f} s) | reported {reported_s:.1f} s after the heal, recomputed = "
        f"baseline | wrong=0 | written again by {written_again} | "
        f"push_fenced={d_stats.get('push_fenced', 0)} | D {_outcomes(d, 'w1')} | P {p_writes}"
    )


def test_p_killed_with_its_write_stalled_on_the_wire(
    engines: tuple[NsEngine, NsEngine], module_link: Link
) -> None:
    link = module_link
    p, d = engines
    prompts = {f"k{k}": make_prompt(5 + k) for k in range(2)}
    base = _healthy_first(p, d, prompts)
    params = prefill(p, prompts["k1"])
    source = params["remote_request_id"]
    link.faults.stall_bulk(STALL_MIN_BYTES)
    _add(d, "k1", prompts["k1"], params)

    _wait(lambda: any(k == "writing" for k, _ in _p_writes(p, source)), 20.0, "P's write")
    killed = time.monotonic()
    p.kill()
    # The loss report is proof that nothing more of P's lands (spec/push-mode.md section 5):
    # D ends its lease PEER_LOST at once, with no fence and no wait for its expiry.
    _wait(lambda: bool(_outcomes(d, "k1")), 30.0, "D's outcome")
    reported_s = time.monotonic() - killed
    assert _outcomes(d, "k1") == [("load-failed", "PEER_LOST")]
    assert reported_s < EXTENSION, reported_s
    link.faults.heal()
    (out,) = d.call("collect", request_ids=["k1"], timeout_s=120.0)
    assert out["token_ids"] == base["k1"]  # recomputed by D, nothing from the stalled write
    print(
        f"\nNETFAULT | vLLM engines, push, P kill -9 with its WRITE stalled on the wire | nixl | "
        f"D's lease ended PEER_LOST {reported_s:.2f} s after the kill (no fence), recomputed = "
        f"baseline | wrong=0"
    )
