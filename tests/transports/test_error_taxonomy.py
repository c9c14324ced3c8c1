"""One error taxonomy for every parser a peer reaches.

Wire frames, tickets, side-channel requests and replies, NIXL and UCX metadata all raise
a ``RemoteProtocolError`` subclass on bad input (before, the side channel leaked
msgspec's ``DecodeError``/``ValidationError`` and ``UnicodeDecodeError`` to its
callers, and ``BadMetadata`` was only a ``TransportError``); a UCX HELLO decodes to a
Hello or None.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvproto import wire
from kvproto.errors import RemoteProtocolError
from kvproto.ticket import LeaseTicket
from kvproto.transport import BadMetadata, TransportError
from kvproto_binding.sidechannel import wire as sc_wire
from kvproto_transports.nixl import wire as nixl_wire
from kvproto_transports.ucx import wire as ucx_wire

REPLY = sc_wire.HandshakeReply(
    nonce=bytes(16), ok=True, rank=0, compat_hash=b"h" * 32, metadata=b"m", server_time=1.0
)
BAD_INPUTS = [
    b"",
    b"\xc1",
    b"\x93\x01\x02",
    msgspec.msgpack.encode({"a": 1}),
    msgspec.msgpack.encode(["x", 2**63, -1]),
    b"\x91\xa2\xff\xfe",  # a str field holding invalid UTF-8
]
PARSERS: dict[str, Callable[[bytes], object]] = {
    "wire.decode": wire.decode,
    "ticket": lambda b: LeaseTicket.from_params({"token": b.hex(), "lease": len(b)}),
    "sidechannel.decode_request": sc_wire.decode_request,
    "sidechannel.decode_reply": sc_wire.decode_reply,
    "nixl.decode_metadata": nixl_wire.decode_metadata,
    "ucx.decode_metadata": ucx_wire.decode_metadata,
}


@pytest.mark.parametrize("parser", list(PARSERS))
@pytest.mark.parametrize("data", BAD_INPUTS)
def test_every_peer_reachable_parser_raises_a_remote_protocol_error(
    parser: str, data: bytes
) -> None:
    with pytest.raises(RemoteProtocolError):
        PARSERS[parser](data)


def test_bad_metadata_is_both_a_transport_and_a_remote_protocol_error() -> None:
    assert issubclass(BadMetadata, TransportError)
    assert issubclass(BadMetadata, RemoteProtocolError)


def test_a_non_finite_server_time_is_refused() -> None:
    assert sc_wire.decode_reply(sc_wire.encode(REPLY)) == REPLY
    nan = msgspec.structs.replace(REPLY, server_time=float("nan"))
    with pytest.raises(RemoteProtocolError, match="server_time"):
        sc_wire.decode_reply(sc_wire.encode(nan))


@pytest.mark.parametrize("data", BAD_INPUTS)
def test_ucx_hello_is_a_hello_or_none(data: bytes) -> None:
    assert ucx_wire.decode_hello(data) is None


def test_layout_and_registration_errors_are_one_class_for_every_transport() -> None:
    """Generic code catches ``kvproto.transport.LayoutMismatch`` from any transport."""
    from kvproto import transport
    from kvproto_transports import nixl, ucx

    for module in (nixl, ucx, nixl.errors, ucx.errors):
        assert module.LayoutMismatch is transport.LayoutMismatch
        assert module.RegistrationError is transport.RegistrationError
    assert issubclass(transport.LayoutMismatch, TransportError)
    assert issubclass(transport.RegistrationError, TransportError)
