"""NixlTransport: the kvproto Transport protocol over a real NIXL agent.

Flow (vLLM's, spec/vllm-api.md §9): ``register_blocks`` registers every region once and prepares
the local descriptor list ``num_regions x num_blocks``
(``desc_id = region * num_blocks + block``); ``add_peer`` loads a peer's NIXL
agent metadata and remembers its layout; the remote descriptor list for a
(peer, slice) pair is prepared on first use and cached; ``read_blocks`` issues
one READ covering every region with the done notification attached
(``notif_msg``), which NIXL delivers to the holder only after the transfer.
``write_blocks`` (push mode) is the same transfer as a WRITE: NIXL's UCX backend
flushes the endpoint after a transfer's last operation and sends the notification
only after that flush (``postXfer`` in ``src/plugins/ucx/ucx_backend.cpp``), so the
holder sees the notification after the data is in its memory, and the transfer is
DONE only on remote completion.

Threads: every call that touches NIXL must come from the owner thread (the
creator, or whoever called :meth:`NixlTransport.adopt_current_thread`);
other threads get :class:`~kvproto_transports.nixl.errors.WrongThread`. The
read-only properties ``name``, ``capabilities`` and ``local_peer`` are safe
anywhere.

Peer failure: NIXL reports a dead peer (``NIXL_ERR_REMOTE_DISCONNECT``) when
something is sent to it or a transfer with it is checked. A failed send raises
:class:`~kvproto.transport.PeerUnreachable` *and* queues
:class:`~kvproto.transport.PeerLost`; a failed transfer state check yields
``ReadFailed`` plus ``PeerLost``. Nothing is learnt about a silent peer, hence
:meth:`NixlTransport.probe_peers`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    MemoryNotRegistered,
    PeerId,
    PeerLost,
    PeerUnreachable,
    ReadId,
    Received,
    ThreadAffinity,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)

from ..read_args import check_block_counts, check_notify, check_regions, region_spans
from ..transfers import Transfers, count, outcome
from ._library import NixlApi, load_nixl, make_agent
from .descriptor_ids import DescriptorIds
from .errors import RegistrationError, WrongThread
from .wire import (
    WIRE_KIND,
    WIRE_VERSION,
    EndpointMetadata,
    decode_metadata,
    encode_metadata,
    layout_to_wire,
)

PROBE_PAYLOAD = b"\x00kvproto.nixl.probe\x00"
"""What :meth:`NixlTransport.probe_peers` sends; a receiving NixlTransport drops it.

Other receivers (the lease core) ignore it as an unknown frame. Do not probe a
stock vLLM peer: its parser raises on anything without a ``:``.
"""

PROBE_DETECTION_SLACK_S = 0.5
"""What the declared failure-detection bound adds to the auto-probe period: a send to a
kill -9'd process fails within a few ms here, the rest is room for a loaded caller."""

DEFAULT_MAX_NOTIFICATION_SIZE = 1 << 20
"""1 MiB. UCX itself carried 16 MiB notifications here; the cap keeps one
notification from monopolising the progress thread and matches no backend
limit (UCCL's is 256 B: pass ``max_notification_size=256`` for it)."""
DEFAULT_PROGRESS_WAIT_US = 10_000
"""10 ms: the progress thread's periodic wake-up when nothing arrives (a message wakes it
at once). Idle, it costs 0.005 CPU-s per s here, 0.03 at 1 ms; a READ of a holder whose
own thread sleeps took 0.05 ms at the median either way."""

_INIT_AGENT = "NIXL_INIT_AGENT"


