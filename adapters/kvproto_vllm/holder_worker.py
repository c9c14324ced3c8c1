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
            self.holder.adopt(now, grant.ticket)
            self._record("granted", grant.request_id, f"lease {grant.ticket.lease}")

    def _refuse(self, grant: Grant, why: str) -> None:
        # Never strand the blocks: vLLM delayed their free for us, so give them back.
        self.bad_grants += 1
        log.error("request %s: lease not adopted (%s); freeing its blocks", grant.request_id, why)
        self._sending.add(grant.request_id)
        self._record("freed", grant.request_id, "NOT_ADOPTED")

    def on_freed(self, freed: Iterable[FreeBlocks]) -> None:
        for free in freed:
            self._sending.add(free.request_id)
            self._record("freed", free.request_id, free.reason.name)

    def take_sending(self) -> set[str]:
        """Requests whose blocks vLLM may free now (this step's finished_sending)."""
        out, self._sending = self._sending, set()
        return out
