"""NixlTransport endpoints hosted in a child process, for the NIXL tests.

The child loop and the parent handle are :mod:`kvproto_transports.testing`'s;
this module is the command set: :class:`Node` (endpoints, torch KV tensors,
heartbeats, loss detection, the side channel) and :class:`NodeProcess`, a
:class:`~kvproto_transports.testing.ChildProcess` that runs it (or a
subclass named by ``node_cls``) with torch preloaded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import PeerId, PeerLost, PeerUnreachable, TransportEvent
from kvproto_transports.nixl import NixlTransport
from kvproto_transports.tensor_layout import layout_from_tensors
from kvproto_transports.testing import DEFAULT_TICK_S, ChildProcess, NodeError, take_matching

NODE = "tests.transports.nixl.node:Node"
"""The plain command set, as ``node_cls``."""

__all__ = ["NODE", "Node", "NodeError", "NodeProcess"]


@dataclass(slots=True)
class _Heartbeat:
    key: str
    peer: PeerId
    payload: bytes
    interval_s: float
    next_at: float


class Node:
    """Lives in the child; one method per command."""

    tick_s = DEFAULT_TICK_S

    def __init__(self) -> None:
        self.transports: dict[str, NixlTransport] = {}
        self.tensors: dict[str, list[Any]] = {}
        self.events: dict[str, list[TransportEvent]] = {}
        self.heartbeats: list[_Heartbeat] = []
        self.server: Any = None
        self.server_ranks: dict[int, str] = {}
        self.lost_at: dict[tuple[str, PeerId], float] = {}
        """When each endpoint's poll first reported PeerLost for a peer (monotonic)."""
        self.bound: set[str] = set()
        """Endpoints polled by someone else (a lease binding), not by :meth:`pump`."""

    # -- endpoints ----------------------------------------------------------

    def create(self, key: str, **kwargs: Any) -> PeerId:
        t = NixlTransport(name_prefix=key, **kwargs)
        self.transports[key] = t
        self.events[key] = []
        return t.local_peer

    def make_kv(
        self,
        key: str,
        *,
        layers: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        fill: int | None,
        dtype: str = "float32",
    ) -> BlockLayout:
        """Split-K/V tensors ``[2, num_blocks, *block_shape]`` per layer, registered.

        ``fill=None`` zeroes them; an int fills them with distinct values
        offset by ``fill`` (so each holder rank's bytes differ).
        """
        import torch

        dt = getattr(torch, dtype)
        tensors = []
        per_layer = 2 * num_blocks
        for s in block_shape:
            per_layer *= s
        for layer in range(layers):
            if fill is None:
                t = torch.zeros((2, num_blocks, *block_shape), dtype=dt)
            else:
                base = fill * 10_000_000 + layer * per_layer
                t = (torch.arange(per_layer, dtype=torch.float64) + base).to(dt)
                t = t.reshape(2, num_blocks, *block_shape).contiguous()
            tensors.append(t)
        layout = layout_from_tensors(tensors, split_k_and_v=True)
        self.transports[key].register_blocks(layout)
        self.tensors[key] = tensors
        return layout

    def blocks_bytes(self, key: str, blocks: list[int]) -> list[bytes]:
        """The bytes of ``blocks`` in every region (layer K, layer V, ...), in region order."""
        out: list[bytes] = []
        for t in self.tensors[key]:
            for kv in range(2):
                out.extend(t[kv, b].numpy().tobytes() for b in blocks)
        return out

    def metadata(self, key: str) -> bytes:
        return self.transports[key].metadata()

    def add_peer(self, key: str, metadata: bytes) -> PeerId:
        return self.transports[key].add_peer(metadata)

    def remove_peer(self, key: str, peer: PeerId) -> None:
        self.transports[key].remove_peer(peer)

    def send(self, key: str, peer: PeerId, payload: bytes) -> None:
        self.transports[key].send(peer, payload)

    def read(self, key: str, peer: PeerId, **kwargs: Any) -> int:
        for name in ("local_slice", "remote_slice"):
            if isinstance(kwargs.get(name), tuple):
                index, parts = kwargs[name]
                kwargs[name] = BlockSlice(index=index, parts=parts)
        return self.transports[key].read_blocks(peer, **kwargs)

    def probe(self, key: str) -> int:
        return self.transports[key].probe_peers()

    def stats(self, key: str) -> Any:
        return self.transports[key].stats

    def close(self, key: str) -> None:
        self.transports.pop(key).close()

    # -- events ---------------------------------------------------------------

    def poll(self, key: str) -> list[TransportEvent]:
        self.pump()
        out = self.events[key]
        self.events[key] = []
        return out

    def wait_events(
        self, key: str, count: int, timeout_s: float = 10.0, kinds: tuple[str, ...] = ()
    ) -> list[TransportEvent]:
        """Poll until ``count`` events (of the named classes, if given) arrived."""
        deadline = time.monotonic() + timeout_s
        got: list[TransportEvent] = []
        while True:
            self.pump()
            more, self.events[key] = take_matching(
                self.events[key],
                count - len(got),
                lambda ev: not kinds or type(ev).__name__ in kinds,
            )
            got += more
            if len(got) >= count or time.monotonic() >= deadline:
                return got
            time.sleep(self.tick_s)

    def heartbeat(self, key: str, peer: PeerId, payload: bytes, interval_s: float) -> None:
        """Send ``payload`` to ``peer`` every ``interval_s`` between commands."""
        self.heartbeats.append(_Heartbeat(key, peer, payload, interval_s, time.monotonic()))

    def detect_losses(
        self, watch: list[tuple[str, PeerId, bool]], *, every_s: float, timeout_s: float = 5.0
    ) -> list[dict[str, float]]:
        """Tick every ``every_s`` until each watched (endpoint, peer) reported PeerLost.

        For a watch with ``send=True`` the endpoint also sends to the peer each
        tick (a binding's heartbeat or acknowledgement); with ``False`` it only
        polls (so only an auto-probe can find the loss). Returns, per watch,
        the monotonic time of the PeerLost, of the first failed send, and the
        number of sends that succeeded before.
        """
        start = time.monotonic()
        found: dict[int, dict[str, float]] = {}
        failed_at: dict[int, float] = {}
        sends: dict[int, int] = {}
        while len(found) < len(watch):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(
                    f"no PeerLost for {watch} within {timeout_s} s "
                    f"(found {sorted(found)}, sends {sends}, failed sends at {failed_at})"
                )
            for i, (key, peer, send) in enumerate(watch):
                if i in found or not send:
                    continue
                before = time.monotonic()
                try:
                    self.transports[key].send(peer, b"tick")
                    sends[i] = sends.get(i, 0) + 1
                except PeerUnreachable:
                    failed_at.setdefault(i, before)
            self.pump()  # the idle loop may have seen a loss before this command began
            for i, (key, peer, _) in enumerate(watch):
                at = self.lost_at.get((key, peer))
                if at is not None and i not in found:
                    found[i] = {
                        "lost_at": at,
                        "failed_send_at": failed_at.get(i, -1.0),
                        "sends": float(sends.get(i, 0)),
                    }
            time.sleep(every_s)
        return [found[i] for i in range(len(watch))]

    # -- side channel -----------------------------------------------------------

    def serve(self, compat_hash: bytes, ranks: dict[int, str], secret: bytes | None = None) -> int:
        from kvproto_binding.sidechannel import SideChannelServer

        if self.server is not None:
            self.server.close()
        self.server = SideChannelServer(
            host="127.0.0.1", base_port=0, compat_hash=compat_hash, secret=secret
        )
        self.server_ranks = dict(ranks)
        for rank, key in ranks.items():
            self.server.set_metadata(rank, self.transports[key].metadata())
        return int(self.server.port)

    def server_stats(self) -> Any:
        return self.server.stats()

    def accept_introductions(self) -> list[PeerId]:
        """Add every reader that introduced itself to the endpoint of the rank it asked for."""
        added = []
        for intro in self.server.poll_introductions():
            key = self.server_ranks[intro.rank]
            added.append(self.transports[key].add_peer(intro.metadata))
        return added

    def handshake(
        self, key: str, port: int, rank: int, compat_hash: bytes, rounds: int = 3
    ) -> dict[str, Any]:
        """Fetch a holder rank's metadata over the side channel and add it as a peer."""
        import zmq

        from kvproto_binding.sidechannel import fetch_metadata

        t = self.transports[key]
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            reply = fetch_metadata(
                ctx,
                "127.0.0.1",
                port,
                rank,
                requester=t.local_peer,
                compat_hash=compat_hash,
                requester_metadata=t.metadata(),
                rounds=rounds,
            )
        finally:
            ctx.term()
        peer = t.add_peer(reply.metadata)
        best = reply.best_sample()
        return {"peer": peer, "rtt": best.rtt, "offset": best.offset}

    # -- loop -------------------------------------------------------------------

    def pump(self) -> None:
        """Send due heartbeats and poll every endpoint not polled by a binding."""
        now = time.monotonic()
        for hb in self.heartbeats:
            if now >= hb.next_at:
                hb.next_at = now + hb.interval_s
                with contextlib.suppress(PeerUnreachable):  # PeerLost follows in poll
                    self.transports[hb.key].send(hb.peer, hb.payload)
        for key, t in self.transports.items():
            if key not in self.bound:
                self._take(key, t.poll())

    def _take(self, key: str, events: Sequence[TransportEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            if isinstance(ev, PeerLost):
                self.lost_at.setdefault((key, ev.peer), now)
        self.events[key].extend(events)

    def shutdown(self) -> None:
        """Close every endpoint and the side-channel server."""
        for t in self.transports.values():
            t.close()
        if self.server is not None:
            self.server.close()


class NodeProcess(ChildProcess):
    """A child running :class:`Node` (or ``node_cls``), torch preloaded."""

    def __init__(
        self, name: str = "node", *, preload: tuple[str, ...] = ("torch",), node_cls: str = NODE
    ) -> None:
        super().__init__(node_cls, name=name, preload=preload)

    def call(self, command: str, /, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        """Run a command; ``timeout_s`` bounds the wait (a command's own is another kwarg)."""
        return super().call(command, call_timeout_s=timeout_s, **kwargs)