@dataclass(slots=True)
class NixlStats:
    """Counters of one endpoint; :attr:`NixlTransport.stats` returns a copy."""

    notifications_sent: int = 0
    """Successful ``send_notif`` calls (probes included)."""
    notifications_received: int = 0
    """Notifications reported as :class:`Received`."""
    received_from_unknown: int = 0
    """Of those, sent by an agent that was never added (junk, or a peer not yet added)."""
    probes_sent: int = 0
    """Liveness probes sent."""
    probes_dropped: int = 0
    """Liveness probes received and dropped."""
    send_failures: int = 0
    """``send_notif`` calls that raised."""
    reads_started: int = 0
    """Reads issued (zero-block reads included)."""
    reads_completed: int = 0
    """:class:`ReadCompleted` reported."""
    reads_failed: int = 0
    """:class:`ReadFailed` reported."""
    writes_started: int = 0
    """Writes issued (push mode; zero-block writes included)."""
    writes_completed: int = 0
    """:class:`WriteCompleted` reported."""
    writes_failed: int = 0
    """:class:`WriteFailed` reported."""
    peers_lost: int = 0
    """:class:`PeerLost` reported."""
    remote_dlists_prepared: int = 0
    """Remote descriptor lists prepared (one per peer and slice, then cached)."""


@dataclass(slots=True)
class _Peer:
    name: PeerId
    raw: bytes
    layout: BlockLayout | None
    dlists: dict[BlockSlice, Any] = field(default_factory=dict)
    lost: str | None = None
    ids: DescriptorIds | None = None
    """Descriptor indices of the peer's layout (built on the first read)."""
    routes: dict[tuple[BlockSlice, BlockSlice], _Route] = field(default_factory=dict)
    """(local, remote) slices already checked against both layouts, with what a READ
    between them needs: one lookup a read (released with ``dlists``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Route:
    """Everything a READ between one pair of slices uses that does not depend on its blocks."""

    local_ids: DescriptorIds
    """This endpoint's layout's descriptor indices."""
    remote_ids: DescriptorIds
    """The peer's layout's descriptor indices."""
    local_dlist: Any
    """The local prepared descriptor list of the local slice."""
    remote_dlist: Any
    """The peer's prepared descriptor list of the remote slice."""


@dataclass(slots=True)
class _Read:
    peer: PeerId
    handle: Any
    write: bool = False
    """A WRITE (push mode): reported as WriteCompleted / WriteFailed."""


