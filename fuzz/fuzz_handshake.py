"""atheris target: side-channel handshake payloads (kvproto_transports.sidechannel.wire).

The listener decodes requests with ``request_decoder`` and treats msgspec's
DecodeError/ValidationError as "malformed: answer with an error"; the client does the
same for replies. Contract: every input decodes or raises one of those two; anything
else would reach the listener's catch-all (counted as an internal error, no reply).
"""

from __future__ import annotations

import sys

import atheris
import msgspec

with atheris.instrument_imports(include=["kvproto_transports"]):
    from _harness import write_seeds

    from kvproto_transports.sidechannel import wire

# What the listener and the client turn into an error reply / BadReply. ValueError covers
# UnicodeDecodeError from invalid UTF-8 in a string field (found by this target).
EXPECTED = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


def TestOneInput(data: bytes) -> None:
    for decoder in (wire.request_decoder, wire.reply_decoder):
        try:
            msg = decoder.decode(data)
        except EXPECTED:
            continue
        assert decoder.decode(wire.encode(msg)) == msg


def seeds() -> list[bytes]:
    return [
        wire.encode(
            wire.HandshakeRequest(
                version=1, kind=wire.KIND_GET_META, rank=0, requester="D", nonce=bytes(16)
            )
        ),
        wire.encode(
            wire.HandshakeReply(
                nonce=bytes(16), ok=True, rank=0, compat_hash=b"h" * 32, metadata=b"m" * 64,
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
