"""The reader's side of the handshake: one synchronous exchange, and a non-blocking client.

:func:`fetch_metadata` performs ``rounds`` request/reply round trips with one
holder over a DEALER socket (REQ-compatible envelope) and returns the
metadata plus one clock sample per round trip, for min-RTT skew estimation.

:class:`HandshakeClient` runs each pending handshake on a thread of its own,
retries it with exponential backoff and jitter, and keeps a circuit breaker
per holder endpoint, so a dead holder costs its own thread and never delays a
handshake with a live one. ``submit`` returns at once; results are collected
with ``poll_results``. Nothing here touches a transport: the caller passes the
returned metadata to its transport's ``add_peer`` on the transport's thread.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import zmq

from . import wire
from .breaker import CircuitBreaker
from .errors import (
    AuthenticationFailed,
    BadReply,
    CircuitOpen,
    ClientClosed,
    CompatMismatch,
    HandshakeTimeout,
    MalformedHandshake,
    ServerRefused,
    SideChannelError,
)

_SLICE_S = 0.05  # how often a waiting handshake looks at the stop flag


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockSample:
    """One round trip: our monotonic clock around the holder's."""

    send_time: float
    """Our clock when the request left."""
    peer_monotonic_time: float
    """The holder's monotonic clock while it answered."""
    recv_time: float
    """Our clock when the reply arrived."""

    @property
    def rtt(self) -> float:
        """Round-trip time."""
        return self.recv_time - self.send_time

    @property
    def offset(self) -> float:
        """Midpoint estimate of holder clock minus our clock (error at most rtt/2)."""
        return self.peer_monotonic_time - (self.send_time + self.recv_time) / 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataReply:
    """A successful exchange with one holder."""

    rank: int
    """The holder rank answered for."""
    metadata: bytes
    """That rank's transport metadata."""
    compat_hash: bytes
    """The holder's compat hash (equal to ours)."""
    samples: tuple[ClockSample, ...]
    """One per round trip, in order."""

    def best_sample(self) -> ClockSample:
        """The sample with the smallest round trip (tightest offset bound)."""
        return min(self.samples, key=lambda s: s.rtt)


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeSucceeded:
    """``poll_results``: a handshake submitted under ``peer_key`` succeeded."""

    peer_key: Hashable
    """What the caller submitted it under."""
    host: str
    """Holder host."""
    port: int
    """Holder port."""
    reply: MetadataReply
    """Metadata and clock samples."""
    attempts: int
    """Attempts it took (1 = no retry)."""
    duration_s: float
    """From submit to result."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeFailed:
    """``poll_results``: a handshake submitted under ``peer_key`` failed."""

    peer_key: Hashable
    """What the caller submitted it under."""
    host: str
    """Holder host."""
    port: int
    """Holder port."""
    rank: int
    """The rank asked for."""
    error: SideChannelError
    """Why (typed: timeout, compat mismatch, refused, circuit open...)."""
    attempts: int
    """Attempts made (0 when the breaker refused it)."""
    duration_s: float
    """From submit to result."""

    @property
    def reason(self) -> str:
        """The error as text, for logs."""
        return f"{type(self.error).__name__}: {self.error}"


HandshakeResult = HandshakeSucceeded | HandshakeFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    peer_key: Hashable
    host: str
    port: int
    rank: int
    start: float
    intro: bytes
    registration: bytes


def fetch_metadata(
    ctx: zmq.Context[zmq.Socket[bytes]],
    host: str,
    port: int,
    rank: int,
    *,
    requester: str,
    compat_hash: bytes,
    secret: bytes | None = None,
    requester_metadata: bytes = b"",
    registration: bytes = b"",
    rounds: int = 3,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    stop: threading.Event | None = None,
) -> MetadataReply:
    """``rounds`` round trips with one holder; raises a :class:`SideChannelError`.

    Only the first request carries ``requester_metadata`` (the introduction) and
    ``registration``; the later ones exist for clock samples.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES * 64)
    try:
        sock.connect(f"tcp://{host}:{port}")
        samples: list[ClockSample] = []
        reply: wire.HandshakeReply | None = None
        for i in range(max(1, rounds)):
            request = wire.HandshakeRequest(
                version=wire.PROTOCOL_VERSION,
                kind=wire.KIND_GET_META,
                rank=rank,
                requester=requester,
                nonce=os.urandom(16),
                compat_hash=compat_hash,
                requester_metadata=requester_metadata if i == 0 else b"",
                registration=registration if i == 0 else b"",
            )
            body = wire.encode(request)
            frames = [b"", body]
            if secret is not None:
                frames.append(wire.request_mac(secret, body))
            sent = clock()
            sock.send_multipart(frames)
            reply = _await_reply(
                sock,
                request.nonce,
                secret=secret,
                deadline=sent + timeout_s,
                clock=clock,
                stop=stop,
            )
            received = clock()
            _check_reply(reply, compat_hash)
            samples.append(
                ClockSample(
                    send_time=sent, peer_monotonic_time=reply.server_time, recv_time=received
                )
            )
        assert reply is not None
        return MetadataReply(
            rank=reply.rank,
            metadata=reply.metadata,
            compat_hash=reply.compat_hash,
            samples=tuple(samples),
        )
    finally:
        sock.close(linger=0)


