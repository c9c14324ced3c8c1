"""Shared helpers for the Mooncake tests: skip without the engine, child-process pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.transports.mooncake.mooncake_required import require_mooncake


class Pair:
    """A holder and a reader, each a MooncakeTransport in its own child process."""

    def __init__(self) -> None:
        from tests.transports.mooncake.node import MooncakeNode

        self.holder = MooncakeNode("mooncake-holder")
        self.reader = MooncakeNode("mooncake-reader")
        try:
            self.holder.wait_started()
            self.reader.wait_started()
            self.holder_id = self.holder.call("create", name_prefix="holder")
            self.reader_id = self.reader.call("create", name_prefix="reader")
            self.holder.call("memory", num_regions=2, block_len=4096, num_blocks=80, seed=7)
            self.reader.call("memory", num_regions=2, block_len=4096, num_blocks=80, seed=None)
            assert (
                self.reader.call("add_peer", metadata=self.holder.call("metadata"))
                == self.holder_id
            )
            assert (
                self.holder.call("add_peer", metadata=self.reader.call("metadata"))
                == self.reader_id
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.holder.close()
        self.reader.close()


@pytest.fixture
def make_pair() -> Iterator[Callable[[], Pair]]:
    """Make fresh pairs (for tests that kill one side); all are closed afterwards."""
    made: list[Pair] = []

    def make() -> Pair:
        require_mooncake()
        made.append(Pair())
        return made[-1]

    yield make
    for p in made:
        p.close()
