"""atheris target: side-channel handshake payloads (kvproto_binding.sidechannel.wire).

The listener decodes requests with ``decode_request`` and answers ``MalformedHandshake``
with an error reply; the client does the same for replies with ``decode_reply`` (and
reports ``BadReply``). Contract: every input decodes or raises ``MalformedHandshake``, a
``RemoteProtocolError`` like every parser a peer reaches; anything else
would reach the listener's catch-all (counted as an internal error, no reply). An
accepted message re-encodes to itself.
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only kvproto_binding is instrumented)

with atheris.instrument_imports(include=["kvproto_binding"]):
    from _harness import write_seeds

    from kvproto.errors import RemoteProtocolError
    from kvproto_binding.sidechannel import wire


def TestOneInput(data: bytes) -> None:
    for decode in (wire.decode_request, wire.decode_reply):
        try:
            msg = decode(data)
        except RemoteProtocolError:
            continue
        assert decode(wire.encode(msg)) == msg


def seeds() -> list[bytes]:
    return [
        wire.encode(
            wire.HandshakeRequest(
                version=1, kind=wire.KIND_GET_META, rank=0, requester="D", nonce=bytes(16)
            )
        ),
        wire.encode(
            wire.HandshakeReply(
                nonce=bytes(16),
                ok=True,
                rank=0,
                compat_hash=b"h" * 32,
                metadata=b"m" * 64,
                server_time=1.5,
            )
        ),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2], seeds())
    else:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
