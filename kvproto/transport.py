"""The Transport protocol: what a binding must offer the lease protocol.

The core never calls a transport. A *binding* (the small piece of code that
owns the clock and the I/O, like aioquic's ``asyncio/protocol.py``) feeds
what a transport reports into the core and carries out the commands the core
returns through a transport. This module only defines the shape every
transport implements, so that NIXL, UCX, the in-process loopback and
third-party transports are interchangeable and can all be run through the
conformance kit (``kvproto_transports.conformance``).

Model
-----
* A transport endpoint has a name (``local_peer``) that is stable for the
  life of one incarnation and an opaque ``metadata()`` blob that another
  endpoint passes to ``add_peer`` to be able to reach it (NIXL's agent
  metadata, a UCX worker address, a loopback registry key).
* Notifications are small, unordered-or-ordered, possibly-duplicated byte
  messages (NIXL ``send_notif``). ``send`` never blocks; a payload larger than
  ``capabilities.max_notification_size`` is refused with
  :class:`FrameTooLarge`, never truncated.
* ``poll`` never blocks and returns what happened since the last call:
  received notifications, completed or failed reads, lost peers.
* Memory is registered once as a :class:`~kvproto.tpmath.BlockLayout`
  (regions x blocks). ``read_blocks`` issues one one-sided READ of the given
  blocks of every region from a peer into local blocks, and attaches a
  notification that the *holder* receives only after the data left its
  memory (NIXL ``notif_msg``). Heterogeneous tensor parallelism is expressed
  with :class:`~kvproto.tpmath.BlockSlice` on both sides.
* A transport that also writes (push mode, spec/push-mode.md) is a
  :class:`WritableTransport`: ``write_blocks`` issues one one-sided WRITE of
  local blocks into a peer's blocks with a notification the peer receives only
  after the data is in its memory; it reports :class:`WriteCompleted` only once
  the data is there (remote completion) and :class:`WriteFailed` only once none
  of it can land any more.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvproto.errors import RemoteProtocolError
from kvproto.tpmath import BlockLayout, BlockSlice

PeerId = str
"""A transport-level peer name, stable within one incarnation of that peer."""

ReadId = int
"""A handle for one issued read, unique within one transport endpoint."""

WriteId = int
"""A handle for one issued write, unique within one transport endpoint (reads and writes
of an endpoint may share one counter)."""


class ThreadAffinity(enum.Enum):
    """Which threads may call a transport's methods."""

    ANY = "any"
    """Every method may be called from any thread."""
    OWNER = "owner"
    """Every method must be called from the thread that created the endpoint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a transport declares about itself; the conformance kit holds it to this."""

    max_notification_size: int | None
    """Largest payload ``send`` accepts, in bytes; ``None`` means unbounded."""
    ordered: bool
    """Notifications between one pair of endpoints arrive in send order."""
    may_duplicate: bool
    """A notification may be delivered more than once."""
    detects_peer_failure: bool
    """The transport reports :class:`PeerLost` on its own when a peer dies."""
    failure_detection_bound_s: float | None
    """Upper bound on the delay between a peer's death and :class:`PeerLost`."""
    one_sided_reads: bool
    """``read_blocks`` is a true one-sided read (RDMA); otherwise it is emulated."""
    thread_affinity: ThreadAffinity
    """Which threads may call the endpoint."""
    writes: bool = False
    """The endpoint is a :class:`WritableTransport`: ``write_blocks`` is offered."""


