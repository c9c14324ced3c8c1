"""Contract of KvprotoConnector against the installed vLLM (no engine started).

* no abstract method is left, on KVConnectorBase_V1 or SupportsHMA;
* every method it overrides has the base class's parameters (names, kinds,
  defaults), so vLLM's keyword calls reach it;
* vLLM's factory resolves it from ``kv_connector_module_path`` (which also
  checks the 3-argument constructor);
* importing the module (vLLM does it in the front-end process) starts no NIXL
  agent and loads neither NIXL nor the worker half;
* the stats class aggregates like vLLM expects (counters add, gauges are a
  last value per rank summed over ranks);
* extra-config parsing: lease keys reach the core's LeaseConfig, bad keys fail.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .vllm_required import require_vllm

require_vllm()

from kvproto.config import ConfigError  # noqa: E402
from kvproto_vllm.config import PUSH_REFUSALS, parse_extra_config  # noqa: E402

from .kvproto_config import CLASS_NAME, MODULE_PATH  # noqa: E402


def _import_connector_fresh() -> tuple[type, set[str]]:
    """Import the connector module, returning the modules that import pulled in."""
    before = set(sys.modules)
    from kvproto_vllm import connector

    return connector.KvprotoConnector, set(sys.modules) - before


def test_import_is_light() -> None:
    already = "kvproto_vllm.connector" in sys.modules
    cls, new = _import_connector_fresh()
    assert cls.__name__ == CLASS_NAME
    heavy = {"kvproto_transports.nixl.transport", "kvproto_vllm.worker", "nixl", "nixl._api"}
    if not already:
        assert not heavy & new, f"importing the connector loaded {sorted(heavy & new)}"
    assert not [m for m in new if m.startswith("nixl")]


def test_no_abstract_methods_left() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from kvproto_vllm.connector import KvprotoConnector

    assert issubclass(KvprotoConnector, KVConnectorBase_V1)
    assert issubclass(KvprotoConnector, SupportsHMA)
    assert not KvprotoConnector.__abstractmethods__
    # The base really has abstract methods, so the check above means something.
    assert len(KVConnectorBase_V1.__abstractmethods__) == 7


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_signatures_match_base() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from kvproto_vllm.connector import KvprotoConnector

    checked = []
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name, member in vars(base).items():
            if not callable(member) and not isinstance(member, classmethod | staticmethod):
                continue
            if name.startswith("__") and name != "__init__":
                continue
            ours = KvprotoConnector.__dict__.get(name)
            if ours is None:
                continue
            base_fn = getattr(base, name)
            our_fn = getattr(KvprotoConnector, name)
            assert _params(our_fn) == _params(base_fn), f"{name}: signature differs from {base}"
            checked.append(name)
    # The seven abstract methods and the hooks the connector relies on.
    for name in (
        "__init__",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "on_new_request",
        "request_finished",
        "request_finished_all_groups",
        "register_kv_caches",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "update_connector_output",
        "get_kv_connector_stats",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "get_required_kvcache_layout",
        "get_handshake_metadata",
        "set_xfer_handshake_metadata",
        "has_pending_push_work",
        "shutdown",
    ):
        assert name in checked, f"{name} was not compared"


def test_factory_resolves_from_module_path() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvproto_vllm.connector import KvprotoConnector

    for role in ("kv_producer", "kv_consumer", "kv_both"):
        cfg = KVTransferConfig(
            kv_connector=CLASS_NAME,
            kv_connector_module_path=MODULE_PATH,
            kv_role=role,
            kv_connector_extra_config={"kv_lease_duration": 30},
        )
        assert KVConnectorFactory.get_connector_class(cfg) is KvprotoConnector
    wrong = KVTransferConfig(
        kv_connector="NoSuchConnector", kv_connector_module_path=MODULE_PATH, kv_role="kv_both"
    )
    with pytest.raises(AttributeError, match="NoSuchConnector"):
        KVConnectorFactory.get_connector_class(wrong)


def test_stats_aggregate_and_reduce() -> None:
    from kvproto_vllm.connector import KvprotoConnector
    from kvproto_vllm.stats import DeltaTracker, KvprotoStats

    rank0, rank1 = DeltaTracker("e/0"), DeltaTracker("e/1")
    first = rank0.delta({"holder_grants": 2, "holder_leases_held": 2})
    assert first is not None
    assert rank0.delta({"holder_grants": 2, "holder_leases_held": 2}) is None  # nothing new
    second = rank0.delta({"holder_grants": 3, "holder_leases_held": 1})
    other = rank1.delta({"holder_grants": 1, "holder_leases_held": 4})
    assert second is not None and other is not None
    total = first.aggregate(second).aggregate(other)
    assert total.reduce() == {"holder_grants": 4, "holder_leases_held": 5}
    # A peak gauge keeps the interval's maximum per rank and the maximum over ranks.
    gaps = DeltaTracker("e/0").delta({"worker_pump_gap_ms_max": 30})
    later = DeltaTracker("e/0").delta({"worker_pump_gap_ms_max": 5})
    other_rank = DeltaTracker("e/1").delta({"worker_pump_gap_ms_max": 12})
    assert gaps is not None and later is not None and other_rank is not None
    assert gaps.aggregate(later).aggregate(other_rank).reduce() == {"worker_pump_gap_ms_max": 30}
    rebuilt = KvprotoConnector.build_kv_connector_stats(total.to_dict())
    assert isinstance(rebuilt, KvprotoStats)
    assert rebuilt.reduce() == total.reduce()
    assert not rebuilt.is_empty()
    rebuilt.reset()
    assert rebuilt.is_empty()


def test_extra_config() -> None:
    cfg = parse_extra_config({"kv_lease_duration": 6, "backends": ["UCX"]})
    assert cfg.lease.kv_lease_duration == 6
    assert cfg.lease.heartbeat_interval == 1 and cfg.lease.lease_extension == 4
    # A short lease gets a read margin that fits inside its extension.
    assert cfg.lease.read_margin == 2.0
    assert parse_extra_config(None).lease.read_margin == 5.0
    # Stock tuning keys load and are ignored; secrets become bytes for the core.
    cfg = parse_extra_config({"num_threads": 8, "auth_secret": "x" * 16})
    assert cfg.lease.auth_secret == b"x" * 16 and cfg.side_channel_secret == b"x" * 16
    assert parse_extra_config({"accept_legacy": True}).lease.accept_legacy
    assert parse_extra_config({"kvproto_side_channel_port": 7000}).kvproto_side_channel_port == 7000
    assert parse_extra_config({}).nixl_progress_thread
    assert not parse_extra_config({"nixl_progress_thread": False}).nixl_progress_thread
    bad_configs: tuple[dict[str, Any], ...] = (
        {"kv_lease_duration": 3},  # heartbeat interval 0
        {"no_such_key": 1},
        {"bidirectional_kv_xfer": "yes"},
        {"bidirectional_kv_xfer": True, "accept_legacy": True},
        {"probe_interval_s": -1},
        {"backends": []},
        {"enforce_handshake_compat": False},
        {"kvproto_side_channel_port": 70000},
        {"transfer_mode": "write"},
        {"nixl_progress_thread": "no"},
    )
    for bad in bad_configs:
        with pytest.raises(ConfigError):
            parse_extra_config(bad)
    assert parse_extra_config({"transfer_mode": "pull"}).lease == parse_extra_config({}).lease
    assert parse_extra_config({"transfer_mode": "push"}).transfer_mode == "push"
    # Push mode is refused at engine start with what it cannot serve safely, naming why.
    for key, conflict in (
        ("kv_transport", {"kv_transport": "mooncake"}),
        ("bidirectional_kv_xfer", {"bidirectional_kv_xfer": True}),
        ("accept_legacy", {"accept_legacy": True}),
    ):
        with pytest.raises(ConfigError) as refused:
            parse_extra_config({"transfer_mode": "push", **conflict})
        assert str(refused.value) == PUSH_REFUSALS[key]


def test_a_decoder_checks_its_mode_against_the_modes_its_holder_serves() -> None:
    """P's ``kvproto_transfer_mode`` lists what it serves; D checks its own mode against it
    when the request arrives, before anything else in the parameters (a refusal names both)."""
    from kvproto_vllm.groups import single_full_group
    from kvproto_vllm.holder_scheduler import MODE_KEY, SERVED_MODES
    from kvproto_vllm.reader_scheduler import _parse

    groups = single_full_group(32)
    assert SERVED_MODES == {"pull": ("pull",), "push": ("pull", "push")}
    no_ticket = "no kvproto lease ticket in kv_transfer_params (a stock prefill engine?)"
    # Served: parsing goes on (and stops at the missing ticket here).
    for served, mode in (
        (["pull"], "pull"),
        (["pull", "push"], "pull"),
        (["pull", "push"], "push"),
    ):
        assert _parse({MODE_KEY: served}, groups, 1, mode) == no_ticket
    assert _parse({}, groups, 1, "pull") == no_ticket  # no list: a pull holder's parameters
    assert _parse({}, groups, 1, "push") == (
        "its prefill engine serves transfer_mode pull, this engine runs 'push'; set "
        "transfer_mode 'push' on the prefill engine (a push engine serves pull decoders too) "
        "or the same transfer_mode on both engines"
    )


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=6,
    )
)
def test_any_served_modes_value_is_served_refused_or_malformed_never_an_exception(
    raw: object,
) -> None:
    from kvproto_vllm.groups import single_full_group
    from kvproto_vllm.holder_scheduler import MODE_KEY
    from kvproto_vllm.reader_scheduler import _parse

    for mode in ("pull", "push"):
        got = _parse({MODE_KEY: raw}, single_full_group(32), 1, mode)
        assert isinstance(got, str)  # no ticket either: always a reason
        well_formed = isinstance(raw, list) and raw and all(isinstance(m, str) for m in raw)
        if not well_formed:
            assert got.startswith("malformed kvproto_transfer_mode")
        elif isinstance(raw, list) and mode not in raw:
            assert got.startswith("its prefill engine serves transfer_mode")


EARLY = {
    "do_remote_prefill": True,
    "remote_engine_id": "P-1",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "kvproto_transfer_mode": ["pull", "push"],
}
"""What a proxy that sends a request to both engines at once gives a push decoder."""


def test_an_early_push_registration_names_where_its_prefill_engine_is() -> None:
    """Without a ticket (P has not finished), a push decoder takes P's address from the
    proxy's parameters; anything it cannot use is a reason, and the request recomputes."""
    from kvproto_vllm.groups import single_full_group
    from kvproto_vllm.reader_scheduler import _Early, _parse_early

    groups = single_full_group(32)
    assert _parse_early(EARLY, groups, 2) == _Early(
        engine="P-1", host="10.0.0.7", port=5600, tp_size=1
    )
    assert _parse_early({**EARLY, "kvproto_side_channel_port": 5700}, groups, 1) == _Early(
        engine="P-1", host="10.0.0.7", port=5700, tp_size=1
    )
    reasons = {
        "kvproto_transfer_mode": ["pull"],
        "remote_engine_id": "",
        "remote_host": None,
        "remote_port": 70000,
        "tp_size": 3,
        "remote_block_size": 16,
    }
    for key, bad in reasons.items():
        got = _parse_early({**EARLY, key: bad}, groups, 2)
        assert isinstance(got, str) and got, (key, got)


