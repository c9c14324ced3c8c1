"""Shared helpers for the UCX tests: skip without ucxx, and child-process pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvproto_transports.ucx import ucx_available, unavailable_reason


class Pair:
    """A holder and a reader, each a UcxTransport in its own child process."""

    def __init__(self, *, link: bool = True, memory: bool = True, **kwargs: object) -> None:
        from tests.transports.ucx.node import UcxNode

        self.holder = UcxNode("ucx-holder")
        self.reader = UcxNode("ucx-reader")
        try:
            self.holder.wait_started()
            self.reader.wait_started()
            self.holder_id = self.holder.call("create", name_prefix="holder", **kwargs)
            self.reader_id = self.reader.call("create", name_prefix="reader", **kwargs)
            if memory:
                self.holder.call("memory", num_regions=2, block_len=4096, num_blocks=80, seed=7)
                self.reader.call("memory", num_regions=2, block_len=4096, num_blocks=80, seed=None)
            if link:
                self.link()
        except BaseException:
            self.close()
            raise

    def link(self) -> None:
        """Each adds the other (as the side channel's introduction makes possible)."""
        assert self.reader.call("add_peer", metadata=self.holder.call("metadata")) == self.holder_id
        assert self.holder.call("add_peer", metadata=self.reader.call("metadata")) == self.reader_id

    def close(self) -> None:
        self.holder.close()
        self.reader.close()


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    """Make fresh pairs (for tests that kill one side); all are closed afterwards."""
    made: list[Pair] = []

    def make(**kwargs: object) -> Pair:
        if not ucx_available():
            pytest.skip(f"UCX: {unavailable_reason()}")
        made.append(Pair(**kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """One linked holder/reader pair shared by a module's tests (spawning costs ~1 s)."""
    if not ucx_available():
        pytest.skip(f"UCX: {unavailable_reason()}")
    p = Pair()
    try:
        yield p
    finally:
        p.close()