# --- what poll() reports ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """A notification arrived."""

    peer: PeerId
    """Who sent it, as named by the transport."""
    payload: bytes
    """The exact bytes that were sent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCompleted:
    """A read finished and its data is visible in local memory."""

    read_id: ReadId
    """The handle ``read_blocks`` returned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadFailed:
    """A read ended without data; the request must be recomputed."""

    read_id: ReadId
    """The handle ``read_blocks`` returned."""
    reason: str
    """What the transport said, for logs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteCompleted:
    """A write's data is in the peer's memory (remote completion); its notify went after it."""

    write_id: WriteId
    """The handle ``write_blocks`` returned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteFailed:
    """A write ended without completing; none of its data lands in the peer any more."""

    write_id: WriteId
    """The handle ``write_blocks`` returned."""
    reason: str
    """What the transport said, for logs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLost:
    """The transport learnt that a peer is gone (disconnect, failed send, endpoint error)."""

    peer: PeerId
    """The peer that is gone."""
    reason: str
    """What the transport said, for logs."""


TransportEvent = Received | ReadCompleted | ReadFailed | PeerLost | WriteCompleted | WriteFailed


# --- errors ----------------------------------------------------------------


class TransportError(Exception):
    """Base class of every error a transport raises."""


class FrameTooLarge(TransportError):
    """``send`` was given more bytes than ``max_notification_size``; nothing was sent."""


class UnknownPeer(TransportError):
    """The peer was never added, or was removed."""


class TransportClosed(TransportError):
    """The endpoint was closed; it can do nothing more."""


class PeerUnreachable(TransportError):
    """The transport knows the peer but cannot reach it now (it also reports PeerLost)."""


class BadMetadata(TransportError, RemoteProtocolError):
    """``add_peer`` was given metadata this transport cannot use.

    Also a :class:`~kvproto.errors.RemoteProtocolError`: metadata comes from a peer,
    and every parser a peer reaches raises one: one taxonomy for all of them."""


class MemoryNotRegistered(TransportError):
    """A read names blocks outside the registered layout, locally or at the peer."""


class RegistrationError(TransportError):
    """Memory could not be registered (a second registration, or the transport refused it)."""


class LayoutMismatch(TransportError):
    """The local and remote layouts cannot be paired for this read (regions or lengths differ)."""


@runtime_checkable
class Transport(Protocol):
    """One endpoint of a transport. See the module docstring for the model."""

    @property
    def name(self) -> str:
        """Short transport name: ``"loopback"``, ``"nixl"``, ``"ucx"``."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this transport promises; checked by the conformance kit."""
        ...

    @property
    def local_peer(self) -> PeerId:
        """This endpoint's name as its peers see it."""
        ...

    def metadata(self) -> bytes:
        """Opaque bytes another endpoint passes to ``add_peer`` to reach this one."""
        ...

    def add_peer(self, metadata: bytes) -> PeerId:
        """Make a peer reachable from its metadata; idempotent for the same metadata."""
        ...

    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer; idempotent."""
        ...

    def send(self, peer: PeerId, payload: bytes) -> None:
        """Send one notification without blocking.

        Raises :class:`FrameTooLarge`, :class:`UnknownPeer`,
        :class:`PeerUnreachable` or :class:`TransportClosed`.
        """
        ...

    def poll(self) -> Sequence[TransportEvent]:
        """Return what happened since the last call. Never blocks."""
        ...

    def register_blocks(self, layout: BlockLayout) -> None:
        """Register local KV memory once; its layout then travels in ``metadata()``."""
        ...

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

        Issues one transfer; returns at once. ``notify`` reaches the peer as a
        notification only after the data left its memory. Completion or
        failure is reported by ``poll``.
        """
        ...

    def close(self) -> None:
        """Release everything; idempotent. Every later call raises TransportClosed."""
        ...


@runtime_checkable
class WritableTransport(Transport, Protocol):
    """A transport that also WRITEs (push mode); ``capabilities.writes`` is True."""

    def write_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> WriteId:
        """Write ``local_blocks`` of every region into ``peer``'s ``remote_blocks``.

        Issues one transfer; returns at once. ``notify`` reaches the peer as a
        notification only after the data is in its memory. ``poll`` reports
        :class:`WriteCompleted` once the data is there, or :class:`WriteFailed`
        once none of it can land any more. The slices are the ones a read
        between the same two ranks would use (``local_slice`` of the local
        blocks, ``remote_slice`` of the peer's).
        """
        ...