@given(
    st.dictionaries(
        st.sampled_from([*sorted(EARLY), "remote_block_size"]),
        st.none()
        | st.booleans()
        | st.integers(-2, 70000)
        | st.text(max_size=3)
        | st.lists(st.text(max_size=4), max_size=2),
    )
)
def test_any_early_parameters_give_an_address_or_a_reason(changes: dict[str, Any]) -> None:
    from kvproto_vllm.groups import single_full_group
    from kvproto_vllm.reader_scheduler import _Early, _parse_early

    got = _parse_early({**EARLY, **changes}, single_full_group(32), 1)
    assert isinstance(got, _Early | str)
    if isinstance(got, _Early):
        assert got.engine and got.host and 0 < got.port < 65536 and got.tp_size >= 1


def test_both_engines_name_a_request_by_the_id_they_were_given() -> None:
    """vLLM appends "-" and 8 random characters to the id a request arrived with (each
    engine its own); a registration names P's request by the id without them."""
    from kvproto_vllm.push_registration import external_id

    assert external_id("cmpl-abc-0-1f2e3d4c") == "cmpl-abc-0"
    assert external_id("chatcmpl-x-9a8b7c6d") == "chatcmpl-x"
    assert external_id("early-0123abcd") == "early"
    assert external_id("cmpl-abc-0") == "cmpl-abc-0"  # randomization off: left alone
    assert external_id("12345678") == "12345678"
