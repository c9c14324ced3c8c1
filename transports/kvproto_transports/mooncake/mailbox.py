"""Notifications over ZMQ: one PULL socket per endpoint, one PUSH socket per peer.

Mooncake's Python API has no standalone notification: ``TransferNotify`` rides
on a transfer (``transfer_sync``/``batch_transfer_sync``, both blocking) and is
sent over the engine's handshake socket as JSON, one TCP connection per
message (measured ~0.3 ms a hop here, ~0.61 ms a round trip; a payload over
~1 MiB of JSON is dropped with ``transfer_sync`` still returning 0). ZMQ
PUSH/PULL over TCP is the cheapest path this process has (~0.09 ms a round
trip): byte-exact, in order per pair (one connection per PUSH socket), and it
refuses rather than blocks when the peer stops draining (``SNDHWM``).

Not thread-safe (ZMQ sockets are not): the transport calls it under its lock.
"""

from __future__ import annotations

import zmq

from .wire import decode_frame

DRAIN_LIMIT = 4096
"""Most messages one :meth:`Mailbox.drain` takes, so that one poll stays short."""


class Mailbox:
    """This endpoint's notification socket and its PUSH sockets to peers."""

    def __init__(self, *, host: str, local_peer: str, max_pending: int) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._me = local_peer.encode()
        self._max_pending = max_pending
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, max_pending)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        """Where peers connect (``tcp://host:port``)."""
        self._push: dict[str, tuple[zmq.Socket[bytes], bytes]] = {}
        self.dropped = 0
        """Messages received that were not for this endpoint or were malformed."""

    def connect(self, peer: str, address: str) -> None:
        """Open (or reopen) the PUSH socket to ``peer``; messages queue until it connects."""
        self.disconnect(peer)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._max_pending)
        sock.connect(address)
        self._push[peer] = (sock, peer.encode())

    def disconnect(self, peer: str) -> None:
        """Close the PUSH socket to ``peer`` (queued messages are dropped); idempotent."""
        entry = self._push.pop(peer, None)
        if entry is not None:
            entry[0].close(linger=0)

    def send(self, peer: str, payload: bytes) -> bool:
        """Queue one message to a connected peer; False when its queue is full."""
        sock, target = self._push[peer]
        try:
            sock.send_multipart((target, self._me, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def drain(self) -> list[tuple[str, bytes]]:
        """``(sender, payload)`` of the messages waiting, at most :data:`DRAIN_LIMIT`."""
        out: list[tuple[str, bytes]] = []
        for _ in range(DRAIN_LIMIT):
            try:
                parts = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            frame = decode_frame(parts, self._me)
            if frame is None:
                self.dropped += 1
            else:
                out.append(frame)
        return out

    def close(self) -> None:
        """Close every socket and the context, dropping what is queued."""
        for peer in list(self._push):
            self.disconnect(peer)
        self._pull.close(linger=0)
        self._ctx.term()
