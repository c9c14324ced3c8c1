"""UcxTransport: the kvproto Transport protocol over UCX (ucxx + libucp RMA).

The public methods run on any thread and never wait on the network: they
validate, then queue a command for the endpoint's engine (:mod:`.engine`),
which owns every UCX object, and run it at once on the calling thread unless
another thread is in the engine. ``poll`` progresses UCX the same way, then
drains what the engine reported. Only ``__init__`` (UCX start-up), ``register_blocks``
(memory registration) and ``close`` wait for the engine, each bounded by a
timeout.

* Notifications are UCP tagged messages; payloads are delivered byte-exact.
  A payload over ``max_notification_size`` raises :class:`FrameTooLarge`.
* Writes (push mode) are UCP ``put`` operations followed by an endpoint flush
  (remote completion), then the notify: see :mod:`.engine`.
* Reads are UCP RMA ``get`` operations on the peer's registered memory (one
  per merged segment); the attached notify is sent after every ``get``
  completed, i.e. after the data is in local memory. Over TCP, UCX serves a
  ``get`` by "software emulation" inside the holder's UCX progress engine
  (the holder's engine: its thread, or a thread polling the holder; no
  application code); on RDMA it is a
  hardware read. Either way no kvproto code runs at the holder.
* Peer failure: UCX endpoint error handling reports the broken connection of
  our endpoint to an added peer; the engine turns it into one :class:`PeerLost`.
  Notifications from a peer that was not added are still received (attributed
  through its HELLO), but its death is only seen once it is added.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    MemoryNotRegistered,
    PeerId,
    PeerUnreachable,
    ReadId,
    ThreadAffinity,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)

from ..read_args import check_notify
from ..transfers import Transfers
from .engine import DEFAULT_UCX_OPTIONS, Engine, EngineConfig
from .errors import Backpressure, RegistrationError
from .plan import plan_read
from .shared import (
    AddPeer,
    Read,
    ReadOp,
    Refresh,
    Register,
    RemovePeer,
    Shared,
    UcxStats,
)
from .wire import (
    KEY_MASK,
    WIRE_KIND,
    WIRE_VERSION,
    UcxMetadata,
    decode_metadata,
    encode_metadata,
    layout_to_wire,
)

DEFAULT_MAX_NOTIFICATION_SIZE = 1 << 20
"""1 MiB, as the NIXL transport: large enough for any batched heartbeat, small
enough that one notification does not monopolise the engine thread."""

DEFAULT_PROBE_INTERVAL_S = 0.1
"""How often an idle connection is probed (one empty tagged message)."""

FAILURE_DETECTION_BOUND_S = 1.0
"""Declared bound from the death of a connected peer's process to PeerLost, with
probes on. Measured 10-40 ms on localhost TCP (the kernel resets the dead
process's connections; the next probe or send fails). Not covered: a peer that
dies during the handshake (reported after ``connect_timeout_s``), and a host
that vanishes without resetting its connections (UCX keep-alive,
``UCX_KEEPALIVE_INTERVAL``, or the lease protocol's own expiry)."""


@dataclass(slots=True)
class _Peer:
    raw: bytes
    meta: UcxMetadata
    layout: BlockLayout | None


class UcxTransport(Transfers):
    """One UCX endpoint (context, worker, listener) as a kvproto transport endpoint."""

    def __init__(
        self,
        *,
        name_prefix: str = "kvproto",
        max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE,
        ucx_options: Mapping[str, str] | None = None,
        connect_timeout_s: float = 5.0,
        probe_interval_s: float | None = DEFAULT_PROBE_INTERVAL_S,
        max_pending_sends: int = 65536,
        idle_wait_ms: int = 50,
        start_timeout_s: float = 10.0,
    ) -> None:
        """Start UCX (a context and a worker of our own, and the engine thread).

        Peers reach this endpoint through the UCX worker address in
        ``metadata()``; no port is opened here. ``ucx_options`` are
        UCX settings without the ``UCX_`` prefix, on top of
        :data:`~kvproto_transports.ucx.engine.DEFAULT_UCX_OPTIONS`;
        environment variables (``UCX_TLS``...) override both.
        ``probe_interval_s``: an idle connection gets an empty probe this often,
        so that a dead peer is noticed (None: only when something is sent;
        the declared detection bound then no longer holds for idle peers).
        ``connect_timeout_s``: a peer not reachable by then (or that dies
        during the handshake) is reported lost. ``max_pending_sends`` bounds
        queued plus in-flight notifications; past it ``send`` raises
        :class:`Backpressure`. ``idle_wait_ms`` is the
        longest the engine sleeps without a UCX event (timeouts' granularity).
        """
        if max_notification_size is not None and max_notification_size < 1:
            raise ValueError("max_notification_size must be positive or None")
        if probe_interval_s is not None and probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be positive or None")
        incarnation = int.from_bytes(os.urandom(8), "little")
        self._incarnation = incarnation
        self._name: PeerId = f"{name_prefix}-{incarnation:016x}"
        self._max = max_notification_size
        self._lock = threading.Lock()
        self._shared = Shared(max_pending_sends)
        self._engine = Engine(
            EngineConfig(
                local_peer=self._name,
                sender_key=int.from_bytes(os.urandom(8), "little") & KEY_MASK,
                ucx_options={**DEFAULT_UCX_OPTIONS, **(ucx_options or {})},
                connect_timeout_s=connect_timeout_s,
                probe_interval_s=probe_interval_s,
                idle_wait_ms=idle_wait_ms,
            ),
            self._shared,
        )
        self._address = self._engine.start(start_timeout_s)
        self._caps = Capabilities(
            max_notification_size=max_notification_size,
            # One endpoint's active messages arrived in order in every run here,
            # but UCX does not promise it across eager and rendezvous sizes.
            ordered=False,
            may_duplicate=False,
            # Without probes a dead peer is still reported when a send or read to it
            # fails, but no bound can be promised: declare no detection then.
            detects_peer_failure=probe_interval_s is not None,
            failure_detection_bound_s=(
                FAILURE_DETECTION_BOUND_S if probe_interval_s is not None else None
            ),
            one_sided_reads=True,
            writes=True,
            thread_affinity=ThreadAffinity.ANY,
        )
        self._peers: dict[PeerId, _Peer] = {}
        self._layout: BlockLayout | None = None
        self._rkeys: tuple[bytes, ...] = ()
        self._metadata: bytes | None = None
        self._next_read: ReadId = 1
        self._closed = False

    # --- identity ---------------------------------------------------------

    @property
    def name(self) -> str:
        """``"ucx"``."""
        return "ucx"

    @property
    def capabilities(self) -> Capabilities:
        """What this endpoint promises."""
        return self._caps

    @property
    def local_peer(self) -> PeerId:
        """``{name_prefix}-{incarnation:016x}``: new for every incarnation."""
        return self._name

    @property
    def layout(self) -> BlockLayout | None:
        """The registered layout, if any."""
        return self._layout

    @property
    def stats(self) -> UcxStats:
        """A copy of the counters."""
        return self._engine.stats()

    def metadata(self) -> bytes:
        """Worker address, peer id, incarnation, layout and remote keys, msgpack-encoded."""
        with self._lock:
            self._check()
            if self._metadata is None:
                self._metadata = encode_metadata(
                    UcxMetadata(
                        kind=WIRE_KIND,
                        version=WIRE_VERSION,
                        peer=self._name,
                        incarnation=self._incarnation,
                        worker_address=self._address,
                        layout=None if self._layout is None else layout_to_wire(self._layout),
                        rkeys=self._rkeys,
                    )
                )
            return self._metadata

    # --- peers -----------------------------------------------------------

    def add_peer(self, metadata: bytes) -> PeerId:
        """Connect to a peer (in the background); idempotent; refreshes grown metadata.

        Adding a peer that was reported lost connects again.
        """
        raw = bytes(metadata)
        meta, layout = decode_metadata(raw)
        with self._lock:
            self._check()
            if meta.peer == self._name:
                raise BadMetadata("this is the endpoint's own metadata")
            old = self._peers.get(meta.peer)
            lost = self._shared.lost_reason(meta.peer) is not None
            if old is not None and old.raw == raw and not lost:
                return meta.peer
            if old is not None and old.meta.worker_address != meta.worker_address:
                raise BadMetadata(f"peer {meta.peer} changed address within one incarnation")
            self._peers[meta.peer] = _Peer(raw=raw, meta=meta, layout=layout)
            if old is None or lost:
                self._shared.clear_lost(meta.peer)
                self._engine.submit(
                    AddPeer(peer=meta.peer, address=meta.worker_address, rkeys=meta.rkeys)
                )
            else:
                self._engine.submit(Refresh(peer=meta.peer, rkeys=meta.rkeys))
            return meta.peer

    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer: close our endpoint to it; its in-flight reads fail. Idempotent.

        The peer's own endpoint to us is a separate UCP endpoint and stays up
        (measured), so removing a peer does not look like a death to it.
        """
        with self._lock:
            self._check()
            if self._peers.pop(peer, None) is None:
                return
            self._shared.clear_lost(peer)
            self._engine.submit(RemovePeer(peer=peer))

    # --- notifications ---------------------------------------------------

    def send(self, peer: PeerId, payload: bytes) -> None:
        """Queue one notification; never blocks.

        Raises :class:`FrameTooLarge`, :class:`UnknownPeer`, :class:`PeerUnreachable`
        (the peer was reported lost), :class:`Backpressure` or :class:`TransportClosed`.
        """
        data = bytes(payload)
        with self._lock:
            if self._closed or self._shared.failed is not None:
                self._check()  # raises; tested inline first, as every send does
            if self._max is not None and len(data) > self._max:
                raise FrameTooLarge(f"{len(data)} bytes > max_notification_size {self._max}")
            if peer not in self._peers:
                raise UnknownPeer(f"unknown peer {peer!r}")
            reason = self._shared.lost_reason(peer)
            if reason is not None:
                raise PeerUnreachable(f"peer {peer} is lost: {reason}")
            if not self._shared.take_send_slot():
                raise Backpressure(f"too many notifications queued for sending (peer {peer})")
            self._engine.send(peer, data)

    def poll(self) -> Sequence[TransportEvent]:
        """What happened since the last call; never blocks.

        Still works after the engine thread died, so that its last PeerLost
        events reach the binding; every other call then raises TransportClosed.
        """
        self._check(failed_ok=True)  # flag reads need no lock: close() sets them once
        # Progress UCX here, on the caller's thread, rather than wait for the
        # engine thread to wake up, do it and hand the events over.
        self._engine.drive(whole_step=True)
        events = self._shared.events
        out: list[TransportEvent] = []
        # Test before popping instead of ending on an IndexError raised by every poll;
        # the except stays for a close() on another thread clearing the deque meanwhile.
        try:
            while events:
                out.append(events.popleft())
        except IndexError:
            pass
        return out

    def set_wakeup(self, callback: Callable[[], None] | None) -> None:
        """Have ``callback`` called whenever events wait for :meth:`poll`; None removes it.

        It runs on the engine thread, once per step, or on a thread whose
        ``send``, ``read_blocks`` or peer call ran its command, while events
        are unpolled (so possibly again before the next ``poll``): it must be
        cheap, thread-safe and must not call this transport (asyncio:
        ``loop.call_soon_threadsafe`` behind a flag, see
        :mod:`kvproto_binding.aio`).
        """
        self._engine.wakeup = callback
        if callback is not None and self._shared.events:
            callback()

    # --- memory and reads ------------------------------------------------

    def register_blocks(self, layout: BlockLayout, *, timeout_s: float = 10.0) -> None:
        """Register every region with UCX (``ucp_mem_map``); the remote keys join ``metadata()``.

        ``VRAM`` layouts are mapped as CUDA memory: that needs UCX's CUDA
        transports (``ucx_options={"TLS": "all"}`` or ``UCX_TLS`` with
        ``cuda_copy``/``cuda_ipc``/RDMA), not the TCP-only default.
        """
        with self._lock:
            self._check()
            if self._layout is not None:
                raise RegistrationError("memory is already registered on this endpoint")
            result: Future[tuple[bytes, ...]] = Future()
            self._engine.submit(Register(layout=layout, result=result))
            try:
                self._rkeys = result.result(timeout=timeout_s)
            except TimeoutError as exc:
                raise RegistrationError(f"registration took over {timeout_s} s") from exc
            self._layout = layout
            self._metadata = None

    def _transfer(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice,
        remote_slice: BlockSlice,
        notify: bytes | None,
        write: bool,
    ) -> ReadId:
        """One read (``get``) or write (``put`` + flush) of the given blocks of every region.

        Checks everything before anything moves (a ``get`` outside the holder's
        registered memory can crash the holder, a ``put`` would corrupt it): raises
        :class:`UnknownPeer`, :class:`PeerUnreachable`, :class:`MemoryNotRegistered`,
        :class:`~.errors.LayoutMismatch` or :class:`FrameTooLarge`. The outcome arrives
        through ``poll``.
        """
        note = None if notify is None else bytes(notify)
        with self._lock:
            self._check()
            check_notify(note, self._max)
            state = self._peers.get(peer)
            if state is None:
                raise UnknownPeer(f"unknown peer {peer!r}")
            reason = self._shared.lost_reason(peer)
            if reason is not None:
                raise PeerUnreachable(f"peer {peer} is lost: {reason}")
            if len(local_blocks) != len(remote_blocks) or local_blocks:
                if self._layout is None:
                    raise MemoryNotRegistered("no local memory registered")
                if state.layout is None:
                    raise MemoryNotRegistered(f"peer {peer} advertised no registered memory")
                segments = plan_read(
                    self._layout,
                    state.layout,
                    local_blocks=local_blocks,
                    remote_blocks=remote_blocks,
                    local_slice=local_slice,
                    remote_slice=remote_slice,
                )
            else:
                segments = []
            read_id = self._next_read
            self._next_read += 1
            op = ReadOp(read_id=read_id, peer=peer, segments=segments, notify=note, write=write)
            self._engine.submit(Read(op=op))
            return read_id

    # --- lifecycle ---------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every connection, deregister memory, stop the engine; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.stop(timeout_s)
        self._shared.events.clear()

    def __enter__(self) -> UcxTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, *, failed_ok: bool = False) -> None:
        if self._closed:
            raise TransportClosed(f"UcxTransport {self._name} is closed")
        if self._shared.failed is not None and not failed_ok:
            raise TransportClosed(f"UcxTransport {self._name}: {self._shared.failed}")
