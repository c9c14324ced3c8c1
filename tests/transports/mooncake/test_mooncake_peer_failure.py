"""kill -9 across processes: PeerLost within the declared bound, in-flight reads fail."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvproto.transport import PeerLost, ReadCompleted, ReadFailed
from kvproto_transports.mooncake import FAILURE_DETECTION_BOUND_S
from tests.transports.mooncake.mooncake_required import needs_mooncake
from tests.transports.mooncake.node import block_pattern

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.transports.mooncake.conftest import Pair

pytestmark = needs_mooncake


def _warm(p: Pair) -> None:
    p.reader.call("send", peer=p.holder_id, payload=b"hello")
    p.holder.call("send", peer=p.reader_id, payload=b"hello")
    assert p.holder.call("wait_events", count=1, kinds=("Received",))
    assert p.reader.call("wait_events", count=1, kinds=("Received",))


def test_read_across_processes_moves_the_data_then_the_notify(
    make_pair: Callable[[], Pair],
) -> None:
    p = make_pair()
    rid = p.reader.call(
        "read", peer=p.holder_id, local_blocks=[0, 1, 5], remote_blocks=[10, 11, 79], notify=b"d"
    )
    done = p.reader.call("wait_events", count=1, kinds=("ReadCompleted", "ReadFailed"))
    assert [type(ev) for _t, ev in done] == [ReadCompleted] and done[0][1].read_id == rid
    for region in (0, 1):
        for local, remote in ((0, 10), (1, 11), (5, 79)):
            want = block_pattern(7, region, remote, 4096)
            assert p.reader.call("block", region=region, block=local) == want
    got = p.holder.call("wait_events", count=1, kinds=("Received",))
    assert got and got[0][1].payload == b"d" and got[0][1].peer == p.reader_id


def test_kill_reader_surfaces_peer_lost_at_holder_within_bound(
    make_pair: Callable[[], Pair],
) -> None:
    p = make_pair()
    _warm(p)
    killed_at = p.reader.kill()
    lost_at = p.holder.call("lost_at", peer=p.reader_id, timeout_s=5.0)
    assert lost_at is not None, "no PeerLost for the killed reader within 5 s"
    delay = lost_at - killed_at
    print(f"\nkill -9 of the reader -> PeerLost at the holder after {delay * 1e3:.1f} ms")
    assert delay <= FAILURE_DETECTION_BOUND_S
    events = [ev for _t, ev in p.holder.call("take_events")]
    assert sum(isinstance(ev, PeerLost) for ev in events) == 1
    with pytest.raises(Exception, match="PeerUnreachable"):
        p.holder.call("send", peer=p.reader_id, payload=b"to-the-dead")


def test_kill_holder_ends_an_inflight_read(make_pair: Callable[[], Pair]) -> None:
    p = make_pair()
    _warm(p)
    rid = p.reader.call(
        "read",
        peer=p.holder_id,
        local_blocks=list(range(80)),
        remote_blocks=list(range(80)),
        notify=b"done",
    )
    killed_at = p.holder.kill()
    got = p.reader.call(
        "wait_events", count=1, kinds=("ReadCompleted", "ReadFailed"), timeout_s=10.0
    )
    assert got, "the read neither completed nor failed (hang)"
    ev = got[0][1]
    assert ev.read_id == rid
    if isinstance(ev, ReadCompleted):  # finished before the kill took effect
        for b in (0, 79):
            assert p.reader.call("block", region=1, block=b) == block_pattern(7, 1, b, 4096)
    else:
        assert isinstance(ev, ReadFailed)
    lost_at = p.reader.call("lost_at", peer=p.holder_id, timeout_s=5.0)
    assert lost_at is not None
    print(
        f"\nkill -9 of the holder -> {type(ev).__name__}, PeerLost at the reader after "
        f"{(lost_at - killed_at) * 1e3:.1f} ms"
    )
    assert lost_at - killed_at <= FAILURE_DETECTION_BOUND_S
