"""What NixlTransport costs on top of raw NIXL calls, measured side by side in one run.

:func:`measure_overhead` builds two raw NIXL agents and two NixlTransports in
this process, with the same memory layout, and alternates the two variants
iteration by iteration (so machine noise hits both alike):

* notification round trip: A sends, B polls until it has it and answers, A
  polls until it has the answer;
* a READ of ``blocks`` blocks of every region with a notification attached,
  from post to the reader seeing completion.

Both sides are polled from this one thread, as a binding would poll its
endpoint each tick; without NIXL's progress thread (the default here) a READ
over UCX's TCP transport moves only while the holder polls too.

What the raw floor leaves out, that a request through the transport must do
(so the ratio can never reach 1): the READ's descriptor indices are built
once, outside the timed loop, where every request has its own block ids
(``NixlTransport`` builds them per request: 24k instructions a side of the
default READ, about half its excess over this loop; see ``descriptor_ids.py``);
the raw loop never drains the reader's own
notifications, which every ``poll`` must (one more ``get_new_notifs`` per
poll); and without a progress thread a transport ``send`` also progresses
the sender once so the message leaves before the next poll (one more
``get_new_notifs`` per notification). Completion is checked alike: both
wait for ``DONE`` and release the handle inside the timed read, and both
READ waits are one inline loop of the holder's progress and the reader's
check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvproto.tpmath import BlockLayout, descriptor_ids
from kvproto.transport import ReadCompleted, ReadFailed, Received, TransportEvent
from kvproto_transports.benchloop import (
    host_layout,
    interleave,
    overhead_report,
    partial_hit,
    read_config,
    spin,
)

from ._library import load_nixl
from .transport import NixlTransport


def _rows(layout: BlockLayout) -> np.ndarray:
    descs = np.array(layout.descriptors(), dtype=np.uint64)
    return np.column_stack([descs, np.zeros(len(descs), dtype=np.uint64)])


READ_POLLS = 10_000_000
"""Polls a READ may take before the bench gives up (either side: a stuck READ fails the
run instead of hanging it). A count, not a clock, so neither timed loop reads the time
per poll; a poll costs at least a microsecond, so this is several seconds at least."""


class _Raw:
    """Two raw NIXL agents set up as vLLM's NixlConnector does it."""

    def __init__(
        self,
        mem_h: np.ndarray,
        mem_r: np.ndarray,
        shape: tuple[int, int, int],
        progress_thread: bool,
        timeout_s: float,
    ) -> None:
        regions, num_blocks, block_len = shape
        api = load_nixl()
        self.h = api.agent_cls(
            "bench-raw-holder", api.config_cls(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        self.r = api.agent_cls(
            "bench-raw-reader", api.config_cls(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        lh = host_layout(mem_h, regions, num_blocks, block_len)
        lr = host_layout(mem_r, regions, num_blocks, block_len)
        for agent, lay in ((self.h, lh), (self.r, lr)):
            agent.register_memory(
                [(a, block_len * num_blocks, 0, "") for a in lay.region_addrs], "DRAM"
            )
        self.r.add_remote_agent(self.h.get_agent_metadata())
        self.h.add_remote_agent(self.r.get_agent_metadata())
        self.local = self.r.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(lr), "DRAM")
        self.remote = self.r.prep_xfer_dlist("bench-raw-holder", _rows(lh), "DRAM")
        self.timeout_s = timeout_s

    def close(self) -> None:
        """Drop the agents while their registered memory is still alive."""
        self.local.release()
        self.remote.release()
        del self.h, self.r

    def rtt(self) -> float:
        h, r = self.h, self.r
        t0 = time.perf_counter()
        r.send_notif("bench-raw-holder", b"ping")

        def holder_has() -> bool:
            r.get_new_notifs()  # the sender's progress
            return _has(h.get_new_notifs(), b"ping")

        spin(holder_has, self.timeout_s, "raw ping")
        h.send_notif("bench-raw-reader", b"pong")

        def reader_has() -> bool:
            h.get_new_notifs()
            return _has(r.get_new_notifs(), b"pong")

        spin(reader_has, self.timeout_s, "raw pong")
        return time.perf_counter() - t0

    def read(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> float:
        t0 = time.perf_counter()
        handle = self.r.make_prepped_xfer(
            "READ", self.local, local_ids, self.remote, remote_ids, notif_msg=b"done"
        )
        state = self.r.transfer(handle)
        for _ in range(READ_POLLS):
            if state != "PROC":
                break
            self.h.get_new_notifs()  # the holder's progress serves the READ
            state = self.r.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw READ ended {state}")
        self.r.release_xfer_handle(handle)  # timed: the transport releases inside its poll
        return time.perf_counter() - t0


class _Kv:
    """Two NixlTransports with the same layout."""

    def __init__(
        self,
        mem_h: np.ndarray,
        mem_r: np.ndarray,
        shape: tuple[int, int, int],
        progress_thread: bool,
        timeout_s: float,
    ) -> None:
        regions, num_blocks, block_len = shape
        self.h = NixlTransport(name_prefix="bench-h", progress_thread=progress_thread)
        self.r = NixlTransport(name_prefix="bench-r", progress_thread=progress_thread)
        self.h.register_blocks(host_layout(mem_h, regions, num_blocks, block_len))
        self.r.register_blocks(host_layout(mem_r, regions, num_blocks, block_len))
        self.hpeer = self.r.add_peer(self.h.metadata())
        self.rpeer = self.h.add_peer(self.r.metadata())
        self.timeout_s = timeout_s

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self.r.send(self.hpeer, b"ping")
        spin(lambda: _got(self.h, self.r, _payload(b"ping")), self.timeout_s, "ping")
        self.h.send(self.rpeer, b"pong")
        spin(lambda: _got(self.r, self.h, _payload(b"pong")), self.timeout_s, "pong")
        return time.perf_counter() - t0

    def read(self, local: list[int], remote: list[int]) -> float:
        # The raw loop's wait, event for call: the holder's progress, then the reader's check.
        r, h = self.r, self.h
        t0 = time.perf_counter()
        read_id = r.read_blocks(
            self.hpeer, local_blocks=local, remote_blocks=remote, notify=b"done"
        )
        for _ in range(READ_POLLS):
            h.progress()
            for event in r.poll():
                if isinstance(event, ReadCompleted) and event.read_id == read_id:
                    return time.perf_counter() - t0
                if isinstance(event, ReadFailed):
                    raise RuntimeError(f"READ failed: {event}")
        raise RuntimeError(f"READ not done after {READ_POLLS} polls")

    def close(self) -> None:
        self.r.close()
        self.h.close()


def measure_overhead(
    *,
    iterations: int = 200,
    blocks: int = 64,
    regions: int = 8,
    block_len: int = 4096,
    num_blocks: int = 128,
    progress_thread: bool = False,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Notification round trip and a ``blocks``-block READ: raw NIXL vs NixlTransport.

    Returns medians/percentiles in microseconds per variant and the ratios
    ``transport / raw`` of the medians (the protocol layer's overhead).
    """
    shape = (regions, num_blocks, block_len)
    mems = [np.full(shape, i, dtype=np.uint8) for i in range(4)]
    raw = _Raw(mems[0], mems[1], shape, progress_thread, timeout_s)
    kv = _Kv(mems[2], mems[3], shape, progress_thread, timeout_s)
    got, want = partial_hit(blocks, num_blocks)
    ids_local = np.asarray(descriptor_ids(got, regions, num_blocks), dtype=np.int32)
    ids_remote = np.asarray(descriptor_ids(want, regions, num_blocks), dtype=np.int32)
    steps: dict[str, Callable[[], float]] = {
        "notif_rtt_raw": raw.rtt,
        "notif_rtt_transport": kv.rtt,
        "read_raw": lambda: raw.read(ids_local, ids_remote),
        "read_transport": lambda: kv.read(got, want),
    }
    try:
        samples = interleave(steps, iterations)
        if bytes(mems[3][regions - 1, 0]) != bytes(mems[2][regions - 1, want[0]]):
            raise RuntimeError("the READ did not move the expected bytes")
    finally:
        kv.close()
        raw.close()
    config = {
        **read_config(iterations=iterations, blocks=blocks, regions=regions, block_len=block_len),
        "descriptors_per_read": blocks * regions,
        "progress_thread": progress_thread,
        "nixl_module": load_nixl().module,
    }
    return overhead_report(config, samples)


def _payload(payload: bytes) -> Callable[[TransportEvent], bool]:
    return lambda e: isinstance(e, Received) and e.payload == payload


def _has(notifs: dict[str, list[bytes]], payload: bytes) -> bool:
    return any(payload in msgs for msgs in notifs.values())


def _got(t: NixlTransport, other: NixlTransport, match: Callable[[TransportEvent], bool]) -> bool:
    """Poll ``t`` (and let ``other`` progress) once; whether a matching event came.

    Events that do not match (a READ's late ``done`` at the holder) are dropped,
    as a raw NIXL loop drops what it does not look for.
    """
    other.progress()
    found = False
    for event in t.poll():  # one pass, as the raw loop's one scan of its notifications
        if isinstance(event, ReadFailed):
            raise RuntimeError(f"READ failed: {event}")
        found = found or match(event)
    return found


if __name__ == "__main__":  # python -m kvproto_transports.nixl.bench
    import json

    print(json.dumps(measure_overhead(), indent=2))
