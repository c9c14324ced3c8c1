"""Shared child processes for the NIXL tests (spawning one costs a torch import)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvproto_transports.nixl import nixl_available

AVAILABLE, WHY = nixl_available()
LEASE_NODE = "tests.transports.nixl.lease_node:LeaseNode"
"""Node class of the child processes: NixlTransport commands plus the lease binding."""


@pytest.fixture(scope="session")
def nodes() -> Iterator[tuple[object, object]]:
    """A holder node and a reader node, started together."""
    if not AVAILABLE:
        pytest.skip(f"NIXL: {WHY}")
    from tests.transports.nixl.node import NodeProcess

    holder, reader = (
        NodeProcess("holder", node_cls=LEASE_NODE),
        NodeProcess("reader", node_cls=LEASE_NODE),
    )
    try:
        holder.wait_started()
        reader.wait_started()
        yield holder, reader
    finally:
        holder.close()
        reader.close()
