"""kvproto: KV-cache block leases for disaggregated prefill/decode serving (sans-I/O core).

The core does no I/O, starts no thread and never reads a clock: every input
carries ``now``, :meth:`Holder.get_timer` / :meth:`Reader.get_timer` say
when to call ``handle_timer(now)``, and ``drain()`` returns the commands a
binding must carry out. See spec/README.md for the protocol.

What an embedder needs is exported here: the two cores and their configuration,
their outputs and errors, and the :class:`Transport` protocol (with its events,
errors and the block layout a transport registers) that a transport of one's own
implements. ``kvproto_binding.Binding`` runs the cores over a transport;
``kvproto_transports`` has the transports (the in-process loopback among them).
examples/embed/ runs both.
"""

from kvproto.config import ConfigError, LeaseConfig, LeaseParams
from kvproto.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from kvproto.events import (
    Connect,
    FailReason,
    FreeBlocks,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReadGo,
    ReadOrder,
    ReleaseReason,
    RequestFailed,
    SendFrame,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.states import LeaseState, ReadState, SessionState
from kvproto.ticket import LeaseTicket
from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    LayoutMismatch,
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
    Transport,
    TransportClosed,
    TransportError,
    TransportEvent,
    UnknownPeer,
)

__version__ = "0.1.0"

__all__ = [
    "BadMetadata",
    "BlockLayout",
    "BlockSlice",
    "Capabilities",
    "ConfigError",
    "Connect",
    "FailReason",
    "FrameTooLarge",
    "FreeBlocks",
    "Holder",
    "LayoutMismatch",
    "LeaseConfig",
    "LeaseParams",
    "LeaseState",
    "LeaseTicket",
    "LocalProtocolError",
    "MemoryNotRegistered",
    "PeerId",
    "PeerLost",
    "PeerUnreachable",
    "ProtocolError",
    "ReadCompleted",
    "ReadConfirmed",
    "ReadDeclined",
    "ReadDeferred",
    "ReadFailed",
    "ReadGo",
    "ReadId",
    "ReadOrder",
    "ReadState",
    "Reader",
    "Received",
    "RegistrationError",
    "ReleaseReason",
    "RemoteProtocolError",
    "RequestFailed",
    "SendFrame",
    "SessionState",
    "ThreadAffinity",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportEvent",
    "UnknownPeer",
    "__version__",
]
