"""Push mode, P (worker side): take D's registrations and write P's blocks into D's.

A registration (:mod:`.push_registration`) arrives with a decoder rank's introduction
on this rank's side channel. The reader core tracks D's writable ticket with
``writes=True`` (it claims and heartbeats D's lease, and arms right before the write,
spec/push-mode.md W2), one tracked request per writable lease, named
``<P's request id>#<D engine>#<lease>``: the parallel-sampling children of one prefill
each register a lease of their own on D for the same source blocks. Once
:meth:`Reader.write_ready`, :meth:`Binding.start_write` arms and then writes. A write
starts only while P still holds its own lease on the source blocks; once started, a free
of those blocks waits for the write's end
(:meth:`.holder_worker.HolderWorker.release_written`). The verdict (confirmed: D got the
data; failed) ends the tracking here; D's outcome reaches P as the end of P's own lease
(D finishes it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable

from kvproto.events import ReadDeclined, ReadGo
from kvproto.reader import Reader
from kvproto.transport import TransportError
from kvproto_binding.sidechannel import Introduction
from kvproto_binding.step import Binding, StepResult

from .holder_worker import HolderWorker
from .push_registration import Registration, decode_registration
from .reader_worker import ReaderWorker

log = logging.getLogger("vllm.kvproto_connector.push")

LEASES_REMEMBERED = 4096
"""Writable leases recently registered here: a registration re-sent (a handshake retry,
or several decoder ranks written by this rank) is taken once."""


@dataclasses.dataclass(slots=True)
class _Write:
    registration: Registration
    started: bool = False


class PushWriter:
    """The prefill engine's push half of one worker rank."""

    def __init__(
        self,
        holder_worker: HolderWorker,
        reader_worker: ReaderWorker,
        *,
        record: Callable[[str, str, str], None],
    ) -> None:
        self._holders = holder_worker
        self._readers = reader_worker
        self._record = record
        self._writes: dict[str, _Write] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.bad_registrations = 0
        """Registrations that did not decode (dropped)."""
        self.written = 0
        """Writes D confirmed (its done was held)."""
        self.write_failures = 0
        """Writes that failed, were declined or never began (D recomputes)."""

    @property
    def _reader(self) -> Reader:
        return self._readers.reader

    def pending(self) -> int:
        """Registered requests without a verdict yet."""
        return len(self._writes)

    def on_introduction(self, now: float, intro: Introduction) -> None:
        """A decoder rank's introduction; with a registration, track its lease to write."""
        if not intro.registration:
            return
        reg = decode_registration(intro.registration)
        if reg is None:
            self.bad_registrations += 1
            log.warning("malformed push registration from %s dropped", intro.requester)
            return
        key = (reg.ticket.holder_engine, reg.ticket.lease)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > LEASES_REMEMBERED:
            self._seen.popitem(last=False)
        # One tracked request per writable lease: parallel-sampling children on D register
        # one lease each for the same source blocks (P's request id).
        rid = f"{reg.writer_request_id}#{key[0]}#{key[1]}"
        if self._reader.is_tracked(rid):
            self.bad_registrations += 1
            log.error("request %s: a second push registration dropped", rid)
            return
        self._readers.add_holder(reg.ticket.holder_engine, reg.host, reg.port)
        self._writes[rid] = _Write(reg)
        self._reader.track(now, request_id=rid, ticket=reg.ticket, writes=True)
        self._record("registration", rid, f"lease {reg.ticket.lease} of {reg.ticket.holder_engine}")

    def writing_from(self, source: str, binding: Binding) -> bool:
        """Whether a write out of request ``source``'s blocks (P's request id) is in flight
        (a tracked write keeps its entry until its verdict, which follows its end)."""
        return any(
            w.started and w.registration.writer_request_id == source and binding.writing(rid)
            for rid, w in self._writes.items()
        )

    def start_ready(self, now: float, binding: Binding) -> bool:
        """Arm or write every registered request whose claims were acknowledged; whether
        any write started or ended here."""
        acted = False
        for rid, write in list(self._writes.items()):
            if write.started or not self._reader.is_tracked(rid):
                continue
            if not self._reader.write_ready(rid):
                continue
            if not self._source_held(rid):
                # P's own lease ended first (D gave it up, or it expired): its blocks may
                # be reused already, so nothing is written; D recomputes on the abort.
                log.warning("request %s: not written, its blocks were freed here", rid)
                self._end(now, rid, "source-freed")
                acted = True
                continue
            reg = write.registration
            try:
                decision = binding.start_write(
                    now,
                    rid,
                    local_blocks=reg.writer_blocks,
                    remote_blocks=reg.holder_blocks,
                    remote_parts=reg.holder_parts,
                    parts=reg.parts,
                )
            except TransportError as exc:
                log.error("request %s: write refused: %s", rid, exc)
                self._end(now, rid, "write-refused")
                acted = True
                continue
            if isinstance(decision, ReadGo):
                write.started = acted = True
                self._record("writing", rid, f"{len(reg.writer_blocks)} blocks")
            elif isinstance(decision, ReadDeclined):
                self._end(now, rid, f"declined: {decision.reason.value}")
                acted = True
        return acted

    def _source_held(self, rid: str) -> bool:
        lease = self._holders.lease_of(self._writes[rid].registration.writer_request_id)
        holder = self._holders.holder
        return lease is not None and holder is not None and holder.is_live(lease)

    def take_own(self, now: float, result: StepResult) -> StepResult:
        """Settle this half's verdicts in ``result``; the rest, for the reader half."""
        if not self._writes or not (result.confirmed or result.failed):
            return result
        confirmed = [r for r in result.confirmed if r in self._writes]
        failed = [f for f in result.failed if f.request_id in self._writes]
        if not confirmed and not failed:
            return result
        for rid in confirmed:
            self.written += 1
            self._end(now, rid, "")
        for fail in failed:
            self._end(now, fail.request_id, fail.reason.value)
        return dataclasses.replace(
            result,
            confirmed=tuple(r for r in result.confirmed if r not in confirmed),
            failed=tuple(f for f in result.failed if f not in failed),
        )

    def _end(self, now: float, rid: str, failure: str) -> None:
        """Stop tracking ``rid``'s write: written (``failure`` empty) or not."""
        if self._writes.pop(rid, None) is None:
            return
        self._reader.finish(now, rid)  # an unwritten lease is aborted: D frees at once
        if failure:
            self.write_failures += 1
            self._record("write-failed", rid, failure)
        else:
            self._record("written", rid, "confirmed")
