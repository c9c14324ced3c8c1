"""The conformance suite on real Mooncake endpoints (through the factory, one test per case)."""

from __future__ import annotations

import pytest

from kvproto_transports.conformance import pytest_cases
from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.mooncake import mooncake_available, unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not mooncake_available(), reason=f"Mooncake: {unavailable_reason()}"),
]


def _factory() -> TransportFactory:
    from kvproto_transports.mooncake.kit import conformance_factory

    return conformance_factory()


test_mooncake_conformance = pytest_cases(_factory, strict=True)
