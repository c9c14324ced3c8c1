"""Push mode with the decoder registered before its prefill finished, between real engines.

A proxy that sends a request to both engines at once (stock push's flow) gives D the
prefill engine's address but no ticket: P has not finished, it has not even started.
D grants its writable lease on the blocks it allocated and registers them per KV cache
group; P tracks the lease as soon as the registration arrives -- it claims it and
heartbeats it from then on -- and pairs D's blocks with its own when its prefill is
granted, then arms and writes (spec/push-mode.md §7). Both engines get the request
with the same external id, as a proxy's ``X-Request-Id`` gives them.

P runs ``max_num_seqs=1`` with priority scheduling (lease 6 s: a heartbeat every
1 s keeps D's lease 4 s), so its prefill can be kept queued behind local work:

* a prefill queued on P for two lease durations: D's lease lives on P's heartbeats,
  the write fills D's blocks, the answer equals the baseline, every prompt token
  came from P, and P's own lease ends with the write (no decoder reads it);
* a registration for a prefill P never receives: P gives it up one lease duration
  after it arrived, D recomputes (= baseline);
* a prefill aborted on P while queued: P gives the registration up at once (its
  scheduler reports the request left without a grant), D recomputes (= baseline);
* P killed while its prefill is queued: D's lease ends PEER_LOST at the transport's
  report, D recomputes (= baseline), never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config  # noqa: E402
from .test_kvproto_failures import Busy, collect, is_request, wait_until  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LEASE = 6
MAX_TOKENS = 8
HITS = "vllm:external_prefix_cache_hits"


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[EngineProc, EngineProc]]:
    push = {"transfer_mode": "push", "kv_lease_duration": LEASE}
    p = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=kvproto_config("kv_producer", **push),
            side_channel_port=free_port(),
            prefix_caching=False,
            max_num_seqs=1,
            scheduling_policy="priority",
        ),
        name="P-early",
    )
    d = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=kvproto_config("kv_consumer", **push),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="D-early",
    )
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        p.stop()
        d.stop()


def early_params(p: EngineProc) -> dict[str, Any]:
    """What a proxy gives D before P has run: P's address, engine, TP size and modes (read
    here from one ordinary prefill's parameters), no ticket and no blocks."""
    known = prefill(p, make_prompt(3))
    return {
        "do_remote_prefill": True,
        "remote_engine_id": known["remote_engine_id"],
        "remote_host": known["remote_host"],
        "remote_port": known["kvproto_side_channel_port"],
        "tp_size": known["tp_size"],
        "kvproto_transfer_mode": known["kvproto_transfer_mode"],
    }