class NixlTransport(Transfers):
    """One NIXL agent as a kvproto transport endpoint. See the module docstring."""

    def __init__(
        self,
        *,
        name_prefix: str = "kvproto",
        backends: Sequence[str] = ("UCX",),
        max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE,
        auto_probe_interval_s: float | None = None,
        filter_probes: bool = True,
        progress_thread: bool | None = None,
        progress_wait_us: int = DEFAULT_PROGRESS_WAIT_US,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the agent (named ``{name_prefix}-{random}``: a new name per incarnation).

        ``auto_probe_interval_s``: if set, ``poll`` calls :meth:`probe_peers` at
        most this often, so a dead peer surfaces within about that interval
        even when the binding has nothing to send to it.

        ``progress_thread``: NIXL's UCX progress thread (the NIXL default, and
        vLLM's) lets a holder serve READs while it is busy. Without it
        (``False``) transfers and notifications progress only inside this
        endpoint's calls, so the holder must ``poll`` every tick: measured
        here, a 4 MiB READ took 14.5 ms with the thread and 1.47 s against a
        holder that slept 1.5 s without it. Over TCP a READ is emulated (the
        holder's UCX sends the data back), and a holder that does not progress
        while READs of a peer that dies queue in its socket is aborted by UCX
        when it answers them (``ucp_request.inl: Fatal: unexpected error:
        Endpoint timeout``; tests/transports/nixl/test_nixl_busy_holder.py): the
        thread answers them as they arrive. ``None`` reads
        ``KVPROTO_NIXL_PROGRESS_THREAD`` (``0`` = off), default on.

        ``progress_wait_us``: the longest the progress thread sleeps when no
        message wakes it (NIXL's ``pthrDelay``; :func:`._library.make_agent`).
        NIXL's Python API leaves it at 0, a thread that spins a core per agent.
        """
        self._api: NixlApi = load_nixl()
        self._owner = threading.get_ident()
        self._name: PeerId = f"{name_prefix}-{uuid.uuid4().hex[:16]}"
        if progress_thread is None:
            progress_thread = os.environ.get("KVPROTO_NIXL_PROGRESS_THREAD", "1") != "0"
        self.progress_thread = progress_thread
        """Whether NIXL's progress thread runs (see the constructor)."""
        if progress_wait_us < 0:
            raise LocalProtocolError(f"progress_wait_us must be >= 0, not {progress_wait_us}")
        config = self._api.config_cls(enable_prog_thread=progress_thread, backends=list(backends))
        self._agent: Any = make_agent(
            self._api, self._name, config, progress_wait_us=progress_wait_us
        )
        self._max = max_notification_size
        self._probe_interval = auto_probe_interval_s
        self._filter_probes = filter_probes
        self._clock = clock
        self._last_probe = clock()
        self._caps = Capabilities(
            max_notification_size=max_notification_size,
            # Standalone notifications arrived in order here, but NIXL does not
            # promise it, and a READ's notification travels when the READ ends.
            ordered=False,
            may_duplicate=False,
            detects_peer_failure=True,
            # Measured: a send to a kill -9'd process fails within a few ms; the
            # bound holds only when something is sent (auto-probe or binding).
            failure_detection_bound_s=(
                None
                if auto_probe_interval_s is None
                else auto_probe_interval_s + PROBE_DETECTION_SLACK_S
            ),
            one_sided_reads=True,
            thread_affinity=ThreadAffinity.OWNER,
            writes=True,
        )
        self._layout: BlockLayout | None = None
        self._local_ids: DescriptorIds | None = None
        self._reg_descs: Any = None
        self._local_dlists: dict[BlockSlice, Any] = {}
        self._peers: dict[PeerId, _Peer] = {}
        self._reads: dict[ReadId, _Read] = {}
        self._events: deque[TransportEvent] = deque()
        self._next_read: ReadId = 1
        self._metadata: bytes | None = None
        self._closed = False
        self._stats = NixlStats()

    # --- identity --------------------------------------------------------

    @property
    def name(self) -> str:
        """``"nixl"``."""
        return "nixl"

    @property
    def capabilities(self) -> Capabilities:
        """What this endpoint promises (see the constructor for the probe bound)."""
        return self._caps

    @property
    def local_peer(self) -> PeerId:
        """The NIXL agent name; new for every incarnation."""
        return self._name

    @property
    def stats(self) -> NixlStats:
        """A copy of the counters."""
        return replace(self._stats)

    @property
    def layout(self) -> BlockLayout | None:
        """The registered layout, if any."""
        return self._layout

    def adopt_current_thread(self) -> None:
        """Make the calling thread the owner (hand-over after construction elsewhere).

        The caller guarantees the old owner no longer uses the endpoint.
        """
        self._owner = threading.get_ident()

    def metadata(self) -> bytes:
        """NIXL agent metadata plus the registered layout, msgpack-encoded."""
        self._check()
        if self._metadata is None:
            self._metadata = encode_metadata(
                EndpointMetadata(
                    kind=WIRE_KIND,
                    version=WIRE_VERSION,
                    agent_name=self._name,
                    agent_metadata=bytes(self._agent.get_agent_metadata()),
                    layout=None if self._layout is None else layout_to_wire(self._layout),
                )
            )
        return self._metadata

    # --- peers -----------------------------------------------------------

    def add_peer(self, metadata: bytes) -> PeerId:
        """Load a peer's agent metadata; idempotent, and refreshes a peer whose metadata grew."""
        self._check()
        meta, layout = decode_metadata(bytes(metadata))
        return self._load(meta.agent_name, meta.agent_metadata, layout, bytes(metadata))

    def add_nixl_agent(self, agent_metadata: bytes, layout: BlockLayout | None) -> PeerId:
        """Add a peer from bare NIXL agent metadata and its layout, not from ``metadata()``.

        For peers that are not NixlTransports, e.g. a stock vLLM engine whose
        handshake payload carries ``agent_metadata`` and the KV layout fields.
        """
        self._check()
        raw = bytes(agent_metadata) + repr(layout).encode()
        return self._load(None, bytes(agent_metadata), layout, raw)

    def _load(
        self, expected: str | None, agent_md: bytes, layout: BlockLayout | None, raw: bytes
    ) -> PeerId:
        if expected == self._name:
            raise BadMetadata("this is the endpoint's own metadata")
        old = self._peers.get(expected) if expected is not None else None
        if old is not None and old.raw == raw and old.lost is None:
            return old.name
        try:
            loaded = self._agent.add_remote_agent(agent_md)
        except self._api.error_types as exc:
            raise BadMetadata(f"NIXL refused the agent metadata: {_describe(exc)}") from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if expected is not None and name != expected:
            # The envelope names one agent and the NIXL blob another: refuse it, and
            # forget the blob's agent unless it is a peer we already trust.
            if name not in self._peers:
                self._invalidate(name)
            raise BadMetadata(f"metadata names {expected!r} but carries {name!r}")
        old = self._peers.get(name)
        if old is not None:
            if old.raw == raw and old.lost is None:
                return name  # the same peer again: keep its prepared lists
            self._release_dlists(old)
        self._peers[name] = _Peer(name=name, raw=raw, layout=layout)
        return name

    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer and disconnect from it; its in-flight reads fail. Idempotent."""
        self._check()
        state = self._peers.pop(peer, None)
        if state is None:
            return
        self._fail_reads_of(peer, "peer removed")
        self._release_dlists(state)
        if state.lost is None:
            self._invalidate(peer)

    # --- notifications ---------------------------------------------------

    def send(self, peer: PeerId, payload: bytes) -> None:
        """``send_notif``; a NIXL error marks the peer lost and raises PeerUnreachable."""
        if self._closed or threading.get_ident() != self._owner:
            self._check()  # raises: closed, or not the owner thread (written out, as in poll)
        if self._max is not None and len(payload) > self._max:
            raise FrameTooLarge(f"{len(payload)} bytes > max_notification_size {self._max}")
        self._send(self._peer(peer), bytes(payload))

    def probe_peers(self) -> int:
        """Send :data:`PROBE_PAYLOAD` to every live peer; returns how many were probed.

        Cost: one ``send_notif`` of 20 bytes per live peer (a few microseconds
        each on loopback, one small UCX active message on a network). A dead
        peer fails the send at once and is reported as :class:`PeerLost` by the
        next ``poll``. Only probe peers that run a kvproto endpoint.
        """
        self._check()
        self._last_probe = self._clock()
        probed = 0
        for state in list(self._peers.values()):
            if state.lost is not None:
                continue
            with contextlib.suppress(PeerUnreachable):  # reported by poll as PeerLost
                self._send(state, PROBE_PAYLOAD)
            probed += 1
            self._stats.probes_sent += 1
        return probed

    def poll(self) -> Sequence[TransportEvent]:
        """Drain notifications and check in-flight reads; never blocks."""
        # _check's two tests written out, and _check_reads called only with reads in
        # flight: an engine polls at every step, where each Python call costs a few
        # microseconds cold (spec/benchmarks.md, "vLLM step").
        if self._closed or threading.get_ident() != self._owner:
            self._check()  # raises: closed, or not the owner thread
        if (
            self._probe_interval is not None
            and self._clock() - self._last_probe >= self._probe_interval
        ):
            self.probe_peers()
        self._drain_notifications()
        if self._reads:
            self._check_reads()
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def progress(self) -> None:
        """Drive NIXL without taking events: they wait for the next ``poll``.

        For a caller that holds several endpoints on one thread without NIXL's
        progress thread and polls only some of them at a time (the conformance
        kit's group): the others' sends and served READs still move.
        """
        if self._closed or threading.get_ident() != self._owner:
            self._check()  # raises: closed, or not the owner thread (written out, as in poll)
        self._drain_notifications()
        if self._reads:
            self._check_reads()

    # --- memory and reads ------------------------------------------------

    def register_blocks(self, layout: BlockLayout) -> None:
        """Register every region of ``layout`` (DRAM or VRAM) and prepare the local list.

        The memory must stay allocated until :meth:`close` (which deregisters
        it): NIXL crashed the process when memory freed under it was deregistered.
        """
        self._check()
        if self._layout is not None:
            raise RegistrationError("memory is already registered on this endpoint")
        regions = [
            (addr, block_len * layout.num_blocks, layout.device_id, "")
            for addr, block_len in zip(layout.region_addrs, layout.block_lens, strict=True)
        ]
        try:
            self._reg_descs = self._agent.register_memory(regions, layout.memory_kind)
        except self._api.error_types as exc:
            raise RegistrationError(
                f"NIXL refused {layout.memory_kind} memory: {_describe(exc)}"
            ) from exc
        try:
            self._local_dlists[BlockSlice.FULL] = self._prep(_INIT_AGENT, layout, BlockSlice.FULL)
        except self._api.error_types as exc:
            _quiet(self._agent.deregister_memory, self._reg_descs)
            self._reg_descs = None
            raise RegistrationError(
                f"NIXL refused the local descriptors: {_describe(exc)}"
            ) from exc
        self._layout = layout
        self._local_ids = DescriptorIds(layout)
        self._metadata = None  # the agent metadata now carries the memory keys

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
        """One READ (or WRITE) of the given blocks of every region; see the module docstring
        for why a write's notify follows its data."""
        if self._closed or threading.get_ident() != self._owner:
            self._check()  # raises: closed, or not the owner thread (written out, as in poll)
        check_notify(notify, self._max)
        state = self._peer(peer)
        if state.lost is not None:
            raise PeerUnreachable(f"peer {peer} is lost: {state.lost}")
        check_block_counts(local_blocks, remote_blocks)
        if not local_blocks:
            # Full prefix hit: nothing to move, only tell the holder (spec/vllm-api.md §9.3).
            if notify is not None:
                self._send(state, bytes(notify))
            read_id = self._new_read_id(write)
            self._reads[read_id] = _Read(peer=peer, handle=None, write=write)
            self._finish_read(read_id, failed=None)
            return read_id
        route = state.routes.get((local_slice, remote_slice))
        if route is None:
            route = self._route(state, local_slice, remote_slice)
        try:
            local_ids = route.local_ids.of(local_blocks)
            remote_ids = route.remote_ids.of(remote_blocks)
        except LocalProtocolError as exc:
            raise MemoryNotRegistered(str(exc)) from exc
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE" if write else "READ",
                route.local_dlist,
                local_ids,
                route.remote_dlist,
                remote_ids,
                notif_msg=b"" if notify is None else bytes(notify),
            )
        except self._api.disconnect_error as exc:
            self._lose(state, _describe(exc))
            raise PeerUnreachable(f"peer {peer}: {_describe(exc)}") from exc
        except self._api.error_types as exc:
            raise MemoryNotRegistered(f"NIXL refused the read: {_describe(exc)}") from exc
        read_id = self._new_read_id(write)
        self._reads[read_id] = _Read(peer=peer, handle=handle, write=write)
        try:
            posted = self._agent.transfer(handle)
        except self._api.disconnect_error as exc:
            # Reported like any failed transfer, through poll.
            self._finish_read(read_id, failed=_describe(exc))
            self._lose(state, _describe(exc))
            return read_id
        except self._api.error_types as exc:
            self._finish_read(read_id, failed=_describe(exc))
            return read_id
        if posted == "DONE":
            self._finish_read(read_id, failed=None)
        elif posted == "ERR":
            self._finish_read(read_id, failed="transfer() returned ERR")
        return read_id

    def close(self) -> None:
        """Release handles, memory and remote agents; idempotent."""
        if self._closed:
            return
        self._check_thread()
        self._closed = True
        for read in self._reads.values():
            _quiet(self._agent.release_xfer_handle, read.handle)
        self._reads.clear()
        for state in self._peers.values():
            self._release_dlists(state)
            if state.lost is None:
                self._invalidate(state.name)
        self._peers.clear()
        for handle in self._local_dlists.values():
            _quiet(self._agent.release_dlist_handle, handle)
        self._local_dlists.clear()
        if self._reg_descs is not None:
            _quiet(self._agent.deregister_memory, self._reg_descs)
            self._reg_descs = None
        self._events.clear()
        self._agent = None

    def abort(self) -> None:
        """Drop the agent with no goodbye at all (no invalidation, no deregistration).

        The nearest in-process stand-in for ``kill -9``: once the last handle is
        gone the UCX worker is destroyed and its connections close under the
        peers' feet. The hook a conformance kit's ``kill`` calls
        (spec/transport-authors.md); serving code calls :meth:`close`.
        """
        self._closed = True
        self._reads.clear()
        for state in self._peers.values():
            state.routes.clear()
            state.dlists.clear()
        self._peers.clear()
        self._local_dlists.clear()
        self._events.clear()
        self._agent = None

    # --- internals -------------------------------------------------------

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThread(
                f"NixlTransport {self._name} is owned by thread {self._owner}, "
                f"called from {threading.get_ident()}"
            )

    def _check(self) -> None:
        self._check_thread()
        if self._closed:
            raise TransportClosed(f"NixlTransport {self._name} is closed")

    def _new_read_id(self, write: bool) -> ReadId:
        read_id = self._next_read
        self._next_read += 1
        if write:
            self._stats.writes_started += 1
        else:
            self._stats.reads_started += 1
        return read_id

    def _peer(self, peer: PeerId) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            raise UnknownPeer(f"unknown peer {peer!r}")
        return state

    def _send(self, state: _Peer, payload: bytes) -> None:
        if state.lost is not None:
            raise PeerUnreachable(f"peer {state.name} is lost: {state.lost}")
        try:
            self._agent.send_notif(state.name, payload)
        except self._api.error_types as exc:
            self._stats.send_failures += 1
            self._lose(state, _describe(exc))
            raise PeerUnreachable(f"send to {state.name} failed: {_describe(exc)}") from exc
        self._stats.notifications_sent += 1
        if not self.progress_thread:
            # Nothing else drives UCX here: push the message out now rather than
            # at the next poll (what arrives meanwhile is queued for poll).
            self._drain_notifications()

    def _lose(self, state: _Peer, reason: str) -> None:
        """Report the peer once, fail its reads, and drop NIXL's view of it."""
        if state.lost is not None:
            return
        state.lost = reason
        self._stats.peers_lost += 1
        self._events.append(PeerLost(peer=state.name, reason=reason))
        self._fail_reads_of(state.name, f"peer lost: {reason}")
        self._release_dlists(state)
        self._invalidate(state.name)

    def _fail_reads_of(self, peer: PeerId, reason: str) -> None:
        for read_id in [rid for rid, read in self._reads.items() if read.peer == peer]:
            self._finish_read(read_id, failed=reason)

    def _finish_read(self, read_id: ReadId, *, failed: str | None) -> None:
        read = self._reads.pop(read_id)
        # Releasing an active transfer asks NIXL to cancel it; it may refuse. _quiet's
        # suppression written out: this runs once every read, and contextlib.suppress
        # is a context manager's two calls. (No handle: a zero-block transfer.)
        try:
            if read.handle is not None:
                self._agent.release_xfer_handle(read.handle)
        except Exception:  # NIXL logs its own error; the read's outcome stands
            pass
        count(self._stats, write=read.write, failed=failed)
        self._events.append(outcome(read_id, write=read.write, failed=failed))

    def _check_reads(self) -> None:
        # Its callers (poll, progress) call it only with reads in flight.
        for read_id, read in list(self._reads.items()):
            if read_id not in self._reads:  # failed by a _lose earlier in this loop
                continue
            try:
                status = self._agent.check_xfer_state(read.handle)
            except self._api.disconnect_error as exc:
                self._finish_read(read_id, failed=_describe(exc))
                lost = self._peers.get(read.peer)
                if lost is not None:
                    self._lose(lost, _describe(exc))
                continue
            except self._api.error_types as exc:
                self._finish_read(read_id, failed=_describe(exc))
                continue
            if status == "DONE":
                self._finish_read(read_id, failed=None)
            elif status != "PROC":
                self._finish_read(read_id, failed=f"transfer state {status}")

    def _drain_notifications(self) -> None:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        for sender, messages in notifs.items():
            peer = sender.decode() if isinstance(sender, bytes) else str(sender)
            known = peer in self._peers
            for message in messages:
                if self._filter_probes and message == PROBE_PAYLOAD:
                    self._stats.probes_dropped += 1
                    continue
                self._stats.notifications_received += 1
                if not known:
                    self._stats.received_from_unknown += 1
                self._events.append(Received(peer=peer, payload=bytes(message)))

    def _route(self, state: _Peer, local_slice: BlockSlice, remote_slice: BlockSlice) -> _Route:
        """Check a slice pair against both layouts and cache what READs between them use.

        Both layouts are fixed for the life of this _Peer, so a pair is checked once;
        nothing is cached if a check or a descriptor list fails.
        """
        local = self._layout
        if local is None or self._local_ids is None:
            raise MemoryNotRegistered("no local memory registered")
        remote = state.layout
        if remote is None:
            raise MemoryNotRegistered(f"peer {state.name} advertised no registered memory")
        check_regions(local, remote)
        for region in range(local.num_regions):
            region_spans(local, remote, region, local_slice, remote_slice)
        if state.ids is None:
            state.ids = DescriptorIds(remote)
        route = _Route(
            local_ids=self._local_ids,
            remote_ids=state.ids,
            local_dlist=self._local_dlist(local_slice),
            remote_dlist=self._remote_dlist(state, remote_slice),
        )
        state.routes[local_slice, remote_slice] = route
        return route

    def _local_dlist(self, block_slice: BlockSlice) -> Any:
        handle = self._local_dlists.get(block_slice)
        if handle is None:
            assert self._layout is not None
            handle = self._prep_or_raise(_INIT_AGENT, self._layout, block_slice)
            self._local_dlists[block_slice] = handle
        return handle

    def _remote_dlist(self, state: _Peer, block_slice: BlockSlice) -> Any:
        handle = state.dlists.get(block_slice)
        if handle is None:
            assert state.layout is not None
            handle = self._prep_or_raise(state.name, state.layout, block_slice)
            state.dlists[block_slice] = handle
            self._stats.remote_dlists_prepared += 1
        return handle

    def _prep_or_raise(self, agent: str, layout: BlockLayout, block_slice: BlockSlice) -> Any:
        try:
            return self._prep(agent, layout, block_slice)
        except self._api.error_types as exc:
            where = "local" if agent == _INIT_AGENT else f"peer {agent}"
            raise MemoryNotRegistered(
                f"{where} memory is not registered for these descriptors: {_describe(exc)}"
            ) from exc

    def _prep(self, agent: str, layout: BlockLayout, block_slice: BlockSlice) -> Any:
        descs = np.array(layout.descriptors(block_slice), dtype=np.uint64).reshape(-1, 2)
        rows = np.empty((descs.shape[0], 3), dtype=np.uint64)
        rows[:, :2] = descs
        rows[:, 2] = layout.device_id
        return self._agent.prep_xfer_dlist(agent, rows, layout.memory_kind)

    def _release_dlists(self, state: _Peer) -> None:
        state.routes.clear()  # they hold the handles released here
        for handle in state.dlists.values():
            _quiet(self._agent.release_dlist_handle, handle)
        state.dlists.clear()

    def _invalidate(self, agent: str) -> None:
        _quiet(self._agent.remove_remote_agent, agent)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _quiet(fn: Callable[..., object], *args: object) -> None:
    """Cleanup that must not mask the real outcome (NIXL logs its own error)."""
    with contextlib.suppress(Exception):  # a dead or half-gone resource: nothing to do
        fn(*args)
