"""Clock-offset estimation: min-RTT choice, error bound, drift growth, conservative conversion."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.clock import SkewEstimator, SkewSample
from kvproto.errors import LocalProtocolError


def test_sample_offset_is_peer_minus_midpoint() -> None:
    s = SkewSample(sent=10.0, peer=3610.5, received=11.0)
    assert s.rtt == 1.0
    assert s.offset == 3600.0


def test_no_sample_yet_is_a_local_error() -> None:
    e = SkewEstimator()
    assert not e.known
    with pytest.raises(LocalProtocolError):
        e.offset()
    with pytest.raises(LocalProtocolError):
        e.error_bound(0.0)
    with pytest.raises(LocalProtocolError):
        e.peer_deadline_to_local(10.0, 0.0)


def test_negative_round_trip_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        SkewEstimator().add(SkewSample(sent=2.0, peer=0.0, received=1.0))


def test_min_rtt_sample_is_kept() -> None:
    e = SkewEstimator(max_drift_ppm=0)
    e.add(SkewSample(sent=0.0, peer=100.2, received=0.4))  # rtt 0.4, offset 100.0
    assert e.offset() == 100.0 and e.error_bound(0.4) == 0.2
    e.add(SkewSample(sent=1.0, peer=101.15, received=1.1))  # rtt 0.1, offset 100.1
    assert e.offset() == pytest.approx(100.1) and e.error_bound(1.1) == pytest.approx(0.05)
    e.add(SkewSample(sent=2.0, peer=103.0, received=3.0))  # rtt 1.0: worse, ignored
    assert e.offset() == pytest.approx(100.1)
    assert e.samples == 3


def test_error_bound_grows_with_drift() -> None:
    e = SkewEstimator(max_drift_ppm=500)
    e.add(SkewSample(sent=0.0, peer=50.1, received=0.2))
    # rtt/2 plus drift since the send: the peer may have read its clock right then.
    assert e.error_bound(0.2) == pytest.approx(0.1 + 500e-6 * 0.2)
    assert e.error_bound(1000.0) == pytest.approx(0.1 + 500e-6 * 1000)
    assert e.error_bound(0.0) == pytest.approx(0.1)  # never below the rtt half


def test_newer_sample_with_larger_rtt_beats_an_old_one_once_drift_has_grown() -> None:
    e = SkewEstimator(max_drift_ppm=500)
    e.add(SkewSample(sent=0.0, peer=0.05, received=0.1))  # bound 0.05 at t=0.1
    # 1000 s later the old bound is 0.05 + 0.5 = 0.55; a 0.2 s round trip (0.1) is better.
    e.add(SkewSample(sent=1000.0, peer=1000.3, received=1000.2))
    assert e.offset() == pytest.approx(0.2)
    assert e.error_bound(1000.2) == pytest.approx(0.1 + 500e-6 * 0.2)
    # ... but not a minute after the first one.
    f = SkewEstimator(max_drift_ppm=500)
    f.add(SkewSample(sent=0.0, peer=0.05, received=0.1))
    f.add(SkewSample(sent=60.0, peer=60.3, received=60.2))
    assert f.offset() == pytest.approx(0.0)


def test_conversion_subtracts_error_and_drift_over_the_wait() -> None:
    e = SkewEstimator(max_drift_ppm=500)
    e.add(SkewSample(sent=0.0, peer=3600.1, received=0.2))  # offset 3600 +- 0.1
    # Holder deadline 4080 (its clock) is 480 local, minus the offset's error (0.1 plus
    # 500 ppm since the send), minus 500 ppm of the 479.8 s still to wait.
    err = 0.1 + 500e-6 * 0.2
    assert e.peer_deadline_to_local(4080.0, 0.2) == pytest.approx(480.0 - err - 500e-6 * 479.8)
    # A deadline already in the past needs no drift allowance beyond the offset's.
    err = 0.1 + 500e-6 * 100.2
    assert e.peer_deadline_to_local(3600.0, 100.2) == pytest.approx(0.0 - err)


@settings(max_examples=300, deadline=None)
@given(
    offset=st.floats(-1e5, 1e5, allow_nan=False),
    samples=st.lists(
        st.tuples(
            st.floats(0, 1e4),  # send time
            st.floats(0, 2.0),  # rtt
            st.floats(0, 1),  # where in the round trip the peer read its clock
        ),
        min_size=1,
        max_size=6,
    ),
    deadline_in=st.floats(-100, 1e4),
    now_after=st.floats(0, 1e4),
)
def test_converted_deadline_is_never_later_than_the_true_one(
    offset: float,
    samples: list[tuple[float, float, float]],
    deadline_in: float,
    now_after: float,
) -> None:
    e = SkewEstimator(max_drift_ppm=500)
    last = 0.0
    for sent, rtt, where in sorted(samples):
        received = sent + rtt
        e.add(SkewSample(sent=sent, peer=sent + where * rtt + offset, received=received))
        last = max(last, received)
    now = last + now_after
    true_local_deadline = now + deadline_in
    converted = e.peer_deadline_to_local(true_local_deadline + offset, now)
    assert converted <= true_local_deadline + 1e-6 * (1 + abs(offset))
    assert abs(e.offset() - offset) <= e.error_bound(now) + 1e-6 * (1 + abs(offset))


@settings(max_examples=500, deadline=None)
@given(
    offset=st.floats(-1e4, 1e4, allow_nan=False),
    rate=st.sampled_from([-500e-6, -250e-6, 0.0, 250e-6, 500e-6]),
    samples=st.lists(
        st.tuples(st.floats(0, 1e3), st.floats(0, 5.0), st.floats(0, 1)),
        min_size=1,
        max_size=4,
    ),
    ahead=st.floats(0, 1e4),
    now_after=st.floats(0, 1e3),
)
def test_conversion_is_conservative_under_the_allowed_drift(
    offset: float,
    rate: float,
    samples: list[tuple[float, float, float]],
    ahead: float,
    now_after: float,
) -> None:
    """The peer's clock runs at (1 + rate) of ours, |rate| <= max_drift_ppm."""

    def peer_clock(t: float) -> float:
        return offset + (1 + rate) * t

    e = SkewEstimator(max_drift_ppm=500)
    last = 0.0
    for sent, rtt, where in sorted(samples):
        e.add(SkewSample(sent=sent, peer=peer_clock(sent + where * rtt), received=sent + rtt))
        last = max(last, sent + rtt)
    now = last + now_after
    true_local = now + ahead
    converted = e.peer_deadline_to_local(peer_clock(true_local), now)
    assert converted <= true_local + 1e-7 * (1 + abs(offset) + true_local)
