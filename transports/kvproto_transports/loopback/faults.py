"""Per-link fault settings, the seeded dice that apply them, and what becomes of a message.

A *link* is one direction between two endpoint names (``a -> b``). Faults are
keyed by the endpoints' base names, so they survive a restart (the new
incarnation sits on the same wire as the old one, as a rebooted host would).
Each link draws from its own RNG seeded by ``(network seed, a, b)``, so the
traffic on one link never changes the fate of a message on another: a
simulator that adds a peer does not reshuffle every other failure.

:class:`Links` is the one fault model of the simulated networks: the loopback
network carries transport messages over it, and the core tests' exact-time
harness (tests/core/net.py) carries the cores' frames over it.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator
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


Link = tuple[str, str]
"""``(src, dst)``: one direction between two endpoint (base) names."""


class Links:
    """Every link's faults and dice, and the order messages keep: a message's passage.

    A link not set has :attr:`default`'s faults. A message not reordered never
    arrives before an earlier one of the same order (:meth:`passage`): latency
    and jitter alone never let a later message overtake an earlier one.
    """

    __slots__ = ("_dice", "_faults", "_fifo", "default", "seed")

    def __init__(self, seed: int, default: LinkFaults = PERFECT) -> None:
        self.seed = seed
        """Seeds every link's dice (with the link's names)."""
        self.default = default
        """The faults of every link not :meth:`set`."""
        self._faults: dict[Link, LinkFaults] = {}
        self._dice: dict[Link, LinkDice] = {}
        self._fifo: dict[Hashable, float] = {}

    def set(self, link: Link, faults: LinkFaults) -> None:
        """Set the faults of ``link``."""
        self._faults[link] = faults

    def get(self, link: Link) -> LinkFaults:
        """The faults now in force on ``link``."""
        return self._faults.get(link, self.default)

    def items(self) -> Iterator[tuple[Link, LinkFaults]]:
        """The links set, with their faults."""
        return iter(self._faults.items())

    def passage(self, now: float, link: Link, order: Hashable) -> tuple[float, bool, int] | None:
        """A message put on ``link`` at ``now``: when it arrives, whether it was
        reordered and how many copies arrive; None if it is lost.

        ``order`` names the FIFO order the message keeps unless reordered (the
        loopback network: the two endpoint incarnations, so a restarted endpoint
        starts a new order).
        """
        faults = self._faults.get(link, self.default)
        if faults.is_lossless_fifo:  # fast path: nothing to roll
            when, reordered, copies = now + faults.delay, False, 1
        else:
            dice = self._dice.get(link)
            if dice is None:
                dice = self._dice[link] = LinkDice(self.seed, *link)
            fate = dice.roll(faults)
            if fate.dropped:
                return None
            when, reordered = now + fate.latency, fate.reordered
            copies = 2 if fate.duplicated else 1
        if not reordered:
            when = max(when, self._fifo.get(order, when))
            self._fifo[order] = when
        return when, reordered, copies
