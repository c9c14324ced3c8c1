"""atheris target: stock-vLLM text frames (legacy.parse) and a legacy-mode holder.

Contract: ``legacy.parse`` returns a LegacyHeartbeat or LegacyDone or raises
RemoteProtocolError; an accepted frame whose ids the encoders allow re-encodes to a
frame that parses the same; the holder never raises and invalid input changes nothing.
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only kvproto is instrumented)

# Only kvproto is instrumented (the harness and msgspec are not: less noise, faster).
with atheris.instrument_imports(include=["kvproto"]):
    from _harness import LEGACY_CONFIG, Pair, Rolling, legacy_seeds, write_seeds

    from kvproto import legacy
    from kvproto.errors import LocalProtocolError, RemoteProtocolError

TEMPLATE = Pair(LEGACY_CONFIG)
STATE = Rolling(TEMPLATE)


def TestOneInput(data: bytes) -> None:
    work = STATE.work
    try:
        frame = legacy.parse(data)
    except RemoteProtocolError:
        frame = None
    if frame is not None:
        try:
            if isinstance(frame, legacy.LegacyHeartbeat):
                again = legacy.encode_heartbeat(frame.request_ids)
            else:
                again = legacy.encode_done(frame.request_id, frame.expected)
        except LocalProtocolError:
            pass  # ids the stock parser would misread: the encoders refuse them
        else:
            assert legacy.parse(again) == frame
    before = None if frame is not None else work.snapshot()
    work.holder.handle_frame(6.0, "stock-vllm", data)
    work.holder.drain()
    if frame is None:
        assert work.snapshot() == before, "invalid input changed state"
        return
    STATE.note_accepted()


def seeds() -> list[bytes]:
    return legacy_seeds()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2], seeds())
    else:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
