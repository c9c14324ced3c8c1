"""Push mode, D (worker side): register the blocks P writes, turn the lease's end into a load.

The scheduler granted a writable lease T_D on a request's allocated blocks
(:class:`.metadata.Recv` with ``writable``; every rank adopts it from the same step's
grants). Here each rank sends the registration (:mod:`.push_registration`) to the P
ranks that write into it, and reports the lease's end (spec/push-mode.md §7):

* ``FreeBlocks(DONE)``, no ``WriteFenced`` before it: every expected writer's done
  arrived after its data: ``finished_recving``, the blocks are used (written in parts
  where D's blocks are larger than P's, they are put in the page order first, as a
  read's are: :meth:`.reader_worker.ReaderWorker.regroup`);
* any other ``FreeBlocks`` (expired, revoked, peer lost, or after a ``WriteFenced``):
  a failed load, ``finished_recving`` + ``failed_recving`` with the blocks as load
  errors, so vLLM recomputes into them, which is safe only now: no write can land;
* ``WriteFenced``: nothing yet, the request keeps waiting for the ``FreeBlocks``.

T_D is revoked when nothing will write it any more: its registration did not reach a
writer, P's lease T_P failed here (P lost or its blocks gone), or the request left the
scheduler. The reader of T_P finishes when the scheduler's ``finishes`` say so, after
the outcome (:class:`.reader_worker.ReaderWorker`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvproto.events import FreeBlocks, ReleaseReason, WriteFenced
from kvproto.tpmath import holder_ranks

from .holder_worker import HolderWorker
from .metadata import Recv, Track
from .push_registration import Registration, encode_registration, external_id
from .reader_worker import LoadReports, ReaderWorker, RegistrationKey

log = logging.getLogger("vllm.kvproto_connector.push")


@dataclass(slots=True)
class _Load:
    recv: Recv
    fenced: bool = False
    aborted: bool = False


class PushHolder(LoadReports):
    """The decoder's push half of one worker rank."""

    def __init__(
        self,
        holder_worker: HolderWorker,
        reader_worker: ReaderWorker,
        *,
        rank: int,
        tp_size: int,
        host: str,
        port: int,
        record: Callable[[str, str, str], None],
    ) -> None:
        """``host``/``port``: this engine's rank-0 side channel, named in registrations."""
        super().__init__()
        self._holders = holder_worker
        self._readers = reader_worker
        self._rank = rank
        self._tp = tp_size
        self._host = host
        self._port = port
        self._record = record
        self._tracks: dict[str, Track] = {}
        """Request id → its prefill lease's Track (until its load is registered)."""
        self._loads: dict[str, _Load] = {}
        self.registrations = 0
        """Registrations sent (one per writer rank)."""
        self.fenced = 0
        """Writable leases that ended while a write could still land (WriteFenced)."""

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` waits here for a write."""
        return request_id in self._loads

    def apply(self, now: float, tracks: Iterable[Track], recvs: Iterable[Recv]) -> None:
        """This step's orders: remember the prefill leases, register the writable ones."""
        for track in tracks:
            self._tracks[track.request_id] = track
        for recv in recvs:
            assert recv.writable is not None
            rid = recv.request_id
            known = self._tracks.get(rid)
            self._loads[rid] = load = _Load(recv)
            if rid in self._holders.refused_writable:
                self._holders.refused_writable.remove(rid)
                self._end(rid, load, "NOT_ADOPTED")
                continue
            if recv.early is not None:
                self._register_early(load)
                continue
            if known is None or self._readers.verdict(rid) is not None:
                # Its prefill lease failed while the request waited for blocks.
                self.revoke(now, rid, "prefill lease failed before the registration")
                continue
            self._register(known, load)

    def _register(self, track: Track, load: _Load) -> None:
        recv, writable = load.recv, load.recv.writable
        assert writable is not None
        writer_tp = track.ticket.holder_tp_size
        payload = encode_registration(
            Registration(
                ticket=writable,
                writer_request_id=track.ticket.request_id,
                host=self._host,
                port=self._port,
                holder_blocks=list(recv.local_block_ids),
                writer_blocks=list(recv.remote_block_ids),
                parts=recv.ratio,
                holder_parts=list(recv.local_parts),
            )
        )
        writers = self._send(
            recv.request_id,
            track.ticket.holder_engine,
            track.host,
            track.port,
            writer_tp=writer_tp,
            payload=payload,
        )
        self._record(
            "registered", recv.request_id, f"lease {writable.lease} to writer ranks {writers}"
        )

    def _register_early(self, load: _Load) -> None:
        """Register before the prefill finished: D's blocks per group, no pairs (the
        writer pairs them with its own when it has them)."""
        recv, early, writable = load.recv, load.recv.early, load.recv.writable
        assert early is not None and writable is not None
        payload = encode_registration(
            Registration(
                ticket=writable,
                writer_request_id=external_id(recv.request_id),
                host=self._host,
                port=self._port,
                holder_blocks=[],
                writer_blocks=[],
                holder_groups=[list(group) for group in early.local_groups],
                allocated=list(early.allocated),
                block_size=early.block_size,
            )
        )
        self._send(
            recv.request_id,
            early.engine,
            early.host,
            early.port,
            writer_tp=early.tp_size,
            payload=payload,
        )
        self._record(
            "registered-early", recv.request_id, f"lease {writable.lease} to {early.engine}"
        )

    def _send(
        self, rid: str, engine: str, host: str, port: int, *, writer_tp: int, payload: bytes
    ) -> list[int]:
        """Send ``payload`` to every writer rank that writes into this rank; their ranks."""
        writers = [
            q for q in range(writer_tp) if self._rank in holder_ranks(q, writer_tp, self._tp)
        ]
        for q in writers:
            self._readers.register(RegistrationKey(rid, engine, q), host, port + q, payload)
            self.registrations += 1
        return writers

    def revoke(self, now: float, rid: str, why: str) -> None:
        """End ``rid``'s writable lease now (freed at once, or once no write can land)."""
        load = self._loads.get(rid)
        lease = self._holders.lease_of(rid)
        holder = self._holders.holder
        if load is None or lease is None or holder is None or not holder.is_live(lease):
            return
        log.info("request %s: writable lease %d revoked: %s", rid, lease, why)
        holder.revoke(now, lease)

    def finish(self, now: float, rid: str) -> None:
        """The request left the scheduler: an outcome still to come is an abort's."""
        load = self._loads.get(rid)
        if load is not None:
            load.aborted = True
            self.revoke(now, rid, "the request left the scheduler")
        self._tracks.pop(rid, None)

    def prefill_failed(self, now: float, rid: str) -> None:
        """The reader of ``rid``'s prefill lease gave it up (P lost, lease lost)."""
        self.revoke(now, rid, "its prefill lease failed")

    def registrations_failed(self, now: float, rids: list[str]) -> None:
        for rid in rids:
            self.revoke(now, rid, "its registration did not reach the prefill engine")
        rids.clear()

    def on_fenced(self, fenced: Iterable[WriteFenced]) -> None:
        for fence in fenced:
            load = self._loads.get(fence.request_id)
            if load is None:
                continue
            load.fenced = True
            self.fenced += 1
            log.warning(
                "request %s: writable lease %d ended (%s) while a write may still land: its "
                "blocks stay quarantined until none can, then it is recomputed",
                fence.request_id,
                fence.lease,
                fence.reason.name,
            )
            self._record("fenced", fence.request_id, fence.reason.name)

    def on_ended(self, ended: Iterable[FreeBlocks]) -> None:
        for free in ended:
            load = self._loads.get(free.request_id)
            if load is not None:
                outcome = free.reason.name
                if free.reason is ReleaseReason.DONE and not load.fenced:
                    # Every part was written whole: put them in the page order.
                    regrouped = self._readers.regroup(free.request_id, load.recv)
                    outcome = "filled" if regrouped is None else regrouped
                self._end(free.request_id, load, outcome)

    def _end(self, rid: str, load: _Load, outcome: str) -> None:
        del self._loads[rid]
        self._recving.add(rid)
        if outcome != "filled" and not load.aborted:
            self._failed.add(rid)
            self._bad_blocks.update(load.recv.local_block_ids)
        self._record("written" if outcome == "filled" else "load-failed", rid, outcome)
