"""A MooncakeTransport endpoint hosted in a child process, for the kill -9 tests.

The child loop and the parent handle are :mod:`kvproto_transports.testing`'s;
this module is the command set. Events are kept with the monotonic time they
were seen (``CLOCK_MONOTONIC`` is shared by the processes of one host, so the
parent can time a detection).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from kvproto.tpmath import BlockLayout
from kvproto.transport import PeerId, PeerLost, TransportEvent
from kvproto_transports.testing import ChildProcess, take_matching


def block_pattern(seed: int, region: int, block: int, length: int) -> bytes:
    """Deterministic, position-dependent bytes of one block."""
    start = (seed * 131 + region * 17 + block * 7) % 251
    return bytes((start + i * 13) % 256 for i in range(length))


class MooncakeChild:
    """Lives in the child; one method per command."""

    tick_s = 0.001

    def __init__(self) -> None:
        from kvproto_transports.mooncake import MooncakeTransport

        self._cls = MooncakeTransport
        self.t: Any = None
        self.buffers: list[Any] = []
        self.layout: BlockLayout | None = None
        self.events: list[tuple[float, TransportEvent]] = []

    def create(self, **kwargs: Any) -> PeerId:
        self.t = self._cls(**kwargs)
        return str(self.t.local_peer)

    def memory(
        self, *, num_regions: int, block_len: int, num_blocks: int, seed: int | None
    ) -> None:
        self.buffers = [
            ctypes.create_string_buffer(block_len * num_blocks) for _ in range(num_regions)
        ]
        if seed is not None:
            for region, buf in enumerate(self.buffers):
                data = b"".join(
                    block_pattern(seed, region, b, block_len) for b in range(num_blocks)
                )
                ctypes.memmove(buf, data, len(data))
        self.layout = BlockLayout(
            region_addrs=tuple(ctypes.addressof(b) for b in self.buffers),
            block_lens=(block_len,) * num_regions,
            num_blocks=num_blocks,
        )
        self.t.register_blocks(self.layout)

    def block(self, *, region: int, block: int) -> bytes:
        assert self.layout is not None
        n = self.layout.block_lens[region]
        return ctypes.string_at(self.layout.region_addrs[region] + block * n, n)

    def metadata(self) -> bytes:
        return bytes(self.t.metadata())

    def add_peer(self, *, metadata: bytes) -> PeerId:
        return str(self.t.add_peer(metadata))

    def send(self, *, peer: PeerId, payload: bytes) -> None:
        self.t.send(peer, payload)

    def read(
        self, *, peer: PeerId, local_blocks: list[int], remote_blocks: list[int], notify: bytes
    ) -> int:
        return int(
            self.t.read_blocks(
                peer, local_blocks=local_blocks, remote_blocks=remote_blocks, notify=notify
            )
        )

    def take_events(self) -> list[tuple[float, TransportEvent]]:
        self.pump()
        out, self.events = self.events, []
        return out

    def wait_events(
        self, *, count: int, kinds: tuple[str, ...] = (), timeout_s: float = 10.0
    ) -> list[tuple[float, TransportEvent]]:
        deadline = time.monotonic() + timeout_s
        got: list[tuple[float, TransportEvent]] = []
        while True:
            self.pump()
            more, self.events = take_matching(
                self.events,
                count - len(got),
                lambda item: not kinds or type(item[1]).__name__ in kinds,
            )
            got += more
            if len(got) >= count or time.monotonic() >= deadline:
                return got
            time.sleep(self.tick_s)

    def lost_at(self, *, peer: PeerId, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            for at, ev in self.events:
                if isinstance(ev, PeerLost) and ev.peer == peer:
                    return at
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.tick_s)

    def pump(self) -> None:
        if self.t is None:
            return
        try:
            events = self.t.poll()
        except Exception:  # closed: nothing more to see
            return
        now = time.monotonic()
        self.events += [(now, ev) for ev in events]

    def shutdown(self) -> None:
        if self.t is not None:
            self.t.close()


class MooncakeNode(ChildProcess):
    """Parent-side handle of a child process running one MooncakeTransport."""

    call_timeout_s = 30.0

    def __init__(self, name: str = "mooncake-node") -> None:
        super().__init__("tests.transports.mooncake.node:MooncakeChild", name=name)
