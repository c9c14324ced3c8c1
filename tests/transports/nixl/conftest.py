"""Shared child processes for the NIXL tests (spawning one costs a torch import)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvproto_transports.nixl import nixl_available

AVAILABLE, WHY = nixl_available()


@pytest.fixture(scope="session")
def nodes() -> Iterator[tuple[object, object]]:
    """A holder node and a reader node, started together."""
    if not AVAILABLE:
        pytest.skip(f"NIXL: {WHY}")
    from kvproto_transports.nixl.node import NodeProcess

    holder, reader = NodeProcess("holder"), NodeProcess("reader")
    try:
        holder.wait_started()
        reader.wait_started()
        yield holder, reader
    finally:
        holder.close()
        reader.close()
