"""KvprotoConnector over the UCX transport (``"kv_transport": "ucx"``), real vLLM engines.

The configuration shape is the NIXL one plus that one key (same lease keys,
same side channel env, same auth secret); see spec/vllm-adapter.md section 1.

1. Config (fast): the key's values, a clear ConfigError for an unknown value
   (at connector construction) and for ``accept_legacy`` with UCX; the
   transport is a compat-hash factor.
2. Worker level over real UCX (no engine; WorkerSide P and D in one process,
   the test playing the scheduler, helpers shared with test_kvproto_worker):
   a read moves exactly the holder's blocks, tail-only on a partial hit; a UCX
   reader facing a NIXL holder is refused at the handshake, names the
   transport as the cause and fails the request (recompute). That case loads
   NIXL and ucxx in one process, which works here; engines never do it.
3. Two engines P/D, both UCX: output equals the non-disaggregated baseline,
   every prompt token arrives through the connector (external hits = prompt
   tokens and the read confirmed), P frees DONE; partial prefix hit; abort
   while queued; neither engine loads NIXL. A NIXL P (started alongside) and
   the UCX D: refused at the handshake (transport named), recomputed, output
   equals the baseline. Last, D is killed while its request waits in the
   queue: UCX endpoint error handling reports the peer lost and P frees
   (PEER_LOST) about a probe interval later, not at lease expiry.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.fixtures import one_group_kv_cache_config

from .vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from kvproto.config import ConfigError  # noqa: E402
from kvproto_transports.ucx import ucx_available, unavailable_reason  # noqa: E402
from kvproto_vllm.config import KV_TRANSPORTS, parse_extra_config  # noqa: E402
from kvproto_vllm.metadata import Grant, KvprotoMetadata  # noqa: E402
from kvproto_vllm.transport_choice import BUILDERS  # noqa: E402

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config  # noqa: E402
from .test_kvproto_failures import scenario_kill  # noqa: E402
from .test_kvproto_pd import (  # noqa: E402
    baseline,
    check_abort_while_queued,
    check_full_transfer,
    check_partial_hit,
    decode,
)
from .test_kvproto_worker import (  # noqa: E402
    INCARNATION,
    LAYERS,
    Loop,
    make_worker,
    mint,
    orders,
    vllm_config,
)
from .tiny_model import CORPUS  # noqa: E402

UCX = {"kv_transport": "ucx"}

# Like the transport's own tests: without ucxx (CI's install of it is optional) the tests
# that run UCX skip with the reason; the config tests still run.
skip_without_ucx = pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}")


# ---------------------------------------------------------------- 1. config


def test_kv_transport_key() -> None:
    assert parse_extra_config(None).kv_transport == "nixl"
    assert parse_extra_config({"kv_transport": "nixl"}).kv_transport == "nixl"
    assert parse_extra_config({"kv_transport": "UCX"}).kv_transport == "ucx"
    shape = {"kv_lease_duration": 6, "auth_secret": "s" * 16, "kvproto_side_channel_port": 7000}
    nixl, ucx = parse_extra_config(shape), parse_extra_config({**shape, **UCX})
    assert ucx.lease == nixl.lease  # every other key means the same
    assert ucx.kvproto_side_channel_port == nixl.kvproto_side_channel_port == 7000
    assert ucx.side_channel_secret == nixl.side_channel_secret
    for bad in ("rdma", "", 1, None, ["ucx"]):
        with pytest.raises(ConfigError, match="kv_transport must be one of 'nixl', 'ucx'"):
            parse_extra_config({"kv_transport": bad})
    with pytest.raises(ConfigError, match=r"accept_legacy .* needs kv_transport 'nixl'"):
        parse_extra_config({"accept_legacy": True, "kvproto_side_channel_port": 7000, **UCX})
    assert tuple(BUILDERS) == KV_TRANSPORTS


def test_connector_refuses_an_unknown_transport(tiny_model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvproto_vllm.compat import compat_factors, compat_hash, neighbour_hashes
    from kvproto_vllm.connector import KvprotoConnector

    cfg = vllm_config(tiny_model_dir)
    cfg.kv_transfer_config.kv_connector_extra_config = {"kv_transport": "rdma"}
    kv_cache = one_group_kv_cache_config(8)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="kv_transport"):
            KvprotoConnector(cfg, role, kv_cache)

    nixl = compat_factors(cfg, kv_transport="nixl")
    ucx = compat_factors(cfg, kv_transport="ucx")
    assert compat_hash(nixl) != compat_hash(ucx)
    assert neighbour_hashes(ucx)[compat_hash(nixl)] == ("kv_transport", "nixl")
    assert neighbour_hashes(ucx)[compat_hash({**ucx, "use_mla": True})] == ("use_mla", True)
    # Not a factor: unequal block sizes are read when the reader's divide by the holder's.
    assert "block_size" not in ucx


# ---------------------------------------------------------- 2. worker level


@pytest.mark.ucx
@skip_without_ucx
def test_worker_reads_over_ucx(tiny_model_dir: Path) -> None:
    cfg = vllm_config(tiny_model_dir)
    p, p_kv = make_worker(cfg, "P-ucx", holds=True, port=free_port(), **UCX)
    d, d_kv = make_worker(cfg, "D-ucx", holds=False, port=free_port(), **UCX)
    try:
        assert p.transport is not None and p.transport.name == "ucx"
        assert d.transport is not None and d.transport.name == "ucx"
        loop = Loop(p, d)
        t0 = time.perf_counter()
        for rid, (local, remote, expect_local, expect_remote) in {
            "full": ([20, 21, 22, 23], [5, 6, 7, 8], [20, 21, 22, 23], [5, 6, 7, 8]),
            "tail": ([30, 31], [9, 10, 11, 12], [30, 31], [11, 12]),  # partial prefix hit
        }.items():
            ticket = mint(p, f"p-{rid}")
            track, recv = orders(f"d-{rid}", ticket, p.base_port, local, remote)
            loop.step(
                KvprotoMetadata(
                    incarnation=INCARNATION, grants=[Grant(request_id=f"p-{rid}", ticket=ticket)]
                ),
                KvprotoMetadata(tracks=[track], recvs=[recv]),
            )
            loop.run_until(rid, lambda r=rid: f"d-{r}" in loop.recving and f"p-{r}" in loop.sending)
            for name in LAYERS:
                assert torch.equal(d_kv[name][expect_local], p_kv[name][expect_remote])
            loop.step(d_meta=KvprotoMetadata(finishes=[f"d-{rid}"]))
        for _ in range(5):
            loop.step()
        assert loop.recving == ["d-full", "d-tail"] and loop.failed == []
        assert loop.sending == ["p-full", "p-tail"] and not loop.bad_blocks
        assert p.stats_snapshot()["holder_released_done"] == 2
        print(f"\nUCX worker-level: 2 reads confirmed and freed in {time.perf_counter() - t0:.2f}s")
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.ucx
@pytest.mark.nixl
@skip_without_ucx
def test_ucx_reader_refused_by_nixl_holder(tiny_model_dir: Path) -> None:
    cfg = vllm_config(tiny_model_dir)
    p, _ = make_worker(cfg, "P-nixl", holds=True, port=free_port())
    d, _ = make_worker(cfg, "D-ucx-2", holds=False, port=free_port(), **UCX)
    try:
        loop = Loop(p, d)
        ticket = mint(p, "p-mix")
        track, recv = orders("d-mix", ticket, p.base_port, [3, 4], [5, 6])
        loop.step(
            KvprotoMetadata(
                incarnation=INCARNATION, grants=[Grant(request_id="p-mix", ticket=ticket)]
            ),
            KvprotoMetadata(tracks=[track], recvs=[recv]),
        )
        loop.run_until("failed", lambda: loop.failed)
        assert loop.failed == ["d-mix"] and loop.recving == ["d-mix"]
        assert loop.bad_blocks <= {3, 4}
        assert [e[1:] for e in d.events if e[1] == "transport-mismatch"] == [
            ("transport-mismatch", f"127.0.0.1:{p.base_port}", "nixl")
        ]
        stats = d.stats_snapshot()
        assert stats["worker_transport_mismatches"] == 1
        assert stats["reader_compat_mismatches"] == 1 and stats["reader_reads_started"] == 0
        assert p.stats_snapshot()["sidechannel_compat_mismatch"] == 1
    finally:
        d.shutdown()
        p.shutdown()


# ---------------------------------------------------------------- 3. engines

NIXL_PREFIXES = ["nixl", "libnixl"]


def assert_no_nixl(engine: EngineProc) -> None:
    loaded = engine.call("loaded", prefixes=[*NIXL_PREFIXES, "ucxx", "libucx"])
    nixl = [m for m in loaded["modules"] if m.startswith(tuple(NIXL_PREFIXES))]
    assert not nixl, f"{engine.name} imported {nixl}"
    nixl_files = [f for f in loaded["files"] if f.startswith(tuple(NIXL_PREFIXES))]
    assert not nixl_files, f"{engine.name} mapped {nixl_files}"
    assert "ucxx" in loaded["modules"]
    assert any(f.startswith("libucx/") for f in loaded["files"]), loaded["files"]


def check_free_latency(p: EngineProc, d: EngineProc, figures: dict[str, float]) -> None:
    """When P freed the first request's blocks, seen from D's events, ms (one host:
    CLOCK_MONOTONIC is shared by the processes). P frees on D's done frame, then answers
    HELD, on which D confirms: freed comes before confirmed."""
    d_state = d.call("connector_state")
    (tracked,) = events(d_state, "tracked")[:1]
    (confirmed,) = events(d_state, "confirmed")[:1]
    (freed,) = events(p.call("connector_state"), "freed")[:1]
    assert tracked[0] < freed[0] < confirmed[0]
    figures["D tracked->P freed ms"] = (freed[0] - tracked[0]) * 1e3
    figures["P freed->D confirmed ms"] = (confirmed[0] - freed[0]) * 1e3


def check_transport_mismatch(
    p_nixl: EngineProc, d_ucx: EngineProc, figures: dict[str, float]
) -> None:
    # A prompt none of the earlier ones is a prefix of: all of it is remote.
    prompt = " ".join(CORPUS[(i + 3) % len(CORPUS)] for i in range(8))
    base = baseline(p_nixl, prompt)
    before = d_ucx.call("connector_state")["worker"]["stats"]
    params = prefill(p_nixl, prompt)
    dec = decode(d_ucx, prompt, params)
    assert dec["token_ids"] == base, "a refused handshake must recompute, not corrupt"
    assert dec["finish_reason"] == "length"
    state = d_ucx.call("connector_state")
    stats = state["worker"]["stats"]
    assert stats["worker_transport_mismatches"] == 1
    assert stats["reader_compat_mismatches"] == before["reader_compat_mismatches"] + 1
    assert stats["reader_failed_recving"] == before["reader_failed_recving"] + 1
    assert stats["reader_reads_started"] == before["reader_reads_started"]
    assert [e[3] for e in events(state, "transport-mismatch")] == ["nixl"]
    assert events(state, "failed")[-1][3] == "connect-failed"
    p_stats = p_nixl.call("connector_state")["worker"]["stats"]
    assert p_stats["sidechannel_compat_mismatch"] >= 1
    figures["mismatch decode s"] = dec["generate_s"]


def engine(model: Path, name: str, role: str, **kw: Any) -> EngineProc:
    extra = kw.pop("extra", UCX)
    return EngineProc(
        EngineSpec(
            model=str(model),
            kv_transfer_config=kvproto_config(role, **extra),
            side_channel_port=free_port(),
            **kw,
        ),
        name=name,
    )


@pytest.mark.ucx
@pytest.mark.slow
@skip_without_ucx
def test_kvproto_pd_over_ucx(tiny_model_dir: Path) -> None:
    t0 = time.perf_counter()
    p = engine(tiny_model_dir, "P-ucx", "kv_producer", prefix_caching=False)
    # One slot and priority scheduling let the kill case queue a request behind local work.
    d = engine(tiny_model_dir, "D-ucx", "kv_consumer", max_num_seqs=1, scheduling_policy="priority")
    p_nixl = engine(tiny_model_dir, "P-nixl", "kv_producer", prefix_caching=False, extra={})
    try:
        p_info, d_info = p.wait_ready(), d.wait_ready()
        figures: dict[str, float] = {"P init s": p_info["init_s"], "D init s": d_info["init_s"]}
        for one in (p, d):
            (registered,) = events(one.call("connector_state"), "registered")
            assert registered[3].startswith("ucx: "), registered
        t_pd = time.perf_counter()
        check_full_transfer(p, d, figures)
        check_free_latency(p, d, figures)
        check_partial_hit(p, d)
        check_abort_while_queued(p, d, figures)
        figures["UCX P/D checks s"] = time.perf_counter() - t_pd
        assert_no_nixl(p)
        assert_no_nixl(d)
        # The UCX decoder meets a NIXL prefill engine: refused at the handshake.
        p_nixl.wait_ready()
        check_transport_mismatch(p_nixl, d, figures)
        p_nixl.stop()
        scenario_kill(p, d, figures, label="ucx", kvproto=True)
        (freed,) = [e for e in events(p.call("connector_state"), "freed") if e[3] != "DONE"][-1:]
        assert freed[3] == "PEER_LOST", freed
        print(
            "\nkvproto P/D over UCX: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            + f", wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        p.stop()
        d.stop()
        p_nixl.stop()
