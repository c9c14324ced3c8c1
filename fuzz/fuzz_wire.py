"""atheris target: kvproto frames (wire.decode) and the state machines behind it.

Contract checked on every input:
* ``wire.decode`` returns a message or raises RemoteProtocolError, with and without a key;
  an accepted message re-encodes and decodes to itself;
* ``Holder.handle_frame`` and ``Reader.handle_frame`` never raise;
* input the parser refuses changes no lease, request or session (snapshot compare);
* so does input that parses but is not signed with one of the pair's session keys
  (no proof, no change), except a Hello whose anchor proves a ticket and an
  unsigned ``Reject(NO_SESSION)``, the one unsigned frame a reader heeds (at most once
  an interval: it costs a Hello).
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only kvproto is instrumented)

# Only kvproto is instrumented (the harness and msgspec are not: less noise, faster).
with atheris.instrument_imports(include=["kvproto"]):
    from _harness import KEY, Pair, Rolling, wire_seeds, write_seeds

    from kvproto import wire
    from kvproto.errors import RemoteProtocolError

TEMPLATE = Pair()
STATE = Rolling(TEMPLATE)


def TestOneInput(data: bytes) -> None:
    work = STATE.work
    accepted = False
    for key in (None, KEY):
        try:
            msg = wire.decode(data, key)
        except RemoteProtocolError:
            continue
        accepted = True
        assert wire.decode(wire.encode(msg, key), key) == msg
    proven = accepted and (work.authentic(data) or _unsigned_but_allowed(work, data))
    before = None if proven else work.snapshot()
    for peer in ("D0", "stranger"):
        work.holder.handle_frame(6.0, peer, data)
    work.reader.handle_frame(6.0, "P0", data)
    work.holder.drain()
    work.reader.drain()
    if not proven:
        assert work.snapshot() == before, "invalid or unproven input changed state"
        return
    STATE.note_accepted()


def _unsigned_but_allowed(work: Pair, data: bytes) -> bool:
    """An unsigned Reject(NO_SESSION), or a Hello whose anchor proves a token (a replayed
    genuine Hello opens an idle session for its sender: a key nobody else can derive)."""
    msg = wire.decode(data)
    if isinstance(msg, wire.Reject):
        return msg.reason == wire.RejectReason.NO_SESSION
    return isinstance(msg, wire.Hello) and work.anchored(msg)


def seeds() -> list[bytes]:
    return wire_seeds(TEMPLATE)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2], seeds())
    else:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
