"""The conformance suite on real NIXL agents (through the factory, one test per case)."""

from __future__ import annotations

import pytest

from kvproto_transports.conformance import pytest_cases
from kvproto_transports.nixl import nixl_available

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]


def _factory():  # type: ignore[no-untyped-def]
    # Imported lazily: collection must work where NIXL is absent.
    from kvproto_transports.nixl.kit import conformance_factory

    return conformance_factory()


test_nixl_conformance = pytest_cases(_factory)
