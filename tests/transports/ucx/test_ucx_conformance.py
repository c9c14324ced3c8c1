"""The conformance suite on real UCX endpoints (through the factory, one test per case)."""

from __future__ import annotations

import pytest

from kvproto_transports.conformance import pytest_cases
from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.ucx import ucx_available, unavailable_reason

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]


def _factory() -> TransportFactory:
    from kvproto_transports.ucx.kit import conformance_factory

    return conformance_factory()


test_ucx_conformance = pytest_cases(_factory, strict=True)
