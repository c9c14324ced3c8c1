"""The oracles catch broken lease logic, and a failing seed replays exactly."""

from __future__ import annotations

import dataclasses

from kvproto.legacy import LegacyHeartbeat, parse
from kvproto_tools.baselines import VllmLeaseConfig, VllmLeaseHolder
from kvproto_tools.sim import POLICIES, Policy, Simulator
from kvproto_tools.sim.sides import Side
from kvproto_tools.sim.transport import SimTransport
from kvproto_tools.sim.vllm_side import VllmSide


class _ShorteningHolder(VllmLeaseHolder):
    """A heartbeat *sets* the deadline instead of taking the max (etcd's lessor forbids it)."""

    def handle_notification(self, now: float, data: bytes) -> None:
        frame = parse(data)
        if isinstance(frame, LegacyHeartbeat):
            for rid in frame.request_ids:
                if rid in self._reqs_to_send:
                    self._reqs_to_send[rid] = now + self.config.extension
            return
        super().handle_notification(now, data)


class _ResurrectingHolder(VllmLeaseHolder):
    """A heartbeat for an unknown id re-creates its lease."""

    def handle_notification(self, now: float, data: bytes) -> None:
        frame = parse(data)
        if isinstance(frame, LegacyHeartbeat):
            for rid in frame.request_ids:
                self._reqs_to_send.setdefault(rid, now + self.config.extension)
        super().handle_notification(now, data)


class _DoubleFreeSide(VllmSide):
    """Reports every expiry twice."""

    def step(self, now: float) -> None:
        super().step(now)
        self.effects.freed.extend(list(self.effects.freed))


def _policy(holder: type[VllmLeaseHolder] | None = None, side: type[VllmSide] = VllmSide) -> Policy:
    config = VllmLeaseConfig()

    def make(transports: list[SimTransport], name: str, inc: int, seed: str) -> Side:
        s = side(transports, name, inc, config)
        if holder is not None:
            s.holders = [holder(config) for _ in transports]
        return s

    return dataclasses.replace(POLICIES["vllm-lease"], make=make)


def test_shortened_deadline_is_caught_with_a_trace_and_replays() -> None:
    bad = _policy(_ShorteningHolder)
    first = Simulator("decode-overload", bad, 3).run()
    kinds = {v.kind for v in first.violations}
    assert "S2 shortened" in kinds
    v = first.violations[0]
    assert v.trace and len(v.trace) <= 60
    again = Simulator("decode-overload", bad, 3).run()
    assert [(x.kind, x.time, x.detail) for x in again.violations] == [
        (x.kind, x.time, x.detail) for x in first.violations
    ]
    assert again.metrics == first.metrics


def test_resurrection_is_caught() -> None:
    r = Simulator("normal", _policy(_ResurrectingHolder), 0).run()
    assert "S3 resurrection" in {v.kind for v in r.violations}


def test_double_free_is_caught() -> None:
    r = Simulator("decode-overload", _policy(side=_DoubleFreeSide), 0).run()
    assert "S4 double free" in {v.kind for v in r.violations}


def test_correct_baseline_passes_the_same_oracles() -> None:
    r = Simulator("decode-overload", "vllm-lease", 3).run()
    assert r.violations == ()
