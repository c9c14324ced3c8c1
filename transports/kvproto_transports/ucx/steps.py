"""What one step of the UCX engine does: commands, sends, connections, arrivals, reads.

:class:`Steps` owns every UCX object of one transport endpoint (context,
worker, endpoints, memory registrations) and the bookkeeping around them; a
call of :meth:`Steps.step` does one step:

1. carry out queued commands (connect, send, read, register, stop);
2. progress the worker (this fires endpoint-error callbacks, which only
   record what happened);
3. receive tagged messages, reap finished sends, flushes and ``get``
   requests, turn broken endpoints into ``PeerLost``.

It starts no thread and takes no lock: which thread runs a step, and that
one runs at a time, is :class:`~kvproto_transports.ucx.engine.Engine`'s to
decide. So one thread can drive two endpoints step by step (the tests do).

Why not ucxx's asyncio API: that API keeps one process-wide
``ApplicationContext`` (one UCX worker per process), while the conformance
kit and tests run several endpoints in one process, each needing its own
worker and failure reports. The core (``ucxx._lib.libucxx``) lets each
endpoint own a context and a worker (ucxx creates it ``UCS_THREAD_MODE_MULTI``).

Connections: ``add_peer`` creates a UCP endpoint from the peer's *worker
address* (no listener, no port) with ``endpoint_error_handling=True`` and
sends HELLO first. Listeners were tried first and dropped: UCX 1.21's TCP
sockaddr listener keeps a raw pointer in every accepted connection, so a
listener destroyed while a peer is connecting crashed the process in UCX's
async thread (SIGSEGV, seen in the restart case). An endpoint learns of a
peer's death through its own endpoint to that peer, so each side must add
the other (the side channel carries the reader's metadata to the holder);
measured: the error callback fires 10-25 ms after ``kill -9`` of the peer.

Reads: ``ucp_ep_flush_nbx`` first (remote keys must be unpacked only on a
wired-up endpoint: unpacking earlier crashed on the second ``get``), then one
``ucp_get_nbx`` per merged segment; when all finished, the notify goes out on
the same endpoint, so the holder sees it only after the data is in the
reader's memory.

Writes (push mode): one ``ucp_put_nbx`` per merged segment, then
``ucp_ep_flush_nbx``, which completes only once every earlier operation of the
endpoint is complete at the peer; when the flush completed the notify goes out on
the same endpoint and the write is reported complete. A write is reported failed
only once UCX released every request of it (no grace, unlike a read: a put still
in flight could land after the holder learnt of the failure).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvproto.transport import PeerId, PeerLost, Received

from ..transfers import count, outcome
from ._ucp import UCS_INPROGRESS, UCS_OK, Ucp, UcpError, load_ucp
from ._ucxx import load_ucxx
from .errors import RegistrationError
from .shared import (
    AddPeer,
    Command,
    Read,
    ReadOp,
    Refresh,
    Register,
    RemovePeer,
    Send,
    Shared,
    Stop,
)
from .wire import FrameKind, decode_hello, hello_body, make_tag, split_tag

log = logging.getLogger("kvproto.ucx")

DEFAULT_UCX_OPTIONS: Mapping[str, str] = {"TLS": "tcp", "WARN_UNUSED_ENV_VARS": "n"}
"""UCX options applied unless the environment sets them (``UCX_TLS`` etc. win).

