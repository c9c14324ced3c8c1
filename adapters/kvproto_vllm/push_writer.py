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

An *early* registration arrives before P's prefill finished (a proxy sent the request to
both engines at once). It is tracked at once -- P claims and heartbeats D's lease from
then on, so a long prefill keeps D's blocks, and arms only right before its write -- and
waits for the grant of P's request of the same external id
(:func:`.push_registration.external_id`), whose blocks are then paired with D's as D
would pair them (:func:`.groups.plan_pairs`). No decoder reads P's own lease then: P ends
it at the write's verdict. It is given up, and D recomputes, when P's request leaves the
scheduler without a grant, when its blocks cannot be paired, or when P's scheduler has
not reported holding it within one lease duration of the registration's arrival (the
proxy's call to P never arrived).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from kvproto.events import ReadDeclined, ReadGo
from kvproto.reader import Reader
from kvproto.transport import TransportError
from kvproto_binding.sidechannel import Introduction
from kvproto_binding.step import Binding, StepResult

from .groups import TransferGroups, plan_pairs
from .holder_worker import HolderWorker
from .metadata import Grant
from .push_registration import Registration, decode_registration, external_id
from .reader_worker import ReaderWorker

log = logging.getLogger("vllm.kvproto_connector.push")

LEASES_REMEMBERED = 4096
"""Writable leases recently registered here: a registration re-sent (a handshake retry,
or several decoder ranks written by this rank) is taken once."""


@dataclasses.dataclass(slots=True)
class _Write:
    registration: Registration
    started: bool = False
    arrived: float = 0.0
    source: str | None = None
    """Early: P's request id, once paired (P ends its own lease at the verdict)."""


class PushWriter:
    """The prefill engine's push half of one worker rank."""

    def __init__(
        self,
        holder_worker: HolderWorker,
        reader_worker: ReaderWorker,
        *,
        record: Callable[[str, str, str], None],
        groups: TransferGroups,
        unknown_after_s: float,
    ) -> None:
        """``groups``: this engine's KV cache groups (early registrations are paired with
        them); ``unknown_after_s``: how long an early registration waits for P's scheduler
        to report holding its request."""
        self._holders = holder_worker
        self._readers = reader_worker
        self._record = record
        self._groups = groups
        self._unknown_after_s = unknown_after_s
        self._prefilling: set[str] = set()
        """External ids of P's requests for a decoder, in the scheduler, not granted yet."""
        self._granted: OrderedDict[str, Grant] = OrderedDict()
        """External id → the grant of P's request (its blocks), recently granted."""
        self._writes: dict[str, _Write] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._dropped_recently: OrderedDict[str, None] = OrderedDict()
        """External ids of P's requests that left without a grant (a registration may
        arrive after)."""
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
        self._writes[rid] = _Write(reg, arrived=now)
        self._reader.track(now, request_id=rid, ticket=reg.ticket, writes=True)
        self._record(
            "registration-early" if reg.early else "registration",
            rid,
            f"lease {reg.ticket.lease} of {reg.ticket.holder_engine}",
        )
        if reg.early and reg.block_size != self._groups.block_size:
            log.warning(
                "request %s: registered before its prefill finished with blocks of %d tokens "
                "(here %d): not written, recomputed",
                rid,
                reg.block_size,
                self._groups.block_size,
            )
            self._end(now, rid, "unequal block sizes")
        elif reg.early and reg.writer_request_id in self._dropped_recently:
            self._end(now, rid, "prefill ended without its KV")

    def on_orders(
        self, now: float, prefills: Iterable[str], dropped: Iterable[str], grants: Iterable[Grant]
    ) -> None:
        """P's scheduler's news of this step: prefills for a decoder that entered it, left
        it without a grant, and grants (their blocks, for early registrations)."""
        for rid in prefills:
            self._prefilling.add(external_id(rid))
        for grant in grants:
            if grant.writable:
                continue
            ext = external_id(grant.request_id)
            self._prefilling.discard(ext)
            self._granted[ext] = grant
            if len(self._granted) > LEASES_REMEMBERED:
                self._granted.popitem(last=False)
        for rid in dropped:
            ext = external_id(rid)
            self._prefilling.discard(ext)
            self._dropped_recently[ext] = None
            if len(self._dropped_recently) > LEASES_REMEMBERED:
                self._dropped_recently.popitem(last=False)
            for key, write in list(self._writes.items()):
                if write.registration.early and write.registration.writer_request_id == ext:
                    self._end(now, key, "prefill ended without its KV")

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
            if write.registration.early and not self._pair(now, rid, write):
                acted = acted or rid not in self._writes
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

    def _pair(self, now: float, rid: str, write: _Write) -> bool:
        """Pair an early registration with P's blocks once P's request was granted; whether
        it is paired now (False: still waiting, or given up)."""
        reg = write.registration
        grant = self._granted.get(reg.writer_request_id)
        if grant is None:
            known = reg.writer_request_id in self._prefilling
            if not known and now - write.arrived >= self._unknown_after_s:
                log.warning(
                    "request %s: registered before its prefill, which this engine has not "
                    "held within %.0f s: not written, recomputed",
                    rid,
                    self._unknown_after_s,
                )
                self._end(now, rid, "no such prefill")
            return False
        write.source = grant.request_id
        try:
            pairs = plan_pairs(self._groups, reg.holder_groups, grant.block_ids, reg.allocated)
        except ValueError as exc:
            log.error("request %s: blocks not paired (recomputed): %s", rid, exc)
            self._end(now, rid, "unpaired")
            return False
        if not pairs.local:
            self._end(now, rid, "nothing to write")
            return False
        write.registration = msgspec.structs.replace(
            reg,
            writer_request_id=grant.request_id,
            holder_blocks=pairs.local,
            writer_blocks=pairs.remote,
            holder_groups=[],
            allocated=[],
        )
        self._record("paired", rid, f"{len(pairs.local)} blocks of {grant.request_id}")
        return True

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
        write = self._writes.pop(rid, None)
        if write is None:
            return
        self._reader.finish(now, rid)  # an unwritten lease is aborted: D frees at once
        if write.source is not None:
            self._end_source(now, write.source)
        if failure:
            self.write_failures += 1
            self._record("write-failed", rid, failure)
        else:
            self._record("written", rid, "confirmed")

    def _end_source(self, now: float, source: str) -> None:
        """Early: no decoder reads P's own lease on ``source``'s blocks (the registration
        came before it existed), so it ends with the write (a free that a write in flight
        still reads waits for it, :meth:`HolderWorker.release_written`)."""
        lease = self._holders.lease_of(source)
        holder = self._holders.holder
        if lease is not None and holder is not None and holder.is_live(lease):
            holder.revoke(now, lease)
