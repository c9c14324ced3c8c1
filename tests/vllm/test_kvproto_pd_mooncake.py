"""KvprotoConnector over the Mooncake transport (``"kv_transport": "mooncake"``), real vLLM engines.

The configuration shape is the NIXL one plus that one key, as with UCX
(test_kvproto_pd_ucx.py, whose checks and helpers this reuses).

1. Config (fast, no engine): the key's values, ``accept_legacy`` refused with
   Mooncake, the transport a compat-hash factor whose mismatch the reader names.
2. Two engines P/D, both Mooncake (one pair start, ~30-60 s here): output
   equals the non-disaggregated baseline, every prompt token arrives through
   the connector (external hits = prompt tokens and the read confirmed), P
   frees DONE; a partial prefix hit reads the tail only; neither engine loads
   NIXL or ucxx. Last, D is killed (SIGKILL) while its claimed request waits
   in the queue: P's Mooncake prober finds D's engine gone and P frees
   (PEER_LOST) within the probe bound, not at lease expiry.

Needs ``mooncake.engine`` (``pip install 'kvproto[mooncake]'`` and, on Debian,
libibverbs: .ci/run extracts it into a private directory for its Mooncake step);
without it the engine test skips with the reason, or fails under
``KVPROTO_REQUIRE_MOONCAKE=1``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.transports.mooncake.mooncake_required import require_mooncake

from .vllm_required import require_vllm

require_vllm()

from kvproto.config import ConfigError  # noqa: E402
from kvproto_transports.mooncake.transport import detection_bound_s  # noqa: E402
from kvproto_vllm.config import (  # noqa: E402
    DEFAULT_PROBE_INTERVAL_S,
    KV_TRANSPORTS,
    parse_extra_config,
)
from kvproto_vllm.transport_choice import BUILDERS  # noqa: E402

from .engine_proc import EngineProc  # noqa: E402
from .kvproto_config import events  # noqa: E402
from .test_kvproto_failures import scenario_kill  # noqa: E402
from .test_kvproto_pd import check_full_transfer, check_partial_hit  # noqa: E402
from .test_kvproto_pd_ucx import check_free_latency, engine  # noqa: E402
from .test_kvproto_worker import vllm_config  # noqa: E402

MOONCAKE = {"kv_transport": "mooncake"}

KILL_BOUND_S = detection_bound_s(DEFAULT_PROBE_INTERVAL_S) + 1.0
"""From D's SIGKILL to P's free: the transport's declared bound at the adapter's probe
interval (1.3 s), plus one second for P's engine step and its pump on 2 shared cores.
A heartbeated 30 s lease would run ~20 s past the last heartbeat."""

# ---------------------------------------------------------------- 1. config


def test_kv_transport_mooncake_key() -> None:
    assert "mooncake" in KV_TRANSPORTS and tuple(BUILDERS) == KV_TRANSPORTS
    assert parse_extra_config(MOONCAKE).kv_transport == "mooncake"
    assert parse_extra_config({"kv_transport": "Mooncake"}).kv_transport == "mooncake"
    shape = {"kv_lease_duration": 6, "auth_secret": "s" * 16, "probe_interval_s": 0.5}
    nixl, mooncake = parse_extra_config(shape), parse_extra_config({**shape, **MOONCAKE})
    assert mooncake.lease == nixl.lease  # every other key means the same
    assert mooncake.probe_interval_s == nixl.probe_interval_s == 0.5
    with pytest.raises(ConfigError, match="kv_transport must be one of 'nixl', 'ucx', 'mooncake'"):
        parse_extra_config({"kv_transport": "mooncake-rdma"})
    with pytest.raises(ConfigError, match=r"accept_legacy .* needs kv_transport 'nixl'"):
        parse_extra_config({"accept_legacy": True, "kvproto_side_channel_port": 7000, **MOONCAKE})


def test_mooncake_is_a_compat_factor(tiny_model_dir: Path) -> None:
    from kvproto_vllm.compat import compat_factors, compat_hash, neighbour_hashes

    cfg = vllm_config(tiny_model_dir)
    by_transport = {kind: compat_factors(cfg, kv_transport=kind) for kind in KV_TRANSPORTS}
    hashes = {kind: compat_hash(f) for kind, f in by_transport.items()}
    assert len(set(hashes.values())) == len(KV_TRANSPORTS)
    # A Mooncake reader facing a NIXL or UCX holder can name the transport as the cause.
    neighbours = neighbour_hashes(by_transport["mooncake"])
    assert neighbours[hashes["nixl"]] == ("kv_transport", "nixl")
    assert neighbours[hashes["ucx"]] == ("kv_transport", "ucx")
    assert neighbour_hashes(by_transport["nixl"])[hashes["mooncake"]] == (
        "kv_transport",
        "mooncake",
    )


# ---------------------------------------------------------------- 2. engines

OTHER_TRANSPORTS = ["nixl", "libnixl", "ucxx", "libucx"]


def assert_mooncake_only(one: EngineProc) -> None:
    """The engine ran Mooncake's engine and loaded neither NIXL nor ucxx (each bundles its
    own libucx, NIXL its own libibverbs)."""
    loaded = one.call("loaded", prefixes=[*OTHER_TRANSPORTS, "mooncake"])
    others = [m for m in loaded["modules"] if m.startswith(tuple(OTHER_TRANSPORTS))]
    assert not others, f"{one.name} imported {others}"
    other_files = [f for f in loaded["files"] if f.startswith(tuple(OTHER_TRANSPORTS))]
    assert not other_files, f"{one.name} mapped {other_files}"
    assert "mooncake.engine" in loaded["modules"]
    assert "mooncake/engine.so" in loaded["files"], loaded["files"]


@pytest.mark.slow
def test_kvproto_pd_over_mooncake(tiny_model_dir: Path) -> None:
    require_mooncake()
    t0 = time.perf_counter()
    p = engine(tiny_model_dir, "P-mooncake", "kv_producer", prefix_caching=False, extra=MOONCAKE)
    # One slot and priority scheduling let the kill case queue a request behind local work.
    d = engine(
        tiny_model_dir,
        "D-mooncake",
        "kv_consumer",
        max_num_seqs=1,
        scheduling_policy="priority",
        extra=MOONCAKE,
    )
    try:
        p_info, d_info = p.wait_ready(), d.wait_ready()
        figures: dict[str, float] = {"P init s": p_info["init_s"], "D init s": d_info["init_s"]}
        for one in (p, d):
            (registered,) = events(one.call("connector_state"), "registered")
            assert registered[3].startswith("mooncake: "), registered
        t_pd = time.perf_counter()
        check_full_transfer(p, d, figures)
        check_free_latency(p, d, figures)
        check_partial_hit(p, d)
        figures["Mooncake P/D checks s"] = time.perf_counter() - t_pd
        assert_mooncake_only(p)
        assert_mooncake_only(d)

        scenario_kill(p, d, figures, label="mooncake", kvproto=True)
        (freed,) = [e for e in events(p.call("connector_state"), "freed") if e[3] != "DONE"][-1:]
        assert freed[3] == "PEER_LOST", freed
        kill_to_free = figures["C mooncake kill->free s"]
        assert kill_to_free <= KILL_BOUND_S, (kill_to_free, KILL_BOUND_S)
        print(
            "\nkvproto P/D over Mooncake: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            + f" (bound {KILL_BOUND_S:.2f}), wall {time.perf_counter() - t0:.1f}s"
        )
    finally:
        p.stop()
        d.stop()
