"""The chaos schedule: the same seed gives the same schedule, and its draws are what it says."""

from __future__ import annotations

from collections import Counter

import pytest

from examples.pd_cpu.tiny_model import CORPUS
from kvproto.config import LeaseConfig
from kvproto_tools.chaos.schedule import (
    FAULT_KINDS,
    REQUEST_KINDS,
    SHARED_PREFIXES,
    digest,
    make_schedule,
)

LEASE = 10


def plan(seed: int, duration_s: float = 1800.0):  # type: ignore[no-untyped-def]
    return make_schedule(seed, duration_s, sentences=CORPUS, lease_s=LEASE, rate=1.5, warmup_s=20.0)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    a, b = plan(7), plan(7)
    assert a == b and digest(a) == digest(b)
    assert digest(plan(8)) != digest(a)
    assert digest(plan(7, 1200.0)) != digest(a)  # the duration is part of the draw


def test_the_load_mixes_every_kind_with_bursts_and_shared_prefixes() -> None:
    p = plan(1)
    times = [r.at for r in p.requests]
    assert times == sorted(times) and times[0] > 0 and times[-1] < p.duration_s
    assert [r.index for r in p.requests] == list(range(len(p.requests)))
    kinds = Counter(r.kind for r in p.requests)
    assert set(kinds) == set(REQUEST_KINDS)
    # ~1.5/s steady plus bursts of 6-12 every 30-75 s.
    assert 1.5 * 1800 < len(p.requests) < 2.2 * 1800
    bursts = Counter(r.burst for r in p.requests if r.burst >= 0)
    assert len(bursts) >= 1800 // 75 and all(6 <= n <= 12 for n in bursts.values())
    shared = {r.prompt.split(":")[0] for r in p.requests if r.prompt.startswith("Context ")}
    assert len(shared) == SHARED_PREFIXES
    for r in p.requests:
        assert (r.n > 1) == r.kind.startswith("sample")
        assert (r.hang_up_s > 0) == (r.kind == "cancel-queued")
        assert (r.hang_up_chunks > 0) == (r.kind == "cancel-stream")
        if r.kind == "cancel-stream":
            assert r.max_tokens > r.hang_up_chunks  # the client hangs up mid-stream
    # A repeat asks an earlier question again, word for word and as long.
    earlier: dict[str, int] = {}
    for r in p.requests:
        if r.kind == "repeat":
            assert earlier[r.prompt] == r.max_tokens
        else:
            earlier.setdefault(r.prompt, r.max_tokens)


def test_every_fault_kind_comes_once_a_cycle_with_lengths_against_the_lease() -> None:
    p = plan(2)
    k = len(FAULT_KINDS)
    for start in range(0, len(p.faults) - k + 1, k):
        assert {f.kind for f in p.faults[start : start + k]} == set(FAULT_KINDS)
    lease = LeaseConfig(kv_lease_duration=LEASE)
    margin = lease.lease_extension - lease.heartbeat_interval
    partitions = [f.length_s for f in p.faults if f.kind == "partition"]
    assert any(x < margin - 1.0 for x in partitions) and any(x >= LEASE for x in partitions)
    assert all(x < margin - 1.0 or LEASE <= x <= 2 * LEASE for x in partitions)
    for f in p.faults:
        assert f.index == p.faults.index(f) and 2.0 <= f.gap_s <= 8.0
        if f.kind == "flap":
            assert f.length_s == round(f.flaps * (f.down_s + f.up_s), 3) and f.flaps >= 2
        if f.kind == "loss":
            assert 0.05 <= f.loss <= 0.3
        if f.kind in ("partition", "loss"):
            assert f.target[1] == "decode-0" and f.target[0].startswith("prefill-")


def test_a_choice_of_kinds_draws_only_those_and_all_kinds_keep_the_seeds_faults() -> None:
    some = ("partition", "loss", "flap")
    p = make_schedule(
        1, 120.0, sentences=CORPUS, lease_s=LEASE, rate=1.5, warmup_s=20.0, fault_kinds=some
    )
    assert {f.kind for f in p.faults} == set(some) and p.fault_kinds == some
    assert p.requests == plan(1, 120.0).requests  # the load does not depend on the kinds
    every = make_schedule(
        1, 120.0, sentences=CORPUS, lease_s=LEASE, rate=1.5, warmup_s=20.0, fault_kinds=FAULT_KINDS
    )
    assert every == plan(1, 120.0)
    with pytest.raises(ValueError, match="choose from"):
        make_schedule(
            1, 120.0, sentences=CORPUS, lease_s=LEASE, rate=1.5, warmup_s=20.0, fault_kinds=("x",)
        )