def _await_reply(
    sock: zmq.Socket[bytes],
    nonce: bytes,
    *,
    secret: bytes | None,
    deadline: float,
    clock: Callable[[], float],
    stop: threading.Event | None,
) -> wire.HandshakeReply:
    while True:
        if stop is not None and stop.is_set():
            raise ClientClosed("client closed during the handshake")
        left = deadline - clock()
        if left <= 0:
            raise HandshakeTimeout(f"no reply within the timeout from {sock.LAST_ENDPOINT!r}")
        if not sock.poll(int(min(left, _SLICE_S) * 1000) + 1):
            continue
        frames = sock.recv_multipart()
        if frames and frames[0] == b"":
            frames = frames[1:]
        if not frames or len(frames) > 2:
            raise BadReply(f"reply of {len(frames)} frames")
        body = frames[0]
        try:
            reply = wire.decode_reply(body)
        except MalformedHandshake as exc:
            raise BadReply(f"undecodable reply: {exc}") from exc
        if reply.nonce != nonce and reply.error != wire.ERR_UNAUTHENTICATED:
            continue  # a late answer to an earlier round trip: not ours
        if reply.error == wire.ERR_UNAUTHENTICATED:
            raise AuthenticationFailed("the holder refused our MAC (or we sent none)")
        if secret is not None:
            mac = frames[1] if len(frames) == 2 else None
            if not wire.mac_ok(wire.reply_mac(secret, body), mac):
                raise AuthenticationFailed("the reply's MAC is missing or wrong")
        return reply


def _check_reply(reply: wire.HandshakeReply, compat_hash: bytes) -> None:
    if reply.error == wire.ERR_COMPAT or (reply.compat_hash and reply.compat_hash != compat_hash):
        raise CompatMismatch(ours=compat_hash, theirs=reply.compat_hash)
    if not reply.ok:
        raise ServerRefused(reply.error or "error", reply.detail)


