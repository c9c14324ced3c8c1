"""The case registry: numbered cases, each with its requirement and level."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvproto_transports.conformance.model import Level

if TYPE_CHECKING:
    from kvproto_transports.conformance.harness import Ctx


GROUPS = {
    "T0": "Declarations",
    "T1": "Identity and lifecycle",
    "T2": "Notifications",
    "T3": "Reads",
    "T4": "Peer failure",
    "T5": "Resources",
    "T6": "Writes (push mode)",
}
"""Case id prefix -> the concern its cases check."""


UNITS = {
    "T2.3": "B",
    "T2.6": "inversions",
    "T2.7": "duplicates",
    "T2.8": "missing",
    "T2.9": "s",
    "T2.10": "s",
    "T2.11": "s",
    "T4.1": "s",
    "T4.2": "s",
    "T5.1": "B/cycle",
}
"""Case id -> the unit of the figure its Outcome.measured reports (the JSON keeps the bare
number). Kept beside the registry, not in each case: the report needs it, the cases do not;
tests/conformance/test_conformance_cli.py holds it to the cases that report a figure."""


class Unsupported(Exception):
    """Raised by a case when the transport declared it cannot do what the case needs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What a case function returns."""

    ok: bool
    """Whether the requirement held."""
    detail: str
    """What was observed."""
    measured: float | None = None
    """A figure for the report, or None."""
    informational: bool = False
    """The transport does not promise this property: report it as INFO whatever ``ok`` is."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One numbered conformance case."""

    id: str
    """``"T<group>.<n>"``."""
    title: str
    """One line."""
    level: Level
    """MUST, SHOULD or INFO."""
    requirement: str
    """The requirement, in full."""
    protects: str
    """What in the lease protocol breaks if the requirement does not hold."""
    run: Callable[[Ctx], Outcome]
    """The check itself."""

    @property
    def unit(self) -> str | None:
        """The unit of the figure this case measures (:data:`UNITS`), or None."""
        return UNITS.get(self.id)

    @property
    def group(self) -> str:
        """The concern, from the id prefix."""
        return GROUPS[self.id.split(".", 1)[0]]


CASES: list[Case] = []
"""Every case, in registration (= report) order."""


def case(
    case_id: str, title: str, level: Level, *, requirement: str, protects: str
) -> Callable[[Callable[[Ctx], Outcome]], Callable[[Ctx], Outcome]]:
    """Register the decorated function as case ``case_id``."""

    def register(fn: Callable[[Ctx], Outcome]) -> Callable[[Ctx], Outcome]:
        if any(c.id == case_id for c in CASES):
            raise ValueError(f"duplicate case id {case_id}")
        CASES.append(
            Case(
                id=case_id,
                title=title,
                level=level,
                requirement=requirement,
                protects=protects,
                run=fn,
            )
        )
        return fn

    return register


def all_cases() -> list[Case]:
    """Every registered case, with the case modules imported."""
    from kvproto_transports.conformance import (  # noqa: F401 - imported to register
        cases_failure,
        cases_identity,
        cases_notify,
        cases_reads,
        cases_resources,
        cases_writes,
    )

    return sorted(CASES, key=lambda c: tuple(int(x) for x in c.id[1:].split(".")))
