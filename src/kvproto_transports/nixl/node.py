"""NixlTransport endpoints hosted in a child process, driven over a pipe.

Peer-failure behaviour can only be tested across processes (``kill -9`` of a
peer), and NIXL calls must stay on one thread, so each child runs a single
loop: it executes one command at a time from the parent and, between
commands, the background duties it was given (heartbeats, probes). Used by
the NIXL tests, the overhead benchmark and available to the conformance kit.

Commands are ``(name, kwargs)`` tuples answered with ``(True, value)`` or
``(False, exception)``; :class:`NodeProcess` turns them into method calls.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import PeerId, PeerLost, PeerUnreachable, TransportEvent

from .transport import NixlTransport

_TICK_S = 0.002


class NodeError(Exception):
    """A command failed in the child; ``kind`` names the child's exception type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        """Class name of the exception raised in the child."""


@dataclass(slots=True)
class _Heartbeat:
    key: str
    peer: PeerId
    payload: bytes
    interval_s: float
    next_at: float


class Node:
    """Lives in the child; one method per command."""

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
        """Endpoints polled by someone else (a lease binding), not by :meth:`_pump`."""

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

        from ..tensor_layout import layout_from_tensors

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
        self._pump()
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
            self._pump()
            keep: list[TransportEvent] = []
            for ev in self.events[key]:
                if len(got) < count and (not kinds or type(ev).__name__ in kinds):
                    got.append(ev)
                else:
                    keep.append(ev)
            self.events[key] = keep
            if len(got) >= count or time.monotonic() >= deadline:
                return got
            time.sleep(_TICK_S)

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
            self._pump()  # the idle loop may have seen a loss before this command began
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

    def _pump(self) -> None:
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


def serve(conn: Connection, preload: tuple[str, ...] = (), node_cls: str = "") -> None:
    """Child main loop: commands from ``conn``, background duties in between.

    ``preload`` names modules to import before reporting ready (torch takes
    seconds; children started together then import it in parallel).
    ``node_cls`` (``module:Class``) replaces the command set with a subclass.
    """
    for module in preload:
        importlib.import_module(module)
    node = Node()
    if node_cls:
        module, _, cls = node_cls.partition(":")
        node = getattr(importlib.import_module(module), cls)()
    conn.send((True, os.getpid()))
    while True:
        if not conn.poll(_TICK_S):
            # Tick like a binding would: without NIXL's progress thread a holder
            # serves READs and receives notifications only while it polls.
            node._pump()
            continue
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        if name == "exit":
            for t in node.transports.values():
                t.close()
            if node.server is not None:
                node.server.close()
            conn.send((True, None))
            return
        try:
            fn: Callable[..., Any] = getattr(node, name)
            conn.send((True, fn(**kwargs)))
        except Exception as exc:
            conn.send((False, (type(exc).__name__, str(exc))))


class NodeProcess:
    """Parent-side handle of a child process running :func:`serve`."""

    def __init__(
        self, name: str = "node", *, preload: tuple[str, ...] = ("torch",), node_cls: str = ""
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, preload, node_cls), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self._pending = False
        self._started = False

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """Block until the child is ready; returns its pid."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError("child process did not start")
        _ok, pid = self._conn.recv()
        self._started = True
        return int(pid)

    def call(self, name: str, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        """Run a command and return its value (raises :class:`NodeError`)."""
        self.submit(name, **kwargs)
        return self.result(timeout_s)

    def submit(self, name: str, **kwargs: Any) -> None:
        """Start a command without waiting (then call :meth:`result`)."""
        if not self._started:
            self.wait_started()
        assert not self._pending, "one command at a time"
        self._conn.send((name, kwargs))
        self._pending = True

    def ready(self) -> bool:
        """The command started by :meth:`submit` has answered."""
        return self._conn.poll(0)

    def result(self, timeout_s: float = 60.0) -> Any:
        """The value of the command started by :meth:`submit`."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError("child did not answer")
        ok, value = self._conn.recv()
        self._pending = False
        if not ok:
            raise NodeError(*value)
        return value

    def kill(self) -> None:
        """``kill -9`` the child."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        """Ask the child to close its endpoints and exit; kill it if it does not."""
        if self.process.is_alive():
            try:
                if self._pending:
                    self.result(10)
                self._conn.send(("exit", {}))
                if self._conn.poll(10):
                    self._conn.recv()
            except (OSError, EOFError, TimeoutError, NodeError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()