class HandshakeClient:
    """Non-blocking, concurrent handshakes with backoff and per-endpoint circuit breakers.

    Thread-safe: ``submit`` and ``poll_results`` may be called from any thread.
    """

    def __init__(
        self,
        *,
        requester: str,
        compat_hash: bytes,
        secret: bytes | None = None,
        requester_metadata: bytes = b"",
        rounds: int = 3,
        timeout_s: float = 5.0,
        max_attempts: int = 3,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        breaker_threshold: int = 3,
        breaker_cooldown_s: float = 2.0,
        breaker_max_cooldown_s: float = 60.0,
        max_pending: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """See the module docstring; ``timeout_s`` bounds each round trip."""
        self._requester = requester
        self._compat = compat_hash
        self._secret = secret
        self._intro = requester_metadata
        self._rounds = rounds
        self._timeout = timeout_s
        self._attempts = max(1, max_attempts)
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._breaker_cfg = (breaker_threshold, breaker_cooldown_s, breaker_max_cooldown_s)
        self._max_pending = max_pending
        self._clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Thread] = {}
        self._breakers: dict[tuple[str, int], CircuitBreaker] = {}
        self._results: list[HandshakeResult] = []
        self._stop = threading.Event()
        self._rng = random.Random()

    def pending(self) -> set[Hashable]:
        """Peer keys whose handshake is still running."""
        with self._lock:
            return set(self._pending)

    def submit(
        self, peer_key: Hashable, host: str, port: int, rank: int, *, registration: bytes = b""
    ) -> bool:
        """Start a handshake unless one for ``peer_key`` is pending; returns whether it started.

        ``registration``: opaque bytes the holder's owner collects with the introduction
        (:attr:`.server.Introduction.registration`).

        A refused start (breaker open, too many pending, client closed) is
        reported as a :class:`HandshakeFailed` by the next ``poll_results``.
        """
        start = self._clock()
        with self._lock:
            if peer_key in self._pending:
                return False
            error: SideChannelError | None = None
            if self._stop.is_set():
                error = ClientClosed("client closed")
            elif len(self._pending) >= self._max_pending:
                error = SideChannelError(f"{self._max_pending} handshakes already pending")
            else:
                wait = self._breaker(host, port).allow(start)
                if wait is not None:
                    error = CircuitOpen(wait)
            if error is not None:
                self._results.append(
                    HandshakeFailed(
                        peer_key=peer_key,
                        host=host,
                        port=port,
                        rank=rank,
                        error=error,
                        attempts=0,
                        duration_s=0.0,
                    )
                )
                return False
            thread = threading.Thread(
                target=self._work,
                args=(
                    _Job(
                        peer_key=peer_key,
                        host=host,
                        port=port,
                        rank=rank,
                        start=start,
                        intro=self._intro,
                        registration=registration,
                    ),
                ),
                name=f"kvproto-handshake-{host}:{port}/{rank}",
                daemon=True,
            )
            self._pending[peer_key] = thread
        thread.start()
        return True

    def poll_results(self) -> list[HandshakeResult]:
        """Results since the last call. Never blocks."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self, timeout_s: float = 2.0) -> None:
        """Abandon pending handshakes and release the ZMQ context; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            threads = list(self._pending.values())
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in threads):
            self._ctx.term()

    # --- worker threads --------------------------------------------------

    def _breaker(self, host: str, port: int) -> CircuitBreaker:
        key = (host, port)
        breaker = self._breakers.get(key)
        if breaker is None:
            threshold, cooldown, max_cooldown = self._breaker_cfg
            breaker = CircuitBreaker(
                threshold=threshold, cooldown_s=cooldown, max_cooldown_s=max_cooldown
            )
            self._breakers[key] = breaker
        return breaker

    def _work(self, job: _Job) -> None:
        peer_key, host, port, rank, start = job.peer_key, job.host, job.port, job.rank, job.start
        intro = job.intro
        result: HandshakeResult
        attempts = 0
        error: SideChannelError = HandshakeTimeout("not attempted")
        reply: MetadataReply | None = None
        try:
            while attempts < self._attempts and not self._stop.is_set():
                attempts += 1
                try:
                    reply = fetch_metadata(
                        self._ctx,
                        host,
                        port,
                        rank,
                        requester=self._requester,
                        compat_hash=self._compat,
                        secret=self._secret,
                        requester_metadata=intro,
                        registration=job.registration,
                        rounds=self._rounds,
                        timeout_s=self._timeout,
                        clock=self._clock,
                        stop=self._stop,
                    )
                    break
                except SideChannelError as exc:
                    error = exc
                except zmq.ZMQError as exc:  # e.g. context terminated, bad address
                    error = BadReply(f"ZMQ: {exc}")
                if not error.retryable or attempts >= self._attempts:
                    break
                initial, cap = self._backoff
                delay = min(cap, initial * 2 ** (attempts - 1)) * (0.8 + 0.4 * self._rng.random())
                self._stop.wait(delay)
            if reply is None and self._stop.is_set() and not isinstance(error, ClientClosed):
                error = ClientClosed("client closed during the handshake")
        except Exception as exc:  # never lose a result: a worker bug still reports
            error = SideChannelError(f"internal error: {type(exc).__name__}: {exc}")
            reply = None
        now = self._clock()
        if reply is not None:
            result = HandshakeSucceeded(
                peer_key=peer_key,
                host=host,
                port=port,
                reply=reply,
                attempts=attempts,
                duration_s=now - start,
            )
        else:
            result = HandshakeFailed(
                peer_key=peer_key,
                host=host,
                port=port,
                rank=rank,
                error=error,
                attempts=attempts,
                duration_s=now - start,
            )
        with self._lock:
            breaker = self._breaker(host, port)
            if reply is not None:
                breaker.success()
            else:
                breaker.failure(now)
            self._pending.pop(peer_key, None)
            self._results.append(result)
