"""Address exchange through the ZMQ side channel: UCX metadata is what travels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvproto.transport import ReadCompleted
from kvproto_transports.ucx import ucx_available, unavailable_reason
from tests.transports.ucx.node import block_pattern

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Pair

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]

COMPAT = b"\x01" * 32


def test_handshake_over_side_channel_then_notify_and_read(make_pair: Callable[..., Pair]) -> None:
    p = make_pair(link=False)
    port = p.holder.call("serve", compat_hash=COMPAT)
    # The reader fetches the holder's UCX metadata and introduces itself with its own.
    assert p.reader.call("handshake", port=port, compat_hash=COMPAT) == p.holder_id
    assert p.holder.call("accept_introductions") == [p.reader_id]
    p.holder.call("send", peer=p.reader_id, payload=b"ack\x00")
    rid = p.reader.call(
        "read", peer=p.holder_id, local_blocks=[0, 1], remote_blocks=[8, 9], notify=b"done\xff"
    )
    got = p.reader.call("wait_events", count=2, kinds=("ReadCompleted", "Received"))
    kinds = sorted(type(ev).__name__ for _t, ev in got)
    assert kinds == ["ReadCompleted", "Received"]
    assert any(isinstance(ev, ReadCompleted) and ev.read_id == rid for _t, ev in got)
    assert p.reader.call("block", region=1, block=1) == block_pattern(7, 1, 9, 4096)
    notes = p.holder.call("wait_events", count=1, kinds=("Received",))
    assert [(ev.peer, ev.payload) for _t, ev in notes] == [(p.reader_id, b"done\xff")]
