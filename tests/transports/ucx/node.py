"""UcxTransport endpoints hosted in child processes, for the UCX tests.

The child loop and the parent handle are :mod:`kvproto_transports.testing`'s;
this module is the command set (:class:`UcxChild`: one endpoint, numpy KV
memory, echo and scribble duties) and :class:`UcxNode`, the handle that runs
it. The child keeps each event with the monotonic time it was seen
(``CLOCK_MONOTONIC`` is shared by processes on one host, so a parent can time
a detection).
"""

from __future__ import annotations

import time
from typing import Any

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import PeerId, PeerLost, Received, TransportEvent
from kvproto_transports.testing import ChildProcess, NodeError, take_matching

__all__ = ["NodeError", "UcxChild", "UcxNode", "block_pattern"]


def block_pattern(seed: int, region: int, block: int, length: int) -> bytes:
    """Deterministic, position-dependent bytes of one block (every byte value occurs)."""
    start = (seed * 131 + region * 17 + block * 7) % 251
    return bytes((start + i * 13) % 256 for i in range(length))


class UcxChild:
    """Lives in the child; one method per command."""

    tick_s = 0.001

    def __init__(self) -> None:
        from kvproto_transports.ucx import UcxTransport

        self._cls = UcxTransport
        self.t: Any = None
        self.arrays: list[Any] = []
        self.layout: BlockLayout | None = None
        self.events: list[tuple[float, TransportEvent]] = []
        self.echo = False
        self.scribble: dict[bytes, list[int]] = {}
        self.server: Any = None

    # -- endpoint -------------------------------------------------------------

    def create(self, **kwargs: Any) -> PeerId:
        self.t = self._cls(**kwargs)
        return str(self.t.local_peer)

    def memory(
        self, *, num_regions: int, block_len: int, num_blocks: int, seed: int | None
    ) -> BlockLayout:
        """Numpy regions, filled with :func:`block_pattern` (or zeros), registered."""
        import numpy as np

        self.arrays = []
        for region in range(num_regions):
            arr = np.zeros(block_len * num_blocks, dtype=np.uint8)
            if seed is not None:
                for b in range(num_blocks):
                    arr[b * block_len : (b + 1) * block_len] = np.frombuffer(
                        block_pattern(seed, region, b, block_len), dtype=np.uint8
                    )
            self.arrays.append(arr)
        layout = BlockLayout(
            region_addrs=tuple(int(a.ctypes.data) for a in self.arrays),
            block_lens=(block_len,) * num_regions,
            num_blocks=num_blocks,
        )
        self.t.register_blocks(layout)
        self.layout = layout
        return layout

    def block(self, *, region: int, block: int) -> bytes:
        assert self.layout is not None
        n = self.layout.block_lens[region]
        return bytes(self.arrays[region][block * n : (block + 1) * n])

    def metadata(self) -> bytes:
        return bytes(self.t.metadata())

    def add_peer(self, *, metadata: bytes) -> PeerId:
        return str(self.t.add_peer(metadata))

    def remove_peer(self, *, peer: PeerId) -> None:
        self.t.remove_peer(peer)

    def send(self, *, peer: PeerId, payload: bytes) -> None:
        self.t.send(peer, payload)

    def send_many(self, *, peer: PeerId, payloads: list[bytes]) -> None:
        for p in payloads:
            self.t.send(peer, p)

    def read(
        self,
        *,
        peer: PeerId,
        local_blocks: list[int],
        remote_blocks: list[int],
        local_slice: tuple[int, int] = (0, 1),
        remote_slice: tuple[int, int] = (0, 1),
        notify: bytes | None = None,
    ) -> int:
        return int(
            self.t.read_blocks(
                peer,
                local_blocks=local_blocks,
                remote_blocks=remote_blocks,
                local_slice=BlockSlice(index=local_slice[0], parts=local_slice[1]),
                remote_slice=BlockSlice(index=remote_slice[0], parts=remote_slice[1]),
                notify=notify,
            )
        )

    def set_echo(self, *, on: bool) -> None:
        """Send every received notification straight back to its sender."""
        self.echo = on

    def set_scribble(self, *, notify: bytes, blocks: list[int]) -> None:
        """On receiving ``notify``, overwrite ``blocks`` of every region at once (free + reuse)."""
        self.scribble[notify] = blocks

    def stats(self) -> Any:
        return self.t.stats

    def capabilities(self) -> Any:
        return self.t.capabilities

    def close(self) -> None:
        self.t.close()

    # -- events -----------------------------------------------------------------

    def take_events(self) -> list[tuple[float, TransportEvent]]:
        self.pump()
        out, self.events = self.events, []
        return out

    def wait_events(
        self, *, count: int, kinds: tuple[str, ...] = (), timeout_s: float = 10.0
    ) -> list[tuple[float, TransportEvent]]:
        """Poll until ``count`` events (of the named classes, if given) arrived; the rest stay."""
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

    def pump(self) -> None:
        if self.t is None:
            return
        try:
            events = self.t.poll()
        except Exception:  # closed: nothing more to see
            return
        now = time.monotonic()
        for ev in events:
            if isinstance(ev, Received):
                if ev.payload in self.scribble and self.layout is not None:
                    for region, arr in enumerate(self.arrays):
                        n = self.layout.block_lens[region]
                        for b in self.scribble[ev.payload]:
                            arr[b * n : (b + 1) * n] = 0xEE
                if self.echo:
                    self.t.send(ev.peer, ev.payload)
            self.events.append((now, ev))

    def lost_at(self, *, peer: PeerId, timeout_s: float) -> float | None:
        """Monotonic time at which PeerLost(peer) was seen (waiting up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            for at, ev in self.events:
                if isinstance(ev, PeerLost) and ev.peer == peer:
                    return at
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.tick_s)

    # -- side channel ---------------------------------------------------------------

    def serve(self, *, compat_hash: bytes) -> int:
        """Publish this endpoint's metadata as rank 0 on a ZMQ side channel; returns the port."""
        from kvproto_binding.sidechannel import SideChannelServer

        self.server = SideChannelServer(host="127.0.0.1", base_port=0, compat_hash=compat_hash)
        self.server.set_metadata(0, self.t.metadata())
        return int(self.server.port)

    def accept_introductions(self, *, timeout_s: float = 5.0) -> list[PeerId]:
        """Add the readers that introduced themselves (waiting for at least one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            intros = self.server.poll_introductions()
            if intros or time.monotonic() >= deadline:
                return [str(self.t.add_peer(i.metadata)) for i in intros]
            time.sleep(self.tick_s)

    def handshake(self, *, port: int, compat_hash: bytes) -> PeerId:
        """Fetch rank 0's metadata over the side channel (introducing ourselves); add it."""
        import zmq

        from kvproto_binding.sidechannel import fetch_metadata

        ctx: Any = zmq.Context()
        try:
            reply = fetch_metadata(
                ctx,
                "127.0.0.1",
                port,
                0,
                requester=self.t.local_peer,
                compat_hash=compat_hash,
                requester_metadata=self.t.metadata(),
            )
        finally:
            ctx.term()
        return str(self.t.add_peer(reply.metadata))

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.t is not None:
            self.t.close()


class UcxNode(ChildProcess):
    """Parent-side handle of a child process running one UcxTransport (:class:`UcxChild`)."""

    call_timeout_s = 30.0

    def __init__(self, name: str = "ucx-node") -> None:
        super().__init__("tests.transports.ucx.node:UcxChild", name=name)
