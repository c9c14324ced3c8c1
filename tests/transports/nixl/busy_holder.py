"""A child of test_nixl_busy_holder.py: ``python -m tests.transports.nixl.busy_holder ROLE DIR``.

``holder [thread|no-thread]``: registers its blocks, polls until the reader says it
stops, then neither polls nor progresses for :data:`STALL_S` (an engine step that
computes), then polls again for 1.5 s and prints ``survived``.
``reader``: one READ waited for, then :data:`READS` READs issued while the holder is
busy, then ``kill -9`` of itself with them unanswered.
The two find each other's metadata as files in DIR.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from kvproto.tpmath import BlockLayout
from kvproto.transport import ReadCompleted
from kvproto_transports.nixl import NixlTransport

NUM_BLOCKS = 64
BLOCK_BYTES = 64 * 1024
STALL_S = 2.0
READS = 8


def _wait_file(path: Path) -> bytes:
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    time.sleep(0.05)  # written whole (the writer renames it into place)
    return path.read_bytes()


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def main(role: str, folder: Path, mode: str = "thread") -> None:
    memory = np.ones(NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    transport = NixlTransport(progress_thread=role == "holder" and mode == "thread")
    transport.register_blocks(
        BlockLayout(
            region_addrs=(memory.ctypes.data,), block_lens=(BLOCK_BYTES,), num_blocks=NUM_BLOCKS
        )
    )
    _publish(folder / f"{role}.md", transport.metadata())
    other = "reader" if role == "holder" else "holder"
    peer = transport.add_peer(_wait_file(folder / f"{other}.md"))
    blocks = list(range(NUM_BLOCKS))
    if role == "holder":
        while not (folder / "stall").exists():
            transport.poll()
            time.sleep(0.001)
        time.sleep(STALL_S)
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            transport.poll()
            time.sleep(0.001)
        print("survived", flush=True)
        transport.close()
        return
    transport.read_blocks(peer, local_blocks=blocks, remote_blocks=blocks)
    while not any(isinstance(e, ReadCompleted) for e in transport.poll()):
        time.sleep(0.001)
    _publish(folder / "stall", b"")
    time.sleep(0.3)
    for _ in range(READS):
        transport.read_blocks(peer, local_blocks=blocks, remote_blocks=blocks)
        for _ in range(100):  # the requests leave this process
            transport.progress()
    print("reads issued", flush=True)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
