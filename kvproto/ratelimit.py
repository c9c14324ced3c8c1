"""Small bounded-state helpers for untrusted input: a token bucket and a replay window."""

from __future__ import annotations


class TokenBucket:
    """Classic token bucket driven by the caller's ``now``."""

    __slots__ = ("_burst", "_last", "_rate", "_tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._last = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one."""
        if now > self._last:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class ReplayWindow:
    """Accept each sequence number at most once, tolerating reordering within 64.

    The IPsec anti-replay window: the highest number seen plus a bitmap of the
    64 below it. Older numbers are refused (their changes are repeated in
    later frames anyway, so nothing is lost). Once a number was accepted, one
    more than ``AHEAD`` above it is refused as implausible: a single frame
    could otherwise move the window so far that every later genuine frame
    looks like a replay. (The first number is free: a reader's count runs on
    across holder restarts.)
    """

    __slots__ = ("_bits", "_top")

    WIDTH = 64
    AHEAD = 2**20
    """Largest forward jump accepted: far above the frames of one split tick
    (``max_leases_per_session`` claims fit in a few thousand frames)."""

    def plausible(self, seq: int) -> bool:
        """False if ``seq`` jumps more than ``AHEAD`` past the highest accepted."""
        return self._top < 0 or seq - self._top <= self.AHEAD

    def __init__(self) -> None:
        self._top = -1
        self._bits = 0

    def accept(self, seq: int) -> bool:
        """True the first time ``seq`` is seen inside the window."""
        if seq > self._top:
            shift = seq - self._top
            self._bits = (
                ((self._bits << shift) | 1) & ((1 << self.WIDTH) - 1) if shift < self.WIDTH else 1
            )
            self._top = seq
            return True
        back = self._top - seq
        if back >= self.WIDTH or self._bits >> back & 1:
            return False
        self._bits |= 1 << back
        return True
