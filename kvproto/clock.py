"""Clock-offset estimation between two monotonic clocks, with an error bound.

A sample is one round trip: the local clock read at send (``t0``), the peer's
clock read while it answered (``peer``), and the local clock at receipt
(``t1``). The peer read happened somewhere in ``[t0, t1]``, so::

    offset = peer - (t0 + t1) / 2        (peer clock minus local clock)
    |true offset - offset| <= (t1 - t0) / 2

The sample with the smallest round trip has the tightest bound (NTP's and
vLLM's choice); clocks also drift apart, so the bound grows by
``max_drift * (now - t0)`` since that sample was taken (the peer may have read
its clock as early as ``t0``), and a newer sample
with a slightly larger round trip can be better than an old one. The
estimator keeps the best *current* bound.

Conversions are conservative in the direction that protects the data: a
peer's deadline becomes the *earliest* local time it could mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproto.errors import LocalProtocolError


@dataclass(frozen=True, slots=True, kw_only=True)
class SkewSample:
    """One round-trip measurement."""

    sent: float
    """Local clock when the request left."""
    peer: float
    """Peer clock while it answered."""
    received: float
    """Local clock when the answer arrived."""

    @property
    def rtt(self) -> float:
        """Round-trip time."""
        return self.received - self.sent

    @property
    def offset(self) -> float:
        """Midpoint estimate of ``peer clock - local clock``."""
        return self.peer - (self.sent + self.received) / 2


class SkewEstimator:
    """Best offset estimate towards one peer clock, from round-trip samples."""

    def __init__(self, *, max_drift_ppm: float = 500.0) -> None:
        self._drift = max_drift_ppm * 1e-6
        self._best: SkewSample | None = None
        self.samples = 0
        """How many samples were offered."""

    def add(self, sample: SkewSample) -> None:
        """Offer a sample; kept if its bound beats the current one's as of now."""
        if sample.rtt < 0:
            raise LocalProtocolError("a round trip cannot end before it started")
        self.samples += 1
        best = self._best
        if best is None or self._bound(sample, sample.received) <= self._bound(
            best, sample.received
        ):
            self._best = sample

    def _bound(self, sample: SkewSample, now: float) -> float:
        # Drift counts from the send time: the peer read its clock somewhere in
        # [sent, received], possibly right at ``sent``.
        return sample.rtt / 2 + self._drift * max(0.0, now - sample.sent)

    @property
    def known(self) -> bool:
        """At least one sample was taken."""
        return self._best is not None

    def offset(self) -> float:
        """``peer clock - local clock``; raises if no sample was taken."""
        return self._sample().offset

    def error_bound(self, now: float) -> float:
        """Largest possible error of :meth:`offset` at local time ``now``."""
        return self._bound(self._sample(), now)

    def peer_deadline_to_local(self, deadline: float, now: float) -> float:
        """Earliest local time a peer-clock deadline can correspond to.

        Beyond the offset's error, the two clocks may drift apart for as long
        as the deadline is away, so that span's drift is subtracted too.
        """
        estimate = deadline - self.offset()
        ahead = max(0.0, estimate - now)
        return estimate - self.error_bound(now) - self._drift * ahead

    def _sample(self) -> SkewSample:
        if self._best is None:
            raise LocalProtocolError("no clock sample yet")
        return self._best
