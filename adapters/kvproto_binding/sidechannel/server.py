"""The holder's handshake listener: a ZMQ ROUTER on ``host:base_port + dp_rank``.

It runs on a thread of its own and answers ``get_meta`` requests with the
compat hash, the transport metadata of the requested rank and its monotonic
clock. Unlike vLLM's listener (which an undecodable request or a bad rank
kills), every input is total here: malformed, oversize, unauthenticated or
unknown requests get an error reply or are dropped, and are counted; an
unexpected exception is counted and the loop goes on. Only :meth:`close` ends
the thread.

The server does not touch the transport: the owner publishes metadata with
:meth:`SideChannelServer.set_metadata` and collects the readers that
introduced themselves with :meth:`SideChannelServer.poll_introductions`, on
its own thread (NIXL calls stay on the transport's owner thread).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvproto.stats import counts_of

from . import wire
from .errors import MalformedHandshake

_POLL_MS = 50
_MAX_INTRODUCTIONS = 4096


@dataclass(slots=True)
class ServerStats:
    """Counters; :meth:`SideChannelServer.stats` returns a copy."""

    requests: int = 0
    """Messages received (valid or not)."""
    replies_ok: int = 0
    """Metadata served."""
    malformed: int = 0
    """Undecodable bodies or wrong frame shapes (answered with an error when possible)."""
    oversize: int = 0
    """Frames above :data:`~.wire.MAX_FRAME_BYTES`, dropped unanswered."""
    auth_failed: int = 0
    """Missing or wrong MAC (answered ``unauthenticated``)."""
    unknown_rank: int = 0
    """Ranks with no published metadata."""
    compat_mismatch: int = 0
    """Requesters that announced a different compat hash (refused)."""
    bad_version: int = 0
    """Unsupported protocol versions or kinds."""
    introductions_dropped: int = 0
    """Introductions lost because the owner did not collect them in time."""
    internal_errors: int = 0
    """Unexpected exceptions in the loop (the loop carried on)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Introduction:
    """A reader that sent its own transport metadata with a valid request."""

    requester: str
    """The requester's self-declared identity."""
    rank: int
    """The rank it asked for."""
    metadata: bytes
    """Its transport metadata (pass to the transport's ``add_peer``); may be empty when
    the request carried only a registration."""
    registration: bytes = b""
    """The request's ``registration`` (opaque to the side channel), or empty."""


