"""A per-holder circuit breaker with exponential cool-down (pure: time comes in as ``now``).

Closed: handshakes go through. After ``threshold`` consecutive failed
handshakes it opens for ``cooldown_s``; then one trial is let through
(half-open). A success closes it; a failure re-opens it for twice as long, up
to ``max_cooldown_s``. This is what keeps a dead holder from costing every
tick another timeout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CircuitBreaker:
    """State of one holder endpoint's breaker."""

    threshold: int = 3
    """Consecutive failures that open the breaker."""
    cooldown_s: float = 2.0
    """First open period."""
    max_cooldown_s: float = 60.0
    """Cap of the doubling open period."""
    failures: int = 0
    """Consecutive failures so far."""
    open_until: float | None = None
    """While set and in the future, handshakes are refused."""
    current_cooldown_s: float = 0.0
    """The open period now in force (0 while closed)."""
    trial_in_flight: bool = False
    """A half-open trial was let through and has not reported."""

    def allow(self, now: float) -> float | None:
        """None if a handshake may start now (and reserves the half-open trial), else the wait."""
        if self.open_until is None:
            return None
        if now < self.open_until:
            return self.open_until - now
        if self.trial_in_flight:
            return self.current_cooldown_s
        self.trial_in_flight = True
        return None

    def success(self) -> None:
        """A handshake succeeded: close."""
        self.failures = 0
        self.open_until = None
        self.current_cooldown_s = 0.0
        self.trial_in_flight = False

    def failure(self, now: float) -> None:
        """A handshake failed (after its own retries)."""
        self.failures += 1
        was_trial = self.trial_in_flight
        self.trial_in_flight = False
        if was_trial:
            self.current_cooldown_s = min(self.current_cooldown_s * 2, self.max_cooldown_s)
            self.open_until = now + self.current_cooldown_s
        elif self.failures >= self.threshold:
            self.current_cooldown_s = self.cooldown_s
            self.open_until = now + self.cooldown_s
