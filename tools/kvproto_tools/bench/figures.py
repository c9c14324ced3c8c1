"""The unit of output: one measured figure beside its anchor, and the JSON report.

Every figure here is "lower is better" (time, bytes, growth exponent), so the
ratio is always ``anchor_value / value``: how many times cheaper kvproto is
than its anchor measured in the same process. A ratio below 1 means kvproto
costs more (transport overhead figures are expected to sit just below 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One measured number, with what it is compared against."""

    name: str
    """Dotted figure name, e.g. ``holder.idle_step``; stable across runs."""
    size: int | None
    """Live leases / waiting requests it was measured at; None where size does not apply."""
    value: float
    """kvproto's measurement (a median where it was timed)."""
    unit: str
    """``ns``, ``us``, ``ms``, ``B``, ``ticks`` or ``exponent``."""
    anchor: str | None = None
    """What the value is compared against, or None (e.g. ``vllm-lease full-scan reaper
    (vLLM 0.32.0)``)."""
    anchor_value: float | None = None
    """The anchor's measurement in the same run and unit, or None."""
    target: str | None = None
    """Human-readable target (table only; not part of the JSON shape)."""
    met: bool | None = None
    """Whether the target is met, where one applies (table only)."""
    comparable: bool = True
    """False where a ratio means nothing (growth exponents near zero)."""

    @property
    def ratio(self) -> float | None:
        """``anchor_value / value`` (> 1: kvproto cheaper), or None without a usable anchor."""
        if not self.comparable or self.anchor_value is None:
            return None
        if self.value <= 0 or self.anchor_value <= 0:
            return None
        return self.anchor_value / self.value

    def to_json(self) -> dict[str, Any]:
        """Exactly the documented keys, in the documented order."""
        ratio = self.ratio
        return {
            "name": self.name,
            "size": self.size,
            "value": _round(self.value),
            "unit": self.unit,
            "anchor": self.anchor,
            "anchor_value": None if self.anchor_value is None else _round(self.anchor_value),
            "ratio": None if ratio is None else _round(ratio),
        }


def _round(x: float) -> float:
    """Four significant digits: more would be noise on a shared machine."""
    return float(f"{x:.4g}")


def write_json(path: Path, machine: dict[str, Any], figures: list[Figure]) -> None:
    """Write ``{"machine": {...}, "figures": [...]}``."""
    doc = {"machine": machine, "figures": [f.to_json() for f in figures]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
