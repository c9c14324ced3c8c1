"""LeaseConfig: vLLM's derived timings bit for bit, and every nonsense value refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.config import ConfigError, LeaseConfig, LeaseParams
from kvproto.errors import LocalProtocolError


def test_defaults_are_vllms() -> None:
    c = LeaseConfig()
    assert c.kv_lease_duration == 30
    assert c.decoder_kv_blocks_ttl == 480
    assert c.heartbeat_interval == 5
    assert c.lease_extension == 20
    assert c.params == LeaseParams(duration=30, interval=5, extension=20, max_hold=1800)
    assert c.frame_budget == c.max_frame_bytes


@pytest.mark.parametrize(
    ("duration", "interval", "extension"),
    [(6, 1, 4), (7, 1, 4), (12, 2, 8), (30, 5, 20), (31, 5, 20), (60, 10, 40), (6.5, 1.0, 4.0)],
)
def test_derived_timings_are_vllms_integer_divisions(
    duration: float, interval: float, extension: float
) -> None:
    c = LeaseConfig(kv_lease_duration=duration, read_margin=1)
    assert c.heartbeat_interval == interval == duration // 6
    assert c.lease_extension == extension == duration * 2 // 3


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=6, max_value=10**6))
def test_derived_timings_formula(duration: int) -> None:
    c = LeaseConfig(
        kv_lease_duration=duration, decoder_kv_blocks_ttl=duration, max_hold=duration, read_margin=1
    )
    assert c.heartbeat_interval == duration // 6
    assert c.lease_extension == duration * 2 // 3
    # The margin spec/timing.md relies on: at least three missed ticks fit in an extension.
    assert c.lease_extension >= 3 * c.heartbeat_interval
    assert c.lease_extension > c.heartbeat_interval > 0


@pytest.mark.parametrize("duration", [0, 0.5, 1, 2, 5, 5.99])
def test_duration_below_six_gives_interval_zero_and_is_refused(duration: float) -> None:
    with pytest.raises(ConfigError):
        LeaseConfig(kv_lease_duration=duration)


NUMERIC = [
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "max_hold",
    "read_margin",
    "ack_timeout",
    "done_retries",
    "max_drift_ppm",
    "tombstone_ttl",
    "max_tombstones",
    "max_frame_bytes",
    "max_notification_size",
    "max_leases_per_session",
    "max_sessions",
    "max_ids_per_frame",
    "rate_limit_per_s",
    "rate_limit_burst",
]


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("value", [-1, -0.001, float("nan"), float("inf"), float("-inf")])
def test_negative_and_non_finite_values_are_refused(name: str, value: float) -> None:
    with pytest.raises(ConfigError):
        LeaseConfig(**{name: value})


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("value", ["30", b"30", True, None, [30]])
def test_wrong_types_are_refused(name: str, value: object) -> None:
    if name == "max_notification_size" and value is None:
        return  # None means "no cap"
    with pytest.raises(ConfigError):
        LeaseConfig(**{name: value})
    with pytest.raises(ConfigError):
        LeaseConfig.from_mapping({name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decoder_kv_blocks_ttl": 0},
        {"max_hold": 29, "decoder_kv_blocks_ttl": 29},  # shorter than the lease
        {"max_hold": 400},  # shorter than the 480 s turn-2 TTL
        {"ack_timeout": 0},
        {"read_margin": 20},  # not shorter than the 20 s extension
        {"max_frame_bytes": 255},
        {"max_notification_size": 63},
        {"max_sessions": 0},
        {"max_leases_per_session": 0},
        {"max_ids_per_frame": 0},
        {"rate_limit_per_s": 0},
        {"rate_limit_burst": 0.5},
        {"auth_secret": b"short"},
        {"auth_secret": "a string secret given directly"},
        {"accept_legacy": 1},
        {"done_retries": 1.5},
    ],
)
def test_nonsense_combinations_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LeaseConfig(**kwargs)  # type: ignore[arg-type]


def test_extension_always_exceeds_interval_when_interval_is_positive() -> None:
    # "extension <= interval" cannot be reached through kv_lease_duration alone: once
    # d // 6 >= 1 (d >= 6), d * 2 // 3 >= 4 > d // 6. The check guards the invariant anyway.
    for d in [6, 6.0, 7.5, 11.99, 12, 1e9]:
        c = LeaseConfig(
            kv_lease_duration=d,
            decoder_kv_blocks_ttl=max(d, 480),
            max_hold=max(d, 1800),
            read_margin=1,
        )
        assert c.lease_extension > c.heartbeat_interval


def test_config_error_is_a_local_protocol_error() -> None:
    assert issubclass(ConfigError, LocalProtocolError)


def test_from_mapping_accepts_vllm_names_and_string_secret() -> None:
    c = LeaseConfig.from_mapping(
        {"kv_lease_duration": 60, "decoder_kv_blocks_ttl": 600, "auth_secret": "x" * 16}
    )
    assert c.heartbeat_interval == 10
    assert c.lease_extension == 40
    assert c.auth_secret == b"x" * 16


@pytest.mark.parametrize(
    "mapping",
    [
        {"kv_lease_durations": 30},
        {"backends": ["UCX"]},
        {"kv_lease_duration": 30, "typo": 1},
    ],
)
def test_from_mapping_refuses_unknown_keys(mapping: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        LeaseConfig.from_mapping(mapping)


def test_frame_budget_is_the_smaller_cap() -> None:
    assert LeaseConfig(max_notification_size=256).frame_budget == 256
    assert LeaseConfig(max_frame_bytes=300, max_notification_size=4096).frame_budget == 300


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(NUMERIC),
        st.one_of(
            st.integers(-(10**6), 10**6),
            st.floats(allow_nan=True, allow_infinity=True),
            st.none(),
            st.text(max_size=3),
        ),
        max_size=4,
    )
)
def test_any_mapping_is_a_valid_config_or_config_error(values: dict[str, object]) -> None:
    try:
        c = LeaseConfig.from_mapping(values)
    except ConfigError:
        return
    for name in NUMERIC:
        v = getattr(c, name)
        assert v is None or (math.isfinite(v) and v >= 0)
    assert c.lease_extension > c.heartbeat_interval > 0
    assert c.read_margin < c.lease_extension


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_lease_duration": 1e308, "decoder_kv_blocks_ttl": 1e308, "max_hold": 1e308},
        {"max_hold": 10**400},
        {"kv_lease_duration": 10**400},
    ],
)
def test_values_too_large_for_time_arithmetic_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        LeaseConfig(**kwargs)
