"""Reads on a thread of their own: one batched Mooncake READ per request.

``batch_transfer_async_read`` submits every segment of a request as one
batch; the Python API's only complete wait on a batch,
``get_batch_transfer_status([batch])``, blocks (it spins, GIL released,
until every task of the batch completed, one failed, or the engine's
transfer timeout passed) and frees the batch. ``transfer_check_status``
does not block but looks at task 0 only and frees the batch when that one
completes, so it cannot wait on a batch of several segments. Both stay off
the caller's thread: the worker submits every queued request, then waits on
them in order, and hands each outcome to ``on_done`` *after* the data is in
local memory. That is where the transport sends the read's notify, so the
holder can only see it once the data has left its memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvproto.transport import PeerId, ReadId

from ._engine import BAD_BATCH_IDS


@dataclass(slots=True, kw_only=True)
class ReadJob:
    """One ``read_blocks`` call, planned."""

    read_id: ReadId
    """The handle ``read_blocks`` returned."""
    peer: PeerId
    """The holder."""
    session: str
    """The holder engine's session name (``host:rpc_port``)."""
    local_addrs: list[int]
    """Destination address of each segment."""
    remote_addrs: list[int]
    """Source address of each segment in the holder's registered memory."""
    lengths: list[int]
    """Bytes of each segment; empty lists: a zero-block read."""
    notify: bytes | None
    """What the holder receives once the data is here."""


_STOP = object()


class ReadWorker:
    """Submits and waits on reads; ``on_done(job, None)`` on success, else ``(job, reason)``."""

    def __init__(
        self, engine: Any, on_done: Callable[[ReadJob, str | None], None], *, name: str
    ) -> None:
        self._engine = engine
        self._on_done = on_done
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: ReadJob) -> None:
        """Queue a read; never blocks."""
        self._queue.put(job)

    def stop(self, timeout_s: float) -> bool:
        """Finish what is queued, then end; False if the thread is still inside the engine."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._engine = None  # the transport destroys it; this must not keep it alive
        return True

    def _run(self) -> None:
        while True:
            jobs: list[ReadJob] = []
            item = self._queue.get()
            stopping = False
            while True:
                if item is _STOP:
                    stopping = True
                    break
                assert isinstance(item, ReadJob)
                jobs.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._serve(jobs)
            if stopping:
                return

    def _serve(self, jobs: list[ReadJob]) -> None:
        waiting: list[tuple[ReadJob, int | None]] = []
        for job in jobs:  # submit all first: the engine moves them concurrently
            if not job.lengths:
                waiting.append((job, None))
                continue
            try:
                batch = int(
                    self._engine.batch_transfer_async_read(
                        job.session, job.local_addrs, job.remote_addrs, job.lengths
                    )
                )
            except Exception as exc:  # a binding error ends this read, never the thread
                self._on_done(job, f"batch_transfer_async_read raised {type(exc).__name__}: {exc}")
                continue
            if batch in BAD_BATCH_IDS:
                self._on_done(job, f"batch_transfer_async_read({job.session}) = {batch}")
                continue
            waiting.append((job, batch))
        for job, pending in waiting:
            if pending is None:
                self._on_done(job, None)
                continue
            try:
                rc = int(self._engine.get_batch_transfer_status([pending]))
            except Exception as exc:
                self._on_done(job, f"get_batch_transfer_status raised {type(exc).__name__}: {exc}")
                continue
            self._on_done(job, None if rc == 0 else f"batch read from {job.session} failed ({rc})")
