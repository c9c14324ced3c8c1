"""Run the suite under pytest: one test per case.

In a transport's test suite::

    from kvproto_transports.conformance import pytest_cases

    test_my_transport_conformance = pytest_cases("mytransport")   # or a TransportFactory

FAIL fails the test, UNSUPPORTED skips it, NON-STRICT warns, PASS and INFO pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from kvproto_transports.conformance.model import Verdict
from kvproto_transports.conformance.registry import all_cases
from kvproto_transports.conformance.runner import FactoryLike, resolve, run_case, select


class ConformanceWarning(UserWarning):
    """A SHOULD requirement does not hold (NON-STRICT)."""


def pytest_cases(
    factory: FactoryLike, *, strict: bool = False, only: Iterable[str] | None = None
) -> Callable[..., None]:
    """A test function parametrised with one id per case; assign it to a ``test_*`` name."""
    import pytest

    cases = {c.id: c for c in select(all_cases(), only)}
    resolved: dict[str, Any] = {}

    @pytest.mark.parametrize("case_id", list(cases))
    def test_conformance(case_id: str) -> None:
        if "f" not in resolved:  # resolved lazily: collection must not import the transport
            resolved["f"] = resolve(factory)
        result = run_case(cases[case_id], resolved["f"], strict=strict)
        text = f"{result.id} {result.title}: {result.detail}"
        if result.verdict is Verdict.UNSUPPORTED:
            pytest.skip(text)
        if result.verdict is Verdict.FAIL:
            pytest.fail(text, pytrace=False)
        if result.verdict is Verdict.NON_STRICT:
            warnings.warn(text, ConformanceWarning, stacklevel=1)

    return test_conformance
