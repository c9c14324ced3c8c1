"""Per-link fault settings and the seeded dice that apply them.

A *link* is one direction between two endpoint names (``a -> b``). Faults are
keyed by the endpoints' base names, so they survive a restart (the new
incarnation sits on the same wire as the old one, as a rebooted host would).
Each link draws from its own RNG seeded by ``(network seed, a, b)``, so the
traffic on one link never changes the fate of a message on another: a
simulator that adds a peer does not reshuffle every other failure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFaults:
    """What one directed link does to the notifications that cross it.

    With every field at its default the link is perfect: FIFO, lossless,
    exactly-once, zero latency. ``reorder`` is the only source of reordering:
    latency and jitter alone never let a later message overtake an earlier one.
    """

    drop: float = 0.0
    """Probability that a notification is lost."""
    duplicate: float = 0.0
    """Probability that a delivered notification is delivered a second time."""
    reorder: float = 0.0
    """Probability that a message is held back ``reorder_window`` so later ones overtake it."""
    delay: float = 0.0
    """Base one-way latency in seconds (also paid by a read's data and its notify)."""
    jitter: float = 0.0
    """Extra latency drawn uniformly from ``[0, jitter)`` seconds per message."""
    reorder_window: float = 0.001
    """How long a reordered message is held back, in seconds."""

    @property
    def is_lossless_fifo(self) -> bool:
        """Nothing random: no loss, duplication, reordering or jitter (only fixed delay)."""
        return not (self.drop or self.duplicate or self.reorder or self.jitter)

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"LinkFaults.{name} must be a probability, got {p}")
        for name in ("delay", "jitter", "reorder_window"):
            v = getattr(self, name)
            if v < 0.0:
                raise ValueError(f"LinkFaults.{name} must be >= 0, got {v}")


PERFECT = LinkFaults()
"""A link that does nothing to its traffic."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fate:
    """What happens to one notification on its link, decided at send time."""

    dropped: bool
    """The message never arrives."""
    latency: float
    """Seconds from send to delivery of the first copy."""
    reordered: bool
    """The message was held back (it is not bound by the link's FIFO order)."""
    duplicated: bool
    """A second copy is delivered right after the first."""


class LinkDice:
    """A per-link RNG. Draws only for faults that are switched on, in a fixed order."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int, src: str, dst: str) -> None:
        # A str seed is hashed with SHA-512 by `random`: stable across runs and
        # independent of PYTHONHASHSEED.
        self._rng = random.Random(f"kvproto-loopback/{seed}/{src}->{dst}")

    def roll(self, faults: LinkFaults) -> Fate:
        """Decide the fate of one message under ``faults``."""
        rng = self._rng
        dropped = faults.drop > 0.0 and rng.random() < faults.drop
        latency = faults.delay
        if faults.jitter > 0.0:
            latency += rng.random() * faults.jitter
        reordered = faults.reorder > 0.0 and rng.random() < faults.reorder
        if reordered:
            latency += faults.reorder_window
        duplicated = faults.duplicate > 0.0 and rng.random() < faults.duplicate
        return Fate(dropped=dropped, latency=latency, reordered=reordered, duplicated=duplicated)