def baseline(p: EngineProc, prompt: str) -> list[int]:
    (out,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
    return list(out["token_ids"])


def worker_events(e: EngineProc, kind: str, tag: str) -> list[tuple[float, str, str, str]]:
    """``kind`` events of the request ``tag`` (named ``<tag>-<8 hex>`` by vLLM, and
    ``<tag>#<engine>#<lease>`` by P's writer)."""
    return [
        ev
        for ev in events(e.call("connector_state"), kind)
        if is_request(ev, tag) or ev[2].startswith(tag + "#")
    ]


def add_decode(d: EngineProc, tag: str, prompt: str, params: dict[str, Any]) -> None:
    d.call(
        "add",
        request_ids=[tag],
        prompts=[prompt],
        sampling={"max_tokens": MAX_TOKENS},
        kv_transfer_params=[dict(params)],
    )


def add_prefill(p: EngineProc, tag: str, prompt: str) -> None:
    p.call(
        "add",
        request_ids=[tag],
        prompts=[prompt],
        sampling={"max_tokens": 1},
        kv_transfer_params=[{"do_remote_decode": True}],
    )


def queued_on_p(p: EngineProc, d: EngineProc, tag: str, prompt: str) -> tuple[list[int], Busy]:
    """The baseline answer; then P's prefill queued behind more urgent local work, and D's
    request registered with P before that prefill ran."""
    base = baseline(p, prompt)
    params = early_params(p)
    busy = Busy(p, f"{tag}-busy")
    busy.top_up(2)
    add_prefill(p, tag, prompt)
    add_decode(d, tag, prompt, params)
    wait_until("registered", lambda: bool(worker_events(p, "registration-early", tag)), 30)
    return base, busy


def test_a_long_prefill_keeps_the_early_registration_and_writes_it(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    prompt = make_prompt(8)
    hits = d.call("metrics", names=[HITS])[HITS]
    queued = time.monotonic()
    base, busy = queued_on_p(p, d, "early", prompt)

    def waiting_on_d() -> None:
        assert not worker_events(d, "load-failed", "early"), "D gave up a heartbeated lease"

    # Two lease durations queued on P: only P's heartbeats keep D's blocks.
    busy.hold(2 * LEASE, waiting_on_d)
    busy.release()
    out = collect(d, "early")
    assert out["token_ids"] == base
    collect(p, "early")
    (registered,) = worker_events(d, "registered-early", "early")
    (written,) = worker_events(d, "written", "early")
    assert written[3] == "filled" and written[0] - registered[0] >= 2 * LEASE
    assert written[0] - queued >= 2 * LEASE
    assert [e[3] for e in worker_events(p, "written", "early")] == ["confirmed"]
    assert len(worker_events(p, "paired", "early")) == 1
    assert d.call("metrics", names=[HITS])[HITS] - hits == len(out["prompt_token_ids"])
    # Nobody reads P's own lease: it ends with the write, and P holds nothing after.
    freed = [e[3] for e in worker_events(p, "freed", "early")]
    assert freed == ["REVOKED"], freed
    assert p.call("wait_idle", timeout_s=30.0)["idle"]
    d_stats = d.call("connector_state")["worker"]["stats"]
    assert d_stats["holder_expired"] == 0 and d_stats["push_fenced"] == 0


def test_a_registration_for_a_prefill_that_never_comes_is_given_up(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    prompt = make_prompt(9)
    base = baseline(p, prompt)
    add_decode(d, "lost", prompt, early_params(p))
    wait_until("registered", lambda: bool(worker_events(d, "registered-early", "lost")), 30)
    busy = Busy(p, "lost-busy")  # P steps (and reads its side channel) meanwhile
    busy.hold(LEASE + 3)
    busy.release()
    out = collect(d, "lost")
    assert out["token_ids"] == base
    (given_up,) = worker_events(p, "write-failed", "lost")
    assert given_up[3] == "no such prefill"
    (registered,) = worker_events(d, "registered-early", "lost")
    (failed,) = worker_events(d, "load-failed", "lost")
    # One lease duration after P saw it, plus the abort's way back and D's next step.
    assert LEASE <= failed[0] - registered[0] <= LEASE + 3, failed[0] - registered[0]


def test_a_prefill_aborted_on_p_gives_the_registration_up_at_once(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    base, busy = queued_on_p(p, d, "dropped", make_prompt(11))
    aborted = time.monotonic()
    p.call("abort", request_ids=["dropped"])
    busy.hold(1.0)
    busy.release()
    out = collect(d, "dropped")
    assert out["token_ids"] == base
    (given_up,) = worker_events(p, "write-failed", "dropped")
    assert given_up[3] == "prefill ended without its KV"
    (failed,) = worker_events(d, "load-failed", "dropped")
    # Not a lease duration: P's scheduler says the request left, P aborts D's lease.
    assert failed[0] - aborted < LEASE / 2, failed[0] - aborted


def test_prefill_engine_killed_while_its_prefill_is_queued(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    base, busy = queued_on_p(p, d, "killed", make_prompt(10))
    busy.hold(1.5)
    killed = time.monotonic()
    p.kill()
    out = collect(d, "killed")
    assert out["token_ids"] == base
    (failed,) = worker_events(d, "load-failed", "killed")
    assert failed[3] == "PEER_LOST", failed
    print(f"\nearly push, P killed while queued: D's lease ended {failed[0] - killed:.2f} s after")
    assert failed[0] - killed <= LEASE * 2 // 3