class SideChannelServer:
    """ROUTER listener; binds in the constructor so a port clash raises at once."""

    def __init__(
        self,
        *,
        host: str,
        base_port: int,
        dp_rank: int = 0,
        compat_hash: bytes,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``base_port=0`` binds a free port (see :attr:`port`), for tests."""
        self._compat = compat_hash
        self._secret = secret
        self._clock = clock
        self._lock = threading.Lock()
        self._metadata: dict[int, bytes] = {}
        self._intros: collections.deque[Introduction] = collections.deque()
        self._stats = ServerStats()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A peer sending a bigger message is disconnected by libzmq itself.
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES * 4)
        # Replies to a vanished or slow requester are dropped, never block the loop.
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        try:
            if base_port == 0:
                self._port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._port = base_port + dp_rank
                self._sock.bind(f"tcp://{host}:{self._port}")
        except zmq.ZMQError:
            self._sock.close()
            self._ctx.term()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"kvproto-sidechannel-{self._port}", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._port

    def set_metadata(self, rank: int, metadata: bytes) -> None:
        """Publish (or replace) the transport metadata served for ``rank``."""
        with self._lock:
            self._metadata[rank] = bytes(metadata)

    def poll_introductions(self) -> list[Introduction]:
        """Readers that sent their metadata since the last call. Never blocks."""
        if not self._intros:
            # Most calls (every pump of a prefill worker): nothing queued, so no lock,
            # which costs 9-18 us cold inside an engine step. A deque's length reads
            # atomically; an introduction queued just after this check is the next
            # call's, as one queued just after the locked copy below would be (the
            # reader's Hello cannot overtake it: it is queued before the reply).
            return []
        with self._lock:
            out = list(self._intros)
            self._intros.clear()
        return out

    def stats(self) -> ServerStats:
        """A copy of the counters."""
        with self._lock:
            return ServerStats(**counts_of(self._stats))  # read every engine step: no fields()

    def alive(self) -> bool:
        """The listener thread is running."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and release the socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._ctx.term()

    # --- the listener thread ---------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                try:
                    if not sock.poll(_POLL_MS):
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    self._count("requests")
                    self._handle(frames)
                except zmq.Again:
                    continue
                except Exception:  # the listener must outlive any input; count, go on
                    self._count("internal_errors")
                    # A broken socket would spin: breathe before the next try.
                    self._stop.wait(0.01)
        finally:
            sock.close(linger=0)

    def _handle(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        if rest and rest[0] == b"":
            rest = rest[1:]  # the REQ/DEALER envelope delimiter
        if not rest or len(rest) > 2:
            self._count("malformed")
            self._reply_error(identity, wire.ERR_MALFORMED, 0, b"")
            return
        body = rest[0]
        if len(body) > wire.MAX_FRAME_BYTES:
            self._count("oversize")
            return
        mac = rest[1] if len(rest) == 2 else None
        if self._secret is not None and not wire.mac_ok(wire.request_mac(self._secret, body), mac):
            self._count("auth_failed")
            self._reply_error(identity, wire.ERR_UNAUTHENTICATED, 0, b"")
            return
        try:
            req = wire.decode_request(body)
        except MalformedHandshake as exc:
            self._count("malformed")
            self._reply_error(identity, wire.ERR_MALFORMED, 0, b"", str(exc)[:200])
            return
        if req.version != wire.PROTOCOL_VERSION or req.kind != wire.KIND_GET_META:
            self._count("bad_version")
            code = wire.ERR_VERSION if req.version != wire.PROTOCOL_VERSION else wire.ERR_KIND
            self._reply_error(identity, code, req.rank, req.nonce)
            return
        if req.compat_hash and req.compat_hash != self._compat:
            self._count("compat_mismatch")
            self._reply_error(identity, wire.ERR_COMPAT, req.rank, req.nonce)
            return
        with self._lock:
            metadata = self._metadata.get(req.rank)
            if metadata is not None:
                self._stats.replies_ok += 1
                if req.requester_metadata or req.registration:
                    if len(self._intros) >= _MAX_INTRODUCTIONS:
                        self._intros.popleft()
                        self._stats.introductions_dropped += 1
                    self._intros.append(
                        Introduction(
                            requester=req.requester,
                            rank=req.rank,
                            metadata=req.requester_metadata,
                            registration=req.registration,
                        )
                    )
        if metadata is None:
            self._count("unknown_rank")
            self._reply_error(identity, wire.ERR_UNKNOWN_RANK, req.rank, req.nonce)
            return
        self._send(
            identity,
            wire.HandshakeReply(
                nonce=req.nonce,
                ok=True,
                rank=req.rank,
                compat_hash=self._compat,
                metadata=metadata,
                server_time=self._clock(),
            ),
        )

    def _reply_error(
        self, identity: bytes, code: str, rank: int, nonce: bytes, detail: str = ""
    ) -> None:
        self._send(
            identity,
            wire.HandshakeReply(
                nonce=nonce,
                ok=False,
                rank=rank,
                # An error reply reveals the compat hash only to authenticated peers.
                compat_hash=b"" if code == wire.ERR_UNAUTHENTICATED else self._compat,
                metadata=b"",
                server_time=self._clock(),
                error=code,
                detail=detail,
            ),
        )

    def _send(self, identity: bytes, reply: wire.HandshakeReply) -> None:
        body = wire.encode(reply)
        frames = [identity, b"", body]
        if self._secret is not None:
            frames.append(wire.reply_mac(self._secret, body))
        with contextlib.suppress(zmq.Again):  # the requester stopped reading: its problem
            self._sock.send_multipart(frames, zmq.NOBLOCK)
