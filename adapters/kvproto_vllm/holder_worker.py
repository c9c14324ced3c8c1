"""P, worker side: adopt the scheduler's tickets, report freed leases as finished_sending.

One :class:`~kvproto.holder.Holder` per worker rank. Its incarnation comes
from the scheduler (with every step's metadata), so all TP ranks agree with
the tickets. Every way a lease ends -- read done, expired, aborted by the
reader, reader lost, revoked, max hold -- is a ``FreeBlocks`` from the core and
becomes exactly one ``finished_sending`` for the request: vLLM asserts the id
is still held (scheduler.py ``_update_from_kv_xfer_finished``), and the core
ends each lease once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvproto.config import LeaseConfig
from kvproto.events import FreeBlocks
from kvproto.holder import Holder

from .metadata import Grant

log = logging.getLogger("vllm.kvproto_connector.holder")


class HolderWorker:
    """The holder half of one worker rank."""

    def __init__(
        self,
        lease: LeaseConfig,
        *,
        engine_id: str,
        rank: int,
        tp_size: int,
        record: Callable[[str, str, str], None],
    ) -> None:
        self._lease = lease
        self._engine = engine_id
        self._rank = rank
        self._tp = tp_size
        self._record = record
        self.holder: Holder | None = None
        self._sending: set[str] = set()
        self.bad_grants = 0
        """Tickets the holder refused to adopt (their blocks are freed at once)."""
        self.refused_writable: list[str] = []
        """Push mode, D: requests whose writable lease was refused (they recompute)."""
        self._leases: dict[str, int] = {}
        """Request id → its lease held here, until the lease ends."""
        self._writable: set[str] = set()
        """Push mode, D: requests whose lease a prefill engine writes (their end is a
        load's outcome, not a free)."""
        self._held: set[str] = set()
        """Push mode, P: freed requests whose blocks a write still reads."""

    def ensure(self, incarnation: int) -> Holder:
        """The Holder for ``incarnation`` (created on the first step's metadata)."""
        if self.holder is None:
            self.holder = Holder(
                self._lease,
                engine=self._engine,
                incarnation=incarnation,
                rank=self._rank,
                tp_size=self._tp,
            )
        elif self.holder.incarnation != incarnation:
            # The scheduler draws one incarnation per engine start; a change means
            # a programming error, not a peer's doing: keep the first.
            log.error(
                "scheduler incarnation changed from %d to %d", self.holder.incarnation, incarnation
            )
        return self.holder

    def adopt(self, now: float, grants: Iterable[Grant]) -> None:
        for grant in grants:
            if self.holder is None:
                self._refuse(grant, "no holder (metadata without incarnation)")
                continue
            problem = self.holder.adoption_problem(grant.ticket)
            if problem is not None:
                self._refuse(grant, problem)
                continue
            self.holder.adopt(now, grant.ticket, writable=grant.writable)
            self._leases[grant.request_id] = grant.ticket.lease
            if grant.writable:
                self._writable.add(grant.request_id)
            kind = "granted-writable" if grant.writable else "granted"
            self._record(kind, grant.request_id, f"lease {grant.ticket.lease}")

    def _refuse(self, grant: Grant, why: str) -> None:
        self.bad_grants += 1
        if grant.writable:
            # Nothing will write the blocks: the request loads nothing (recompute).
            log.error("request %s: writable lease not adopted (%s)", grant.request_id, why)
            self.refused_writable.append(grant.request_id)
            return
        # Never strand the blocks: vLLM delayed their free for us, so give them back.
        log.error("request %s: lease not adopted (%s); freeing its blocks", grant.request_id, why)
        self._sending.add(grant.request_id)
        self._record("freed", grant.request_id, "NOT_ADOPTED")

    def lease_of(self, request_id: str) -> int | None:
        """The lease held here on ``request_id``'s blocks, while it has not ended."""
        return self._leases.get(request_id)

    def on_freed(
        self, freed: Iterable[FreeBlocks], writing: Callable[[str], bool]
    ) -> list[FreeBlocks]:
        """Report ended leases; returns those of writable leases (push mode, D: a load's
        outcome). A request whose blocks a write still reads (``writing``, push mode, P)
        is reported once :meth:`release_written` finds the write ended."""
        loads = []
        for free in freed:
            rid = free.request_id
            self._leases.pop(rid, None)
            if rid in self._writable:
                self._writable.discard(rid)
                loads.append(free)
            elif writing(rid):
                self._held.add(rid)
                self._record("free-held", rid, f"{free.reason.name}: a write reads the blocks")
            else:
                self._sending.add(rid)
                self._record("freed", rid, free.reason.name)
        return loads

    def release_written(self, writing: Callable[[str], bool]) -> None:
        """Report the held frees whose write has ended."""
        if not self._held:
            return
        for rid in [r for r in self._held if not writing(r)]:
            self._held.discard(rid)
            self._sending.add(rid)
            self._record("freed", rid, "after the write")

    def take_sending(self) -> set[str]:
        """Requests whose blocks vLLM may free now (this step's finished_sending)."""
        out, self._sending = self._sending, set()
        return out
