""":class:`~tests.core.net.Net` with writes: a holder's writable leases and writers filling them.

Push mode (spec/push-mode.md): the holder (D) grants a writable lease, the reader
(P, ``writes=True``) claims it and WRITEs. A write's data lands at the holder when
the transfer ends, and its done arrives then (after the data, as NIXL's ``notif_msg``
on a WRITE); a failed write lands nothing after it failed and carries no done. Every
write is recorded, with when its data could land, so that the oracle can check the
write fence: no write lands in blocks the holder let go (S1w). A writer that crashes
mid-write has its writes in flight end at the crash: their data lands then at the latest,
and their dones are lost with it. That is the transport contract the holder relies on
when it is told the peer is lost (spec/push-mode.md §5): a loss report comes only once
the peer can complete no write, and the harness reports a loss at the crash or later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvproto.events import FreeBlocks, ReadDeclined, ReadDeferred, ReadGo, WriteFenced
from kvproto.ticket import LeaseTicket

from .net import Net, Node


@dataclass
class WriteRecord:
    """One WRITE to one holder rank: its data may land at any time in [begin, end]."""

    writer: str
    request_id: str
    holder: str
    lease: int
    begin: float
    end: float
    failed: bool
    cut: bool = False
    """The writer crashed before ``end``: the data landed by the crash, no done came."""


class PushNet(Net):
    """Holders with writable leases and writers; see the module docstring."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fenced: list[tuple[float, str, WriteFenced]] = []
        self.writes: list[WriteRecord] = []

    def grant_writable(self, holder: str, request_id: str) -> LeaseTicket:
        ticket = self.holder(holder).grant(self.local(holder), request_id=request_id, writable=True)
        self.collect()
        return ticket

    def track_writer(self, writer: str, request_id: str, ticket: LeaseTicket) -> None:
        self.tickets[(writer, request_id)] = ticket
        self.reader(writer).track(
            self.local(writer), request_id=request_id, ticket=ticket, writes=True
        )
        self.collect()

    def start_write(
        self, writer: str, request_id: str, duration: float = 0.0, *, fail: bool = False
    ) -> ReadGo | ReadDeclined | None:
        """Arm and begin the write now: ``begin_write`` until it goes (the Arm's round trip;
        at once on a link without delay) or is declined. Each transfer ends ``duration``
        after it began: then its data has landed and its done arrives, or (``fail``) the
        transport reports it failed. The result is what ``begin_write`` said last (None: the
        request left the writer, finished, while its Arm was out)."""
        core = self.reader(writer)
        result = core.begin_write(self.local(writer), request_id)
        self.collect()
        while isinstance(result, ReadDeferred):
            self.run_until(self.now)  # the Arm and its ArmAck, if the links are instant
            if not core.is_tracked(request_id):
                return None  # it left meanwhile (finished): nothing is written
            result = core.begin_write(self.local(writer), request_id)
            self.collect()
            if isinstance(result, ReadDeferred):
                # Wait for the next frame to land (its ArmAck, say), at most until then.
                nxt = self._events[0][0] if self._events else math.inf
                self.run_until(min(nxt, result.until))
                if not core.is_tracked(request_id):
                    return None
        if isinstance(result, ReadDeclined):
            return result
        self._issue(writer, request_id, result, duration, fail)
        return result

    def _issue(self, writer: str, request_id: str, go: ReadGo, duration: float, fail: bool) -> None:
        core = self.reader(writer)
        ticket = self.tickets[(writer, request_id)]
        end = self.now + duration
        for order in go.orders:
            record = WriteRecord(writer, request_id, order.peer, ticket.lease, self.now, end, fail)
            self.writes.append(record)

            def finish_transfer(order=order, record=record) -> None:  # type: ignore[no-untyped-def]
                if record.cut:
                    return
                holder_node = self.nodes[order.peer]
                if not fail and order.notify and not holder_node.crashed:
                    self._arrive(writer, order.peer, order.notify, self.now)
                if self.nodes[writer].crashed:
                    return
                local = self.local(writer)
                if fail:
                    core.write_failed(local, request_id, order.holder_rank)
                else:
                    core.write_completed(local, request_id, order.holder_rank)
                self.collect()

            self.at(end, finish_transfer)

    def crash(self, name: str, *, detect_after: float | None = None) -> None:
        """As :meth:`Net.crash`; the node's writes in flight end now (see the docstring)."""
        for record in self.writes:
            if record.writer == name and record.end > self.now and not record.cut:
                record.end = self.now
                record.cut = True
        super().crash(name, detect_after=detect_after)

    def _route(self, node: Node, out: object) -> None:
        if isinstance(out, WriteFenced):
            self.fenced.append((self.now, node.name, out))
        else:
            super()._route(node, out)

    def fenced_leases(self) -> list[tuple[float, int, str]]:
        """(true time, lease, reason) of every WriteFenced."""
        return [(t, f.lease, f.reason.name) for t, _, f in self.fenced]

    def freed_at(self, holder: str, lease: int) -> float:
        """When ``holder`` freed ``lease`` (inf if it has not)."""
        times = [t for t, h, f in self.freed if h == holder and f.lease == lease]
        assert len(times) <= 1, f"lease {lease} freed {len(times)} times (S4)"
        return times[0] if times else math.inf

    def check_write_fence(self) -> None:
        """S1w: no write's data can land after its holder let the lease's blocks go, and a
        lease freed DONE (its blocks used) was filled by writes that all ended before."""
        for w in self.writes:
            freed = self.freed_at(w.holder, w.lease)
            assert freed >= w.end, (
                f"{w.holder} freed lease {w.lease} at {freed} while {w.writer}'s write "
                f"could land until {w.end}"
            )
        for t, holder, f in self.freed:
            assert isinstance(f, FreeBlocks)
            if f.reason.name == "DONE":
                for w in self.writes:
                    if w.holder == holder and w.lease == f.lease:
                        assert not w.failed and w.end <= t
