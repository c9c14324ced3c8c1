"""Levels, verdicts, per-case results and the report (Autobahn / h2spec vocabulary)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Level(str, enum.Enum):
    """How binding a requirement is."""

    MUST = "MUST"
    """Failing it makes the transport unfit for the lease protocol."""
    SHOULD = "SHOULD"
    """Failing it degrades liveness or diagnosis; FAIL only with ``--strict``."""
    INFO = "INFO"
    """Measured and reported, never judged."""


class Verdict(str, enum.Enum):
    """The outcome of one case."""

    PASS = "PASS"
    """The requirement holds."""
    NON_STRICT = "NON-STRICT"
    """A SHOULD requirement does not hold (without ``--strict``)."""
    FAIL = "FAIL"
    """A MUST (or, with ``--strict``, a SHOULD) requirement does not hold, or the case crashed."""
    INFO = "INFO"
    """Reported only: an INFO case, or a property the transport does not promise."""
    UNSUPPORTED = "UNSUPPORTED"
    """The transport (or its factory) declared it cannot do what the case needs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseResult:
    """What one case found."""

    id: str
    """Case number, e.g. ``"T2.3"``."""
    title: str
    """One line naming the requirement."""
    group: str
    """The concern the case belongs to."""
    level: Level
    """MUST, SHOULD or INFO."""
    verdict: Verdict
    """The judgement, after ``--strict`` is applied."""
    detail: str
    """What was observed, in words."""
    measured: float | None
    """A figure the case measured (seconds, bytes, counts), or None."""
    duration_s: float
    """Wall seconds the case took."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Every case's result for one transport."""

    transport: str
    """The transport's name."""
    strict: bool
    """Whether SHOULD failures were judged FAIL."""
    cases: tuple[CaseResult, ...]
    """Results in case order."""

    @property
    def summary(self) -> dict[str, int]:
        """Verdict -> count, every verdict present."""
        counts = {v.value: 0 for v in Verdict}
        for c in self.cases:
            counts[c.verdict.value] += 1
        return counts

    @property
    def failed(self) -> bool:
        """Whether any case is FAIL (the CLI then exits non-zero)."""
        return any(c.verdict is Verdict.FAIL for c in self.cases)

    def case(self, case_id: str) -> CaseResult:
        """The result of one case by id."""
        for c in self.cases:
            if c.id == case_id:
                return c
        raise KeyError(case_id)

    def by_verdict(self, verdict: Verdict) -> list[str]:
        """Ids of the cases with ``verdict``."""
        return [c.id for c in self.cases if c.verdict is verdict]

    def to_json(self) -> dict[str, Any]:
        """The report in the documented JSON shape (and nothing else)."""
        return {
            "transport": self.transport,
            "cases": [
                {
                    "id": c.id,
                    "title": c.title,
                    "level": c.level.value,
                    "verdict": c.verdict.value,
                    "detail": c.detail,
                    "measured": c.measured,
                }
                for c in self.cases
            ],
            "summary": self.summary,
        }
