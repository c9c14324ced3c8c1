"""Fixtures of the network-fault tests: a link between two namespaces, lease nodes on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .netns import Link, remove_stale, unavailable_reason

REASON = unavailable_reason()


@pytest.fixture(scope="session", autouse=True)
def _no_stale_namespaces() -> None:
    """Delete namespaces a crashed earlier run left behind (they carry this module's prefix)."""
    if REASON is None:
        removed = remove_stale()
        if removed:
            print(f"\nremoved stale namespaces: {removed}")


@pytest.fixture
def link() -> Iterator[Link]:
    """A fresh two-host link, torn down after the test whatever happened."""
    if REASON is not None:
        pytest.skip(f"network namespaces: {REASON}")
    made = Link()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def delay_link() -> Iterator[Link]:
    """A two-host link through the delaying bridge."""
    if REASON is not None:
        pytest.skip(f"network namespaces: {REASON}")
    made = Link(delayer=True)
    try:
        yield made
    finally:
        made.close()