TCP only by default: it runs on any host, and a peer's death is seen through
its TCP connection. Pass ``ucx_options={"TLS": "all"}`` (or set ``UCX_TLS``)
to let UCX pick shared memory, RDMA or CUDA transports."""

PROGRESS_BURST = 256
"""Most ``progress`` calls per loop iteration while UCX keeps finding work."""

CLOSE_PERIOD_NS = 1_000_000_000
"""Bound passed to ucxx ``close_blocking`` (it applies with a progress thread only)."""

STALL_S = 3.0
"""A connection whose oldest send has not completed for this long is declared
broken. A live peer completes a send as soon as UCX has handed it to the
socket; only a dead connection, or a live peer that stopped reading for seconds
with megabytes queued towards it, stalls this long."""

READ_FAIL_GRACE_S = 2.0
"""After a read failed, how long to wait for UCX to release its requests
(so nothing writes into the reader's memory afterwards) before reporting."""

_NOTIFY = FrameKind.NOTIFY
"""Compared on every frame sent and received: a global, not an enum class lookup each time."""


@dataclass(slots=True)
class _Conn:
    """Our endpoint to one added peer."""

    key: int
    peer: PeerId
    ep: Any
    dead: bool = False
    sends: deque[tuple[Any, Any, bool, float]] = field(default_factory=deque)
    """(request, buffer, counted against the send budget, when sent), oldest first."""
    ready: bool = False
    queued: deque[tuple[FrameKind, bytes, bool]] = field(default_factory=deque)
    """Frames waiting for the connection (HELLO goes first once it is up)."""
    last_send: float = 0.0
    flush_req: int = 0
    connect_by: float = 0.0
    rkeys_packed: tuple[bytes, ...] = ()
    rkeys: list[int] = field(default_factory=list)
    retired_rkeys: list[int] = field(default_factory=list)
    waiting: list[ReadOp] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine starts; see :class:`~kvproto_transports.ucx.UcxTransport`."""

    local_peer: PeerId
    sender_key: int
    ucx_options: Mapping[str, str]
    connect_timeout_s: float
    probe_interval_s: float | None
    idle_wait_ms: int


class Steps:
    """The UCX objects of one transport endpoint and one step's work on them.

    Not thread-safe: one thread at a time calls it (see the module docstring).
    """

    def __init__(self, config: EngineConfig, shared: Shared) -> None:
        self._cfg = config
        self._shared = shared
        self.commands: deque[Command] = deque()
        """Queued by any thread (a deque's append and popleft are atomic), run by a step."""
        self.stopping = False
        """A ``Stop`` command ran, or the engine crashed: nothing moves any more."""
        self._api: Any = None
        self._array: Any = None
        self._ucp: Ucp | None = None
        self._ctx: Any = None
        self._worker: Any = None
        self._any_tag: Any = None
        self._no_mask: Any = None
        self._conns: dict[PeerId, _Conn] = {}
        self._stats = shared.stats
        """The counters: written only by a step (see :meth:`Engine.stats`)."""
        self._tags: dict[FrameKind, Any] = {}
        """Each kind's ucxx message tag from this endpoint, made once (in :meth:`setup`)
        rather than per frame."""
        self._next_key = 1
        self._closed_keys: list[int] = []
        self._senders: dict[int, PeerId] = {}
        self._rx: deque[tuple[Any, int, bytearray]] = deque()
        self._reads: dict[int, ReadOp] = {}
        self._memhs: list[int] = []
        self._reported: set[PeerId] = set()
        self._orphans: deque[tuple[Any, Any]] = deque()
        self._handshaking: set[int] = set()
        """Keys of connections whose wire-up flush is in flight (``_advance_connects``)."""
        self._probe_due = 0.0
        """No connection is idle for ``probe_interval_s`` before this (``_probe_idle``)."""

    # --- the worker ---------------------------------------------------------

    def setup(self) -> bytes:
        """Load UCX and make the context and worker; returns the worker's address."""
        self._api, self._array = load_ucxx()
        self._ucp = load_ucp()
        api = self._api
        options = {k: v for k, v in self._cfg.ucx_options.items() if f"UCX_{k}" not in os.environ}
        feats = (api.Feature.TAG, api.Feature.RMA, api.Feature.WAKEUP)
        self._ctx = api.UCXContext(options, feature_flags=feats)
        self._worker = api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._any_tag = api.UCXXTag(0)
        self._no_mask = api.UCXXTagMask(0)
        self._tags = {k: api.UCXXTag(make_tag(k, self._cfg.sender_key)) for k in FrameKind}
        return bytes(self._worker.address.tobytes())

    @property
    def running(self) -> bool:
        """Set up, and neither stopped nor torn down."""
        return self._worker is not None and not self.stopping

    @property
    def worker_handle(self) -> int:
        """The worker's handle, for :meth:`signal` (0 before setup and after teardown)."""
        return 0 if self._worker is None else int(self._worker.handle)

    @property
    def event_fd(self) -> int:
        """The worker's event fd: readable once UCX has an event, after :meth:`arm`."""
        return int(self._worker.epoll_file_descriptor)

    def arm(self) -> bool:
        """Arm the worker's event fd; False while UCX has events unprogressed (step again)."""
        return bool(self._worker.arm())

    def signal(self, worker_handle: int) -> None:
        """Wake a thread waiting on the event fd of the worker ``worker_handle`` (any thread)."""
        assert self._ucp is not None
        self._ucp.signal(worker_handle)

    def fail(self, reason: str) -> None:
        """The engine broke: nothing moves any more; every peer is reported lost."""
        self.stopping = True
        self._shared.fail(reason)
        for peer in list(self._conns):
            self._report_lost(peer, "local UCX engine crashed")

    def run_commands(self) -> None:
        """Carry out the queued commands, oldest first."""
        while self.commands:
            self._run(self.commands.popleft())

    def step(self) -> float:
        """One step: the queued commands, UCX's progress, arrivals, finished sends,
        connects and reads, probes, closed endpoints. Returns the monotonic time it
        used as "now"."""
        if self.commands:
            self.run_commands()
        now = time.monotonic()
        if self.stopping:
            return now
        # Drain what UCX has before the Python-level bookkeeping: a read over
        # TCP arrives as many fragments, and one loop iteration per fragment
        # cost several times the transfer itself (measured).
        progress_once = self._worker.progress_once
        for _ in range(PROGRESS_BURST):
            if not progress_once():
                break
        self._receive()
        # Every step of a polling caller comes here: skip what has nothing to do.
        for conn in list(self._conns.values()):
            if conn.sends:
                self._reap_sends(conn, now)
        while self._orphans and self._orphans[0][0].completed:
            self._orphans.popleft()
        if self._handshaking:
            self._advance_connects(now)
        if self._reads:
            self._advance_reads(now)
        if now >= self._probe_due:
            self._probe_idle(now)
        if self._closed_keys:
            self._handle_closed()
        return now

    # --- commands ----------------------------------------------------------

    def _run(self, cmd: Command) -> None:
        if isinstance(cmd, Send):
            self.send(cmd.peer, cmd.payload)
        elif isinstance(cmd, Read):
            self._start_read(cmd.op)
        elif isinstance(cmd, AddPeer):
            self._connect(cmd)
        elif isinstance(cmd, Refresh):
            self._refresh(cmd)
        elif isinstance(cmd, RemovePeer):
            conn = self._conns.get(cmd.peer)
            if conn is not None:
                self._drop_conn(conn, "peer removed")
        elif isinstance(cmd, Register):
            self._register(cmd)
        elif isinstance(cmd, Stop):
            self.stopping = True

    def _connect(self, cmd: AddPeer) -> None:
        old = self._conns.get(cmd.peer)
        if old is not None:
            if old.rkeys_packed != cmd.rkeys:
                self._refresh(Refresh(peer=cmd.peer, rkeys=cmd.rkeys))
            return
        self._reported.discard(cmd.peer)
        api = self._api
        try:
            address = api.UCXAddress.create_from_buffer(cmd.address)
            ep = api.UCXEndpoint.create_from_worker_address(self._worker, address, True)
        except Exception as exc:
            self._report_lost(cmd.peer, f"cannot connect: {type(exc).__name__}: {exc}")
            return
        key = self._next_key
        self._next_key += 1
        conn = _Conn(
            key=key,
            peer=cmd.peer,
            ep=ep,
            rkeys_packed=cmd.rkeys,
            connect_by=time.monotonic() + self._cfg.connect_timeout_s,
        )
        # A list's append, not a bound method: the endpoint must not reference the
        # engine, or the cycle leaves UCX objects to a later GC on another thread.
        ep.set_close_callback(self._closed_keys.append, cb_args=(key,))
        self._conns[cmd.peer] = conn
        assert self._ucp is not None
        started = self._ucp.flush(int(ep.handle))
        if started.request:
            conn.flush_req = started.request
            self._handshaking.add(conn.key)
        elif started.status != UCS_OK:
            self._lose(conn, f"connect: {self._ucp.status_text(started.status)}")
        else:
            self._connected(conn)

    def _refresh(self, cmd: Refresh) -> None:
        conn = self._conns.get(cmd.peer)
        if conn is None:
            return
        conn.rkeys_packed = cmd.rkeys
        if conn.ready:
            # Reads in flight may still use the old keys: destroy them with the endpoint.
            conn.retired_rkeys.extend(conn.rkeys)
            conn.rkeys = []
            self._unpack_rkeys(conn)

    def _register(self, cmd: Register) -> None:
        assert self._ucp is not None
        layout = cmd.layout
        cuda = layout.memory_kind == "VRAM"
        mapped: list[int] = []
        keys: list[bytes] = []
        try:
            for addr, block_len in zip(layout.region_addrs, layout.block_lens, strict=True):
                memh = self._ucp.mem_map(
                    self._ctx.handle, addr, block_len * layout.num_blocks, cuda=cuda
                )
                mapped.append(memh)
                keys.append(self._ucp.rkey_pack(self._ctx.handle, memh))
        except UcpError as exc:
            for memh in mapped:
                self._quiet(self._ucp.mem_unmap, self._ctx.handle, memh)
            cmd.result.set_exception(RegistrationError(f"UCX refused the memory: {exc}"))
            return
        self._memhs.extend(mapped)
        cmd.result.set_result(tuple(keys))

    # --- sending -------------------------------------------------------------

    def send(self, peer: PeerId, payload: bytes) -> None:
        """A notification counted against the send budget (its slot is taken)."""
        conn = self._conns.get(peer)
        if conn is None:
            # Lost or removed meanwhile: PeerLost was (or will be) reported instead.
            self._shared.release_send_slot()
            return
        self._send_frame(conn, _NOTIFY, payload, counted=True)

    def _send_frame(self, conn: _Conn, kind: FrameKind, body: bytes, *, counted: bool) -> None:
        if not conn.ready:
            # Nothing goes to ucxx before the endpoint is wired up: a send still
            # pending when such an endpoint is closed is never released by ucxx,
            # and with it the whole worker (measured: ~10 file descriptors leaked
            # per endpoint closed during its handshake).
            conn.queued.append((kind, body, counted))
            return
        # ucxx wants a writable buffer for an empty message; a bytes object otherwise.
        buf = self._array(body if body else bytearray(0))
        try:
            req = conn.ep.tag_send(buf, self._tags[kind])
        except Exception as exc:
            if counted:
                self._shared.release_send_slot()
            self._lose(conn, f"send: {type(exc).__name__}: {exc}")
            return
        conn.last_send = time.monotonic()
        conn.sends.append((req, buf, counted, conn.last_send))
        if kind is _NOTIFY:
            self._stats.notifications_sent += 1

    def _reap_sends(self, conn: _Conn, now: float) -> None:
        while conn.sends and conn.sends[0][0].completed:
            req, _buf, counted, _t = conn.sends.popleft()
            if counted:
                self._shared.release_send_slot()
            try:
                req.check_error()
            except Exception as exc:
                self._stats.send_failures += 1
                self._lose(conn, f"send failed: {type(exc).__name__}: {exc}")
                return
        if conn.sends and now - conn.sends[0][3] > STALL_S:
            # Measured: an endpoint whose peer vanished during the handshake can
            # keep every send (and get) pending forever without an error.
            self._lose(conn, f"nothing sent completed for {STALL_S} s")

    # --- receiving -------------------------------------------------------------

    def _receive(self) -> None:
        """Take every arrived message off the worker; deliver completed ones in order."""
        worker, rx = self._worker, self._rx
        any_tag, no_mask = self._any_tag, self._no_mask
        while True:
            probe = worker.tag_probe(any_tag, no_mask, remove=True)
            if not probe.matched:
                break
            buf = bytearray(probe.length)
            req = worker.tag_recv_with_handle(self._array(buf), probe)
            rx.append((req, probe.sender_tag.value, buf))
        while rx and rx[0][0].completed:
            req, tag, buf = rx.popleft()
            try:
                req.check_error()
            except Exception as exc:
                log.debug("UCX receive failed: %s", exc)
                continue
            self._on_frame(tag, buf)

    def _on_frame(self, tag: int, body: bytearray) -> None:
        kind, key = split_tag(tag)
        if kind == _NOTIFY:
            peer = self._senders.get(key)
            if peer is not None:
                self._stats.notifications_received += 1
                self._shared.events.append(Received(peer=peer, payload=bytes(body)))
                return
        if kind == FrameKind.PROBE:
            return
        if kind == FrameKind.HELLO:
            hello = decode_hello(bytes(body))
            if hello is None or hello.target != self._cfg.local_peer:
                # Meant for another incarnation (or garbage): its sender stays unknown.
                self._stats.hellos_refused += 1
                return
            self._stats.hellos_received += 1
            self._senders[key] = hello.sender
            return
        self._stats.frames_dropped += 1

    # --- connections and failures -------------------------------------------------

    def _advance_connects(self, now: float) -> None:
        assert self._ucp is not None
        for conn in list(self._conns.values()):
            if conn.ready or not conn.flush_req:
                continue
            status = self._ucp.check(conn.flush_req)
            if status == UCS_INPROGRESS:
                if now > conn.connect_by:
                    self._lose(conn, f"no connection within {self._cfg.connect_timeout_s} s")
                continue
            self._ucp.free(conn.flush_req)
            conn.flush_req = 0
            self._handshaking.discard(conn.key)
            if status != UCS_OK:
                self._lose(conn, f"connect: {self._ucp.status_text(status)}")
            else:
                self._connected(conn)

    def _probe_idle(self, now: float) -> None:
        """Send a PROBE on every connection idle for ``probe_interval_s``.

        A peer that died is noticed only when something is written to it
        (measured: an in-flight ``get`` to a dead holder otherwise waited
        forever); the probe turns that into an endpoint error within about two
        intervals.
        """
        interval = self._cfg.probe_interval_s
        if interval is None:
            self._probe_due = float("inf")
            return
        for conn in list(self._conns.values()):
            if conn.ready and now - conn.last_send >= interval:
                self._send_frame(conn, FrameKind.PROBE, b"", counted=False)
        # Sends only move last_send forward, and a connection that becomes ready
        # sends its HELLO (last_send = then): none is due before the oldest now is.
        oldest = min((c.last_send for c in self._conns.values() if c.ready), default=None)
        self._probe_due = 0.0 if oldest is None else oldest + interval

    def _connected(self, conn: _Conn) -> None:
        conn.ready = True
        self._send_frame(
            conn, FrameKind.HELLO, hello_body(self._cfg.local_peer, conn.peer), counted=False
        )
        queued, conn.queued = conn.queued, deque()
        for kind, body, counted in queued:
            self._send_frame(conn, kind, body, counted=counted)
        self._unpack_rkeys(conn)
        waiting, conn.waiting = conn.waiting, []
        for op in waiting:
            self._issue(conn, op)

    def _unpack_rkeys(self, conn: _Conn) -> None:
        assert self._ucp is not None
        try:
            conn.rkeys = [self._ucp.rkey_unpack(int(conn.ep.handle), k) for k in conn.rkeys_packed]
        except UcpError as exc:
            log.warning("cannot unpack remote keys of %s: %s", conn.peer, exc)
            conn.rkeys = []

    def _handle_closed(self) -> None:
        while self._closed_keys:
            key = self._closed_keys.pop(0)
            for conn in list(self._conns.values()):
                if conn.key == key:
                    self._lose(conn, self._ep_error(conn))

    @staticmethod
    def _ep_error(conn: _Conn) -> str:
        try:
            conn.ep.raise_on_error()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "endpoint closed"

    def _lose(self, conn: _Conn, reason: str) -> None:
        """The connection broke: report the peer lost (once) and drop the connection."""
        self._drop_conn(conn, reason)
        self._report_lost(conn.peer, reason)

    def _report_lost(self, peer: PeerId, reason: str) -> None:
        if peer in self._reported:
            return
        self._reported.add(peer)
        self._shared.mark_lost(peer, reason)
        self._stats.peers_lost += 1
        self._shared.events.append(PeerLost(peer=peer, reason=reason))

    def _drop_conn(self, conn: _Conn, reason: str) -> None:
        """Close our endpoint to a peer and fail its reads; reports nothing."""
        if conn.dead:
            return
        conn.dead = True
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]
        waiting, conn.waiting = conn.waiting, []
        for op in waiting:
            self._finish_read(op, failed=reason)
        for op in self._reads.values():
            if op.peer == conn.peer:
                self._fail_op(op, reason)
        self._close_ep(conn)

    def _close_ep(self, conn: _Conn) -> None:
        assert self._ucp is not None
        for rkey in conn.rkeys + conn.retired_rkeys:
            self._ucp.rkey_destroy(rkey)
        conn.rkeys, conn.retired_rkeys = [], []
        if conn.flush_req:
            self._ucp.free(conn.flush_req)  # UCX releases it when the flush ends
            conn.flush_req = 0
            self._handshaking.discard(conn.key)
        for _kind, _body, counted in conn.queued:
            if counted:
                self._shared.release_send_slot()
        conn.queued.clear()
        for req, buf, counted, _t in conn.sends:
            if counted:
                self._shared.release_send_slot()
            # UCX may still read the buffer until the send is cancelled: keep it alive.
            self._orphans.append((req, buf))
        conn.sends.clear()
        self._quiet(conn.ep.remove_close_callback)
        self._quiet(conn.ep.close_blocking, CLOSE_PERIOD_NS, 1)

    # --- reads ---------------------------------------------------------------------

    def _start_read(self, op: ReadOp) -> None:
        if op.write:
            self._stats.writes_started += 1
        else:
            self._stats.reads_started += 1
        conn = self._conns.get(op.peer)
        if conn is None:
            self._finish_read(op, failed=f"peer {op.peer} is not connected")
        elif not op.segments:
            # Nothing to move (full prefix hit): only tell the holder.
            if op.notify is not None:
                self._send_frame(conn, FrameKind.NOTIFY, op.notify, counted=False)
            self._finish_read(op, failed=None)
        elif not conn.ready:
            conn.waiting.append(op)
        else:
            self._issue(conn, op)

    def _issue(self, conn: _Conn, op: ReadOp) -> None:
        assert self._ucp is not None
        self._reads[op.read_id] = op
        if len(conn.rkeys) <= max(seg.region for seg in op.segments):
            self._fail_op(op, f"peer {op.peer} advertised no usable remote keys")
            return
        handle = int(conn.ep.handle)
        issued = 0
        move, what = (self._ucp.put, "put") if op.write else (self._ucp.get, "get")
        try:
            for seg in op.segments:
                started = move(
                    handle, seg.local_addr, seg.length, seg.remote_addr, conn.rkeys[seg.region]
                )
                issued += 1
                if started.request:
                    op.requests.append(started.request)
                elif started.status != UCS_OK:
                    self._fail_op(op, f"{what}: {self._ucp.status_text(started.status)}")
                    return
            if op.write:
                # Remote completion: the flush ends once every put landed at the peer.
                started = self._ucp.flush(handle)
                if started.request:
                    op.requests.append(started.request)
                elif started.status != UCS_OK:
                    self._fail_op(op, f"flush: {self._ucp.status_text(started.status)}")
        finally:
            # Counted once for the whole transfer (a scattered 64-block read of 8
            # regions is 512 gets), and also when one failed or raised midway.
            if op.write:
                self._stats.puts_issued += issued
            else:
                self._stats.gets_issued += issued

    def _fail_op(self, op: ReadOp, reason: str) -> None:
        if op.failed is None:
            op.failed = reason
            op.fail_by = time.monotonic() + READ_FAIL_GRACE_S

    def _advance_reads(self, now: float) -> None:
        assert self._ucp is not None
        for op in list(self._reads.values()):
            still: list[int] = []
            for req in op.requests:
                status = self._ucp.check(req)
                if status == UCS_INPROGRESS:
                    still.append(req)
                    continue
                self._ucp.free(req)
                if status != UCS_OK:
                    what = "put" if op.write else "get"
                    self._fail_op(op, f"{what}: {self._ucp.status_text(status)}")
            op.requests = still
            # A failed read is reported after a grace even with requests left (cancelled
            # here); a write only once UCX released them all (see the module docstring).
            if still and (op.write or not (op.failed is not None and now > op.fail_by)):
                continue
            for req in still:  # overdue after a failure: cancel, UCX frees them later
                self._ucp.cancel(self._worker.handle, req)
                self._ucp.free(req)
            op.requests = []
            del self._reads[op.read_id]
            if op.failed is None and op.notify is not None:
                conn = self._conns.get(op.peer)
                if conn is not None:
                    # After the data landed: the holder may free the blocks on it.
                    self._send_frame(conn, FrameKind.NOTIFY, op.notify, counted=False)
            self._finish_read(op, failed=op.failed)

    def _finish_read(self, op: ReadOp, *, failed: str | None) -> None:
        count(self._stats, write=op.write, failed=failed)
        self._shared.events.append(outcome(op.read_id, write=op.write, failed=failed))

    # --- teardown ----------------------------------------------------------------------

    def teardown(self) -> None:
        """Cancel and close everything, then drop the worker and context (on this thread)."""
        ucp = self._ucp
        for op in list(self._reads.values()):
            for req in op.requests:
                if ucp is not None and self._worker is not None:
                    self._quiet(ucp.cancel, self._worker.handle, req)
                    self._quiet(ucp.free, req)
            op.requests = []
        self._reads.clear()
        for conn in list(self._conns.values()):
            conn.dead = True
            self._quiet(self._close_ep, conn)
        self._conns.clear()
        if self._worker is not None:
            # ucxx keeps requests it has not seen complete in lists owned by the
            # worker and its endpoints, and a request holds its endpoint, which
            # holds the worker: a C++ reference cycle. Left alone, the worker,
            # its sockets and file descriptors outlive close() (measured: a peer
            # connected to it then hung on a silently open socket).
            self._quiet(self._worker.cancel_inflight_requests, CLOSE_PERIOD_NS, 3)
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:  # let cancellations and closes complete
                self._worker.progress()
                time.sleep(0.001)
        if ucp is not None and self._ctx is not None:
            for memh in self._memhs:
                self._quiet(ucp.mem_unmap, self._ctx.handle, memh)
        self._memhs.clear()
        self._orphans.clear()
        self._rx.clear()
        # Destroy the worker and context here, on the thread that used them.
        t0 = time.monotonic()
        self._worker = None
        self._ctx = None
        self._any_tag = self._no_mask = None
        self._tags = {}
        log.debug(
            "UCX worker and context of %s destroyed in %.3f s",
            self._cfg.local_peer,
            time.monotonic() - t0,
        )

    @staticmethod
    def _quiet(fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception as exc:  # teardown of a half-gone resource: nothing to do
            log.debug("UCX cleanup step failed: %s", exc)
