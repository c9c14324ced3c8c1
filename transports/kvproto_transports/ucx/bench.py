"""What UcxTransport costs on top of raw UCX calls, measured side by side in one run.

:func:`measure_overhead` mirrors the NIXL transport's (same parameters, same
result keys), so the bench can print both in one table:

* ``notif_rtt_*``: A sends a notification, B polls until it has it and
  answers, A polls until it has the answer;
* ``read_*``: a read of ``blocks`` blocks of every region (the tail of the
  holder's blocks into the head of the reader's: a partial prefix hit) with a
  notification attached, from post to the reader seeing completion.

``*_raw`` is the floor: two bare ucxx workers in this thread, tagged messages
and UCP ``get`` through :mod:`._ucp`, progressed by busy polling.
``*_transport`` is two :class:`UcxTransport` endpoints polled from this thread
as a binding would; a send carries out its command and a poll runs the
engine's step on this thread, and each endpoint's engine thread serves what
nobody polls for (here: the holder's side of a read). Both run over TCP on
localhost (the transport's default); variants alternate iteration by
iteration so that machine noise hits both alike.

The two variants do not do the same work, in both directions: the raw read
plans its segments (:func:`.plan.plan_read`) once, outside the timed region,
where the transport plans every request in ``read_blocks`` (~20 us for this
read); a transport send validates the call and keeps its send budget and
counters, and a poll runs a whole engine step (reap, probes, timers), where
the raw send is one ``tag_send`` (a round trip is ~1,430 Python opcodes
against the raw loop's ~460; hop by hop, p10 of back-to-back rounds: a send
10.3 us against 8.3, a receiving poll 11.1 us against a raw receive's 9.5); in
a read the holder's engine thread and this thread must both run, where the
raw floor does both sides in one thread (on a loaded machine the read's
median grows with the load far faster than the raw one); the raw read's time
includes the holder receiving the done notification, the transport's stops
at ``ReadCompleted``. A read also leaves the engine threads waiting on their
workers' event fd; the first poll of each endpoint after it signals its
engine thread out (see ``engine.CALLER_WINDOW_S``): for the holder that is
the transport read's wait for the done notification, outside its timed
region (timed to there, as the raw read is, the read scored the same before
and after that change).
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

from ._ucp import UCS_INPROGRESS, UCS_OK, Ucp, load_ucp
from ._ucxx import load_ucxx
from .engine import DEFAULT_UCX_OPTIONS
from .plan import plan_read
from .transport import UcxTransport

POLL_PAUSE_S = 20e-6
"""Sleep between two polls of a transport while waiting (releases the GIL)."""


class _Raw:
    """Two bare ucxx workers progressed by this thread: the floor."""

    def __init__(self, holder: BlockLayout, reader: BlockLayout, timeout_s: float) -> None:
        self.api, self.array = load_ucxx()
        self.ucp: Ucp = load_ucp()
        api = self.api
        feats = (api.Feature.TAG, api.Feature.RMA)
        self.ctx = [
            api.UCXContext(dict(DEFAULT_UCX_OPTIONS), feature_flags=feats) for _ in range(2)
        ]
        self.w = [api.UCXWorker(c) for c in self.ctx]
        self.ep = [
            api.UCXEndpoint.create_from_worker_address(
                self.w[i],
                api.UCXAddress.create_from_buffer(self.w[1 - i].address.tobytes()),
                True,
            )
            for i in range(2)
        ]
        self.timeout_s = timeout_s
        for i in range(2):
            self._wait(self.ucp.flush(int(self.ep[i].handle)).request)
        self.memh = [
            self.ucp.mem_map(self.ctx[0].handle, a, n * holder.num_blocks, cuda=False)
            for a, n in zip(holder.region_addrs, holder.block_lens, strict=True)
        ]
        keys = [self.ucp.rkey_pack(self.ctx[0].handle, m) for m in self.memh]
        self.rkeys = [self.ucp.rkey_unpack(int(self.ep[1].handle), k) for k in keys]
        self.holder, self.reader = holder, reader
        self.any_tag, self.no_mask = api.UCXXTag(0), api.UCXXTagMask(0)

    def _progress(self) -> None:
        self.w[0].progress()
        self.w[1].progress()

    def _wait(self, request: int) -> None:
        if not request:
            return
        status = UCS_INPROGRESS

        def done() -> bool:
            nonlocal status
            self._progress()
            status = self.ucp.check(request)
            return status != UCS_INPROGRESS

        spin(done, self.timeout_s, "UCX request")
        self.ucp.free(request)
        if status != UCS_OK:
            raise RuntimeError(f"UCX request failed: {self.ucp.status_text(status)}")

    def _send(self, i: int, payload: bytes) -> Any:
        return self.ep[i].tag_send(self.array(payload), self.api.UCXXTag(1))

    def _recv(self, i: int) -> bytes:
        got: list[bytes] = []

        def arrived() -> bool:
            self._progress()
            probe = self.w[i].tag_probe(self.any_tag, self.no_mask, remove=True)
            if not probe.matched:
                return False
            buf = bytearray(probe.length)
            req = self.w[i].tag_recv_with_handle(self.array(buf), probe)

            def received() -> bool:
                self._progress()
                return bool(req.completed)

            spin(received, self.timeout_s, "receive")
            got.append(bytes(buf))
            return True

        spin(arrived, self.timeout_s, "notification")
        return got[0]

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self._send(0, b"ping")
        self._send(1, self._recv(1))
        self._recv(0)
        return time.perf_counter() - t0

    def read(self, local: list[int], remote: list[int]) -> float:
        segs = plan_read(self.reader, self.holder, local_blocks=local, remote_blocks=remote)
        t0 = time.perf_counter()
        handle = int(self.ep[1].handle)
        reqs = [
            self.ucp.get(
                handle, s.local_addr, s.length, s.remote_addr, self.rkeys[s.region]
            ).request
            for s in segs
        ]
        for req in reqs:
            self._wait(req)
        self._send(1, b"done")
        self._recv(0)
        return time.perf_counter() - t0

    def close(self) -> None:
        for rkey in self.rkeys:
            self.ucp.rkey_destroy(rkey)
        for ep in self.ep:
            ep.close_blocking(10**9, 1)
        for memh in self.memh:
            self.ucp.mem_unmap(self.ctx[0].handle, memh)
        del self.ep, self.w, self.ctx


class _Kv:
    """Two UcxTransports, polled from this thread."""

    def __init__(self, holder: BlockLayout, reader: BlockLayout, timeout_s: float) -> None:
        self.a = UcxTransport(name_prefix="bench-holder")
        self.b = UcxTransport(name_prefix="bench-reader")
        self.a.register_blocks(holder)
        self.b.register_blocks(reader)
        self.pa = self.b.add_peer(self.a.metadata())
        self.pb = self.a.add_peer(self.b.metadata())
        self.timeout_s = timeout_s

    def _wait(self, t: UcxTransport, match: Callable[[TransportEvent], bool], what: str) -> None:
        def got() -> bool:
            # One pass over the events (two any() generators were ~40 opcodes a
            # poll of the harness's own, against the raw loop's bare probe).
            for event in t.poll():
                if isinstance(event, ReadFailed):
                    raise RuntimeError(f"read failed: {event}")
                if match(event):
                    return True
            return False

        # Pause between polls, as a binding's tick would: a busy-polling caller
        # holds the GIL the engine threads need (2-5x slower figures measured).
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
    """Notification round trip and a ``blocks``-block read: raw UCX vs UcxTransport.

    Returns medians/percentiles in microseconds per variant and the ratios
    ``transport / raw`` of the medians (the transport layer's overhead).
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
    kv = _Kv(layouts[2], layouts[3], timeout_s)
    steps: dict[str, Callable[[], float]] = {
        "notif_rtt_raw": raw.rtt,
        "notif_rtt_transport": kv.rtt,
        "read_raw": lambda: raw.read(got, want),
        "read_transport": lambda: kv.read(got, want),
    }
    try:
        samples = interleave(steps, iterations)
        for holder, reader in ((0, 1), (2, 3)):
            if not np.array_equal(mems[reader][:, :blocks], mems[holder][:, num_blocks - blocks :]):
                raise RuntimeError("the read did not move the expected bytes")
    finally:
        kv.close()
        raw.close()
    config = {
        **read_config(iterations=iterations, blocks=blocks, regions=regions, block_len=block_len),
        "gets_per_read": regions,  # consecutive blocks merge into one get per region
        "ucx_tls": DEFAULT_UCX_OPTIONS["TLS"],
    }
    return overhead_report(config, samples)


if __name__ == "__main__":  # python -m kvproto_transports.ucx.bench
    import json

    print(json.dumps(measure_overhead(), indent=2))
