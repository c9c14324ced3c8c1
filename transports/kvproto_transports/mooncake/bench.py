"""What MooncakeTransport costs on top of raw Mooncake calls, measured side by side in one run.

:func:`measure_overhead` mirrors the NIXL and UCX benches (same parameters,
same result keys), so ``kvproto bench --suite transport`` prints all three:

* ``notif_rtt_*``: A sends a notification, B polls until it has it and
  answers, A polls until it has the answer;
* ``read_*``: a read of ``blocks`` blocks of every region (the holder's last
  blocks into the reader's first: a partial prefix hit) with a notification
  attached.

``*_raw`` is Mooncake alone, two bare ``TransferEngine`` objects driven from
this thread. Its only notification is ``TransferNotify`` riding on a
transfer, so the raw round trip is a 1-byte ``transfer_sync`` read with a
notify each way, each side spinning on ``get_notifies``; the raw read is one
``batch_transfer_sync`` READ with the done attached (Mooncake sends it once
the batch completed), timed until the holder's ``get_notifies`` returns it.
``read_raw_nonotify`` is the same batch without a notify
(``batch_transfer_async_read`` + ``get_batch_transfer_status``), the data
movement alone. ``*_transport`` is two :class:`MooncakeTransport` endpoints
polled from this thread as a binding would (ZMQ notifications; the read is
timed to ``ReadCompleted``, as in the UCX bench, the done then waited for
outside the timed region). Everything runs over TCP on localhost; variants
alternate iteration by iteration so that machine noise hits both alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvproto.tpmath import BlockLayout
from kvproto.transport import ReadCompleted, ReadFailed, Received, TransportEvent
from kvproto_transports.benchloop import (
    host_layout,
    interleave,
    overhead_report,
    partial_hit,
    read_config,
    spin,
)
from kvproto_transports.ucx.plan import plan_read

from ._engine import load_engine, new_engine
from .transport import MooncakeTransport

POLL_PAUSE_S = 20e-6
"""Sleep between two polls of a transport while waiting (releases the GIL)."""


class _Raw:
    """Two bare transfer engines driven from this thread: the floor."""

    def __init__(self, holder: BlockLayout, reader: BlockLayout, timeout_s: float) -> None:
        self.mod = load_engine()
        self.e = [new_engine("127.0.0.1") for _ in range(2)]
        self.session = [f"127.0.0.1:{e.get_rpc_port()}" for e in self.e]
        for e, layout in zip(self.e, (holder, reader), strict=True):
            sizes = [n * layout.num_blocks for n in layout.block_lens]
            if e.batch_register_memory(list(layout.region_addrs), sizes) != 0:
                raise RuntimeError("batch_register_memory failed")
        self.holder, self.reader = holder, reader
        self.timeout_s = timeout_s
        # One byte of each side's memory that the 1-byte notify transfers move.
        self.byte = (holder.region_addrs[0], reader.region_addrs[0])
        self.read_op = self.mod.TransferOpcode.Read

    def _notify(self, i: int, msg: str) -> None:
        """Endpoint ``i`` sends ``msg`` to the other on a 1-byte read (Mooncake's only way)."""
        j = 1 - i
        rc = self.e[i].transfer_sync(
            self.session[j],
            self.byte[i],
            self.byte[j],
            1,
            self.read_op,
            self.mod.TransferNotify(str(i), msg),
        )
        if rc != 0:
            raise RuntimeError(f"transfer_sync with notify = {rc}")

    def _recv(self, i: int) -> None:
        spin(lambda: bool(self.e[i].get_notifies()), self.timeout_s, "Mooncake notify")

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self._notify(0, "ping")
        self._recv(1)
        self._notify(1, "pong")
        self._recv(0)
        return time.perf_counter() - t0

    def _lists(self, local: list[int], remote: list[int]) -> tuple[list[int], ...]:
        segs = plan_read(self.reader, self.holder, local_blocks=local, remote_blocks=remote)
        return [s.local_addr for s in segs], [s.remote_addr for s in segs], [s.length for s in segs]

    def read(self, local: list[int], remote: list[int]) -> float:
        dst, src, lens = self._lists(local, remote)
        t0 = time.perf_counter()
        rc = self.e[1].batch_transfer_sync(
            self.session[0], dst, src, lens, self.read_op, self.mod.TransferNotify("1", "done")
        )
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync = {rc}")
        self._recv(0)
        return time.perf_counter() - t0

    def read_nonotify(self, local: list[int], remote: list[int]) -> float:
        dst, src, lens = self._lists(local, remote)
        t0 = time.perf_counter()
        batch = self.e[1].batch_transfer_async_read(self.session[0], dst, src, lens)
        if self.e[1].get_batch_transfer_status([batch]) != 0:
            raise RuntimeError("batch read failed")
        return time.perf_counter() - t0

    def close(self) -> None:
        for e, layout in zip(self.e, (self.holder, self.reader), strict=True):
            e.batch_unregister_memory(list(layout.region_addrs))
        self.e.clear()  # destructors: ~1 s each


class _Kv:
    """Two MooncakeTransports, polled from this thread."""

    def __init__(self, holder: BlockLayout, reader: BlockLayout, timeout_s: float) -> None:
        self.a = MooncakeTransport(name_prefix="bench-holder")
        self.b = MooncakeTransport(name_prefix="bench-reader")
        self.a.register_blocks(holder)
        self.b.register_blocks(reader)
        self.pa = self.b.add_peer(self.a.metadata())
        self.pb = self.a.add_peer(self.b.metadata())
        self.timeout_s = timeout_s

    def _wait(
        self, t: MooncakeTransport, match: Callable[[TransportEvent], bool], what: str
    ) -> None:
        def got() -> bool:
            for event in t.poll():
                if isinstance(event, ReadFailed):
                    raise RuntimeError(f"read failed: {event}")
                if match(event):
                    return True
            return False

        spin(got, self.timeout_s, what, pause_s=POLL_PAUSE_S)

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self.a.send(self.pb, b"ping")
        self._wait(self.b, lambda e: isinstance(e, Received) and e.payload == b"ping", "ping")
        self.b.send(self.pa, b"pong")
        self._wait(self.a, lambda e: isinstance(e, Received) and e.payload == b"pong", "pong")
        return time.perf_counter() - t0

    def read(self, local: list[int], remote: list[int]) -> float:
        t0 = time.perf_counter()
        rid = self.b.read_blocks(self.pa, local_blocks=local, remote_blocks=remote, notify=b"done")
        self._wait(self.b, lambda e: isinstance(e, ReadCompleted) and e.read_id == rid, "read")
        elapsed = time.perf_counter() - t0
        self._wait(self.a, lambda e: isinstance(e, Received) and e.payload == b"done", "notify")
        return elapsed

    def close(self) -> None:
        self.a.close()
        self.b.close()


def measure_overhead(
    *,
    iterations: int = 200,
    blocks: int = 64,
    regions: int = 8,
    block_len: int = 4096,
    num_blocks: int = 128,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Notification round trip and a ``blocks``-block read: raw Mooncake vs MooncakeTransport.

    Returns medians/percentiles in microseconds per variant and the ratios
    ``transport / raw`` of the medians.
    """
    shape = (regions, num_blocks, block_len)
    mems = [np.full(shape, i, dtype=np.uint8) for i in range(4)]
    for r in range(regions):  # distinct holder bytes, to check what moved
        mems[0][r] = (
            np.arange(num_blocks * block_len, dtype=np.uint8).reshape(num_blocks, block_len) + r
        )
        mems[2][r] = mems[0][r]
    layouts = [host_layout(m, regions, num_blocks, block_len) for m in mems]
    got, want = partial_hit(blocks, num_blocks)
    raw = _Raw(layouts[0], layouts[1], timeout_s)
    try:
        kv = _Kv(layouts[2], layouts[3], timeout_s)
    except BaseException:
        raw.close()
        raise
    steps: dict[str, Callable[[], float]] = {
        "notif_rtt_raw": raw.rtt,
        "notif_rtt_transport": kv.rtt,
        "read_raw": lambda: raw.read(got, want),
        "read_transport": lambda: kv.read(got, want),
        "read_raw_nonotify": lambda: raw.read_nonotify(got, want),
    }
    try:
        samples = interleave(steps, iterations)
        for holder, reader in ((0, 1), (2, 3)):
            # Block 0 of region 0 also carries the raw notify's 1-byte transfers: skip it.
            moved = mems[reader][:, 1:blocks]
            if not np.array_equal(moved, mems[holder][:, num_blocks - blocks + 1 :]):
                raise RuntimeError("the read did not move the expected bytes")
    finally:
        kv.close()
        raw.close()
    config = {
        **read_config(iterations=iterations, blocks=blocks, regions=regions, block_len=block_len),
        "segments_per_read": regions,  # consecutive blocks merge into one segment per region
        "mooncake_protocol": "tcp",
        "notifications": "raw: TransferNotify on a 1-byte transfer_sync; transport: ZMQ",
    }
    return overhead_report(config, samples)


if __name__ == "__main__":  # python -m kvproto_transports.mooncake.bench
    import json

    print(json.dumps(measure_overhead(), indent=2))
