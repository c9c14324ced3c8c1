"""MooncakeTransport: the kvproto Transport protocol over Mooncake's transfer engine.

* Memory: each region is registered with ``batch_register_memory``; the
  layout travels in ``metadata()`` with the engine's session name.
* Reads: one ``batch_transfer_async_read`` per request (one segment per
  region and run of contiguous blocks), waited on by :mod:`.reads` on its
  own thread; the read's notify is sent only after the batch completed, i.e.
  after the data is in local memory.
* Notifications: Mooncake's Python API has no standalone notification, so
  they travel over ZMQ (:mod:`.mailbox`), byte-exact and in order.
* Peer failure: the engine's own ``send_probe`` (:mod:`.prober`); a failed
  read probes at once.

Every public method may be called from any thread and returns without
waiting on the network (``send`` refuses with :class:`~.errors.Backpressure`
instead of blocking). ``__init__`` starts an engine (~1 ms) and ``close``
destroys it: Mooncake's destructor joins its handshake listener, which
waits out a 1 s accept timeout while holding the GIL (measured 0.97-1.04 s
in which no other Python thread of the process runs).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    MemoryNotRegistered,
    PeerId,
    PeerLost,
    PeerUnreachable,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    RegistrationError,
    ThreadAffinity,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)
from kvproto_transports.read_args import check_notify
from kvproto_transports.ucx.plan import plan_read

from ._engine import load_engine, new_engine
from .errors import Backpressure
from .mailbox import Mailbox
from .prober import Prober
from .reads import ReadJob, ReadWorker
from .stats import MooncakeStats
from .wire import WIRE_KIND, WIRE_VERSION, MooncakeMetadata, decode_metadata, encode_metadata
from .wire import layout_to_wire as _layout_to_wire

DEFAULT_MAX_NOTIFICATION_SIZE = 1 << 20
"""1 MiB, as NIXL and UCX."""

DEFAULT_PROBE_INTERVAL_S = 0.1
"""How often each added peer is probed with ``send_probe``."""

PROBE_MISSES = 2
"""Consecutive failed probes that make a peer lost (one refused connect could be a
listener restarting; two, ``interval`` apart, are a dead engine)."""

FAILURE_DETECTION_BOUND_S = 1.0
"""Declared bound from a peer engine's death to PeerLost with probes at the default
interval: two probe intervals plus the probes (measured 0.1-0.3 s from ``kill -9``).
Not covered: a host that vanishes without refusing connections (the probe then waits
for its connect timeout; the lease protocol's expiry covers it)."""

PROBE_SLACK_S = FAILURE_DETECTION_BOUND_S - PROBE_MISSES * DEFAULT_PROBE_INTERVAL_S
"""What the bound allows beyond the missed probes' intervals (the probes themselves, a
loaded machine's scheduling): 0.8 s."""


def detection_bound_s(probe_interval_s: float) -> float:
    """The declared bound at ``probe_interval_s``: a longer interval (the vLLM adapter
    probes every 0.25 s by default) delays the second missed probe by as much."""
    return max(FAILURE_DETECTION_BOUND_S, PROBE_MISSES * probe_interval_s + PROBE_SLACK_S)


NOTIFY_RETRY_S = 1.0
"""How long the read thread retries a read's notify against a full peer queue
before it reports the read failed (the done must never be dropped silently)."""

_LEAKED: list[Any] = []
"""Engines whose read thread did not stop in time: destroying them under it would
free what it is waiting on, so they live until the process ends."""


@dataclass(slots=True)
class _Peer:
    raw: bytes
    meta: MooncakeMetadata
    layout: BlockLayout | None


class MooncakeTransport:
    """One Mooncake transfer engine (TCP, P2P handshake) as a kvproto transport endpoint."""

    def __init__(
        self,
        *,
        name_prefix: str = "kvproto",
        host: str = "127.0.0.1",
        max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE,
        probe_interval_s: float | None = DEFAULT_PROBE_INTERVAL_S,
        max_pending_sends: int = 65536,
    ) -> None:
        """Start a transfer engine on ``host`` and the notification socket.

        ``probe_interval_s``: how often added peers are probed (None: no probes;
        a dead peer is then only noticed by a failed read, and no detection
        bound is declared). ``max_pending_sends``: notifications queued per
        peer before ``send`` raises :class:`~.errors.Backpressure`.
        """
        if max_notification_size is not None and max_notification_size < 1:
            raise ValueError("max_notification_size must be positive or None")
        if probe_interval_s is not None and probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be positive or None")
        self._incarnation = int.from_bytes(os.urandom(8), "little")
        self._name: PeerId = f"{name_prefix}-{self._incarnation:016x}"
        self._max = max_notification_size
        self._module = load_engine()
        self._engine: Any = new_engine(host)
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._events: deque[TransportEvent] = deque()
        self._stats = MooncakeStats()
        self._mailbox = Mailbox(host=host, local_peer=self._name, max_pending=max_pending_sends)
        self._caps = Capabilities(
            max_notification_size=max_notification_size,
            ordered=True,  # one ZMQ connection per pair, one PUSH socket per peer
            may_duplicate=False,
            detects_peer_failure=probe_interval_s is not None,
            failure_detection_bound_s=(
                None if probe_interval_s is None else detection_bound_s(probe_interval_s)
            ),
            one_sided_reads=True,  # the holder's engine serves them; no kvproto code runs there
            thread_affinity=ThreadAffinity.ANY,
        )
        self._peers: dict[PeerId, _Peer] = {}
        self._lost: dict[PeerId, str] = {}
        self._layout: BlockLayout | None = None
        self._metadata: bytes | None = None
        self._next_read: ReadId = 1
        self._closed = False
        self._reads = ReadWorker(self._engine, self._read_done, name=f"{self._name}-reads")
        self._prober = (
            None
            if probe_interval_s is None
            else Prober(
                self._engine,
                interval_s=probe_interval_s,
                misses=PROBE_MISSES,
                on_lost=self._peer_lost,
                name=f"{self._name}-probe",
            )
        )

    # --- identity ---------------------------------------------------------

    @property
    def name(self) -> str:
        """``"mooncake"``."""
        return "mooncake"

    @property
    def capabilities(self) -> Capabilities:
        """What this endpoint promises."""
        return self._caps

    @property
    def local_peer(self) -> PeerId:
        """``{name_prefix}-{incarnation:016x}``: new for every incarnation."""
        return self._name

    @property
    def session(self) -> str:
        """The engine's session name, ``host:rpc_port``."""
        return self._session

    @property
    def layout(self) -> BlockLayout | None:
        """The registered layout, if any."""
        return self._layout

    @property
    def stats(self) -> MooncakeStats:
        """A copy of the counters."""
        with self._lock:
            stats = replace(self._stats, frames_dropped=self._mailbox.dropped)
        if self._prober is not None:
            stats.probes_sent, stats.probes_failed = self._prober.probes, self._prober.failed
        return stats

    def metadata(self) -> bytes:
        """Session name, notify address, peer id, incarnation and layout, msgpack-encoded."""
        with self._lock:
            self._check()
            if self._metadata is None:
                self._metadata = encode_metadata(
                    MooncakeMetadata(
                        kind=WIRE_KIND,
                        version=WIRE_VERSION,
                        peer=self._name,
                        incarnation=self._incarnation,
                        session=self._session,
                        notify_address=self._mailbox.address,
                        layout=None if self._layout is None else _layout_to_wire(self._layout),
                    )
                )
            return self._metadata

    # --- peers -----------------------------------------------------------

    def add_peer(self, metadata: bytes) -> PeerId:
        """Make a peer reachable; idempotent; refreshes grown metadata; re-arms a lost peer."""
        raw = bytes(metadata)
        meta, layout = decode_metadata(raw)
        with self._lock:
            self._check()
            if meta.peer == self._name:
                raise BadMetadata("this is the endpoint's own metadata")
            old = self._peers.get(meta.peer)
            lost = meta.peer in self._lost
            if old is not None and old.raw == raw and not lost:
                return meta.peer
            if old is not None and (
                old.meta.session != meta.session or old.meta.notify_address != meta.notify_address
            ):
                raise BadMetadata(f"peer {meta.peer} changed address within one incarnation")
            self._peers[meta.peer] = _Peer(raw=raw, meta=meta, layout=layout)
            if old is None or lost:
                self._lost.pop(meta.peer, None)
                self._mailbox.connect(meta.peer, meta.notify_address)
                if self._prober is not None:
                    self._prober.watch(meta.peer, meta.session)
            return meta.peer

    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer: close its notification socket, stop probing it; idempotent.

        Reads in flight from it still end in ReadCompleted or ReadFailed.
        """
        with self._lock:
            self._check()
            if self._peers.pop(peer, None) is None:
                return
            self._lost.pop(peer, None)
            self._mailbox.disconnect(peer)
            if self._prober is not None:
                self._prober.unwatch(peer)

    # --- notifications ---------------------------------------------------

    def send(self, peer: PeerId, payload: bytes) -> None:
        """Queue one notification; never blocks.

        Raises :class:`FrameTooLarge`, :class:`UnknownPeer`, :class:`PeerUnreachable`
        (the peer was reported lost), :class:`~.errors.Backpressure` or
        :class:`TransportClosed`.
        """
        data = bytes(payload)
        with self._lock:
            self._check()
            if self._max is not None and len(data) > self._max:
                raise FrameTooLarge(f"{len(data)} bytes > max_notification_size {self._max}")
            if peer not in self._peers:
                raise UnknownPeer(f"unknown peer {peer!r}")
            reason = self._lost.get(peer)
            if reason is not None:
                raise PeerUnreachable(f"peer {peer} is lost: {reason}")
            if not self._mailbox.send(peer, data):
                raise Backpressure(f"notification queue to {peer} is full")
            self._stats.notifications_sent += 1

    def poll(self) -> Sequence[TransportEvent]:
        """What happened since the last call; never blocks."""
        with self._lock:
            self._check()
            out: list[TransportEvent] = []
            while self._events:
                out.append(self._events.popleft())
            for sender, payload in self._mailbox.drain():
                out.append(Received(peer=sender, payload=payload))
                self._stats.notifications_received += 1
            return out

    # --- memory and reads ------------------------------------------------

    def register_blocks(self, layout: BlockLayout) -> None:
        """Register every region (``batch_register_memory``); the layout joins ``metadata()``."""
        with self._lock:
            self._check()
            if self._layout is not None:
                raise RegistrationError("memory is already registered on this endpoint")
            if layout.memory_kind != "DRAM" and not getattr(self._module, "SUPPORT_CUDA", False):
                raise RegistrationError(
                    f"{layout.memory_kind} memory needs a CUDA build of Mooncake "
                    "(mooncake-transfer-engine); this one is non-CUDA"
                )
            sizes = [n * layout.num_blocks for n in layout.block_lens]
            rc = self._engine.batch_register_memory(list(layout.region_addrs), sizes)
            if rc != 0:
                raise RegistrationError(f"batch_register_memory = {rc}")
            self._layout = layout
            self._metadata = None

    def read_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> ReadId:
        """Read ``remote_blocks`` of every region of ``peer`` into ``local_blocks``.

        Checks everything before anything moves: raises :class:`UnknownPeer`,
        :class:`PeerUnreachable`, :class:`MemoryNotRegistered`,
        :class:`~kvproto.transport.LayoutMismatch` or :class:`FrameTooLarge`.
        The outcome arrives through ``poll``.
        """
        note = None if notify is None else bytes(notify)
        with self._lock:
            self._check()
            check_notify(note, self._max)
            state = self._peers.get(peer)
            if state is None:
                raise UnknownPeer(f"unknown peer {peer!r}")
            reason = self._lost.get(peer)
            if reason is not None:
                raise PeerUnreachable(f"peer {peer} is lost: {reason}")
            locals_, remotes, lengths = [], [], []
            if len(local_blocks) != len(remote_blocks) or local_blocks:
                if self._layout is None:
                    raise MemoryNotRegistered("no local memory registered")
                if state.layout is None:
                    raise MemoryNotRegistered(f"peer {peer} advertised no registered memory")
                for seg in plan_read(
                    self._layout,
                    state.layout,
                    local_blocks=local_blocks,
                    remote_blocks=remote_blocks,
                    local_slice=local_slice,
                    remote_slice=remote_slice,
                ):
                    locals_.append(seg.local_addr)
                    remotes.append(seg.remote_addr)
                    lengths.append(seg.length)
            read_id = self._next_read
            self._next_read += 1
            self._stats.reads_started += 1
            job = ReadJob(
                read_id=read_id,
                peer=peer,
                session=state.meta.session,
                local_addrs=locals_,
                remote_addrs=remotes,
                lengths=lengths,
                notify=note,
            )
        self._reads.submit(job)
        return read_id

    # --- lifecycle ---------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop probing and reading, close the sockets, destroy the engine; idempotent.

        Destroying the engine takes ~1 s with the GIL held (see the module docstring).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._prober is not None:
            self._prober.stop(timeout_s)
        reads_stopped = self._reads.stop(timeout_s)
        with self._lock:
            self._mailbox.close()
            self._events.clear()
        engine, self._engine = self._engine, None
        if not reads_stopped:
            _LEAKED.append(engine)
            return
        if self._layout is not None:
            engine.batch_unregister_memory(list(self._layout.region_addrs))
        del engine  # the destructor runs here: ~1 s, GIL held

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- called from the read and probe threads ------------------------------

    def _read_done(self, job: ReadJob, failure: str | None) -> None:
        if failure is None and job.notify is not None:
            failure = self._send_notify(job)
        with self._lock:
            if self._closed:
                return
            if failure is None:
                self._stats.reads_completed += 1
                self._events.append(ReadCompleted(read_id=job.read_id))
            else:
                self._stats.reads_failed += 1
                self._events.append(ReadFailed(read_id=job.read_id, reason=failure))
        if failure is not None and self._prober is not None:
            self._prober.kick()  # the engine may be gone: find out now

    def _send_notify(self, job: ReadJob) -> str | None:
        assert job.notify is not None
        deadline = time.monotonic() + NOTIFY_RETRY_S
        while True:
            with self._lock:
                if self._closed:
                    return "endpoint closed"
                if job.peer not in self._peers:
                    return f"peer {job.peer} was removed before the notify went"
                if self._mailbox.send(job.peer, job.notify):
                    return None
            if time.monotonic() > deadline:
                return f"notify to {job.peer} refused for {NOTIFY_RETRY_S} s (queue full)"
            time.sleep(0.001)

    def _peer_lost(self, peer: PeerId, reason: str) -> None:
        with self._lock:
            if self._closed or peer not in self._peers or peer in self._lost:
                return
            self._lost[peer] = reason
            self._stats.peers_lost += 1
            self._events.append(PeerLost(peer=peer, reason=reason))

    def _check(self) -> None:
        if self._closed:
            raise TransportClosed(f"MooncakeTransport {self._name} is closed")
