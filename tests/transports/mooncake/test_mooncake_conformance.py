"""The conformance suite on real Mooncake endpoints (through the factory, one test per case)."""

from __future__ import annotations

import pytest

from kvproto_transports.conformance import pytest_cases
from kvproto_transports.conformance.factory import TransportFactory
from tests.transports.mooncake.mooncake_required import needs_mooncake

pytestmark = [
    pytest.mark.slow,
    needs_mooncake,
]


def _factory() -> TransportFactory:
    from kvproto_transports.mooncake.kit import conformance_factory

    return conformance_factory()


test_mooncake_conformance = pytest_cases(_factory, strict=True)
