"""kvproto: KV-cache block leases for disaggregated prefill/decode serving (sans-I/O core).

The core does no I/O, starts no thread and never reads a clock: every input
carries ``now``, :meth:`Holder.get_timer` / :meth:`Reader.get_timer` say
when to call ``handle_timer(now)``, and ``drain()`` returns the commands a
binding must carry out. See spec/README.md for the protocol.
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

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Connect",
    "FailReason",
    "FreeBlocks",
    "Holder",
    "LeaseConfig",
    "LeaseParams",
    "LeaseState",
    "LeaseTicket",
    "LocalProtocolError",
    "ProtocolError",
    "ReadConfirmed",
    "ReadDeclined",
    "ReadDeferred",
    "ReadGo",
    "ReadOrder",
    "ReadState",
    "Reader",
    "ReleaseReason",
    "RemoteProtocolError",
    "RequestFailed",
    "SendFrame",
    "SessionState",
    "__version__",
]
