"""The binding: the small loop between a Transport and the sans-I/O cores.

aioquic's ``asyncio/protocol.py`` in miniature. The binding owns nothing but
plumbing: every :meth:`Binding.step` it

1. polls the transport and feeds what arrived into the cores (frames to the
   holder or the reader by message kind, lost peers to both, read results to
   the reader),
2. runs the cores' timers when due,
3. drains the cores and carries out their outputs (send frames, issue reads,
   ask for connections, report freed blocks and failed or confirmed requests).

The caller supplies ``now`` (so the loopback simulator and real deployments
use the same code) and answers :class:`~kvproto.events.Connect` requests by
calling :meth:`Binding.connected` once it has the holder's transport
metadata (from the side channel, or directly for loopback).

One binding serves one engine rank. It may host a holder, a reader or both
(bidirectional turn-2 blocks), which share the transport: native frames are
routed by their message tag, stock-vLLM text frames go to the holder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvproto import wire
from kvproto.errors import LocalProtocolError
from kvproto.events import (
    Connect,
    FreeBlocks,
    HolderOutput,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReaderOutput,
    ReadGo,
    ReadOrder,
    RequestFailed,
    SendFrame,
    WriteFenced,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.tpmath import BlockSlice, blocks_to_read
from kvproto.transport import (
    FrameTooLarge,
    PeerId,
    PeerLost,
    PeerUnreachable,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    Transport,
    TransportError,
    UnknownPeer,
    WritableTransport,
    WriteCompleted,
    WriteFailed,
    WriteId,
)

log = logging.getLogger("kvproto.binding")

_HOLDER_TAGS = wire.TO_HOLDER_TAGS
_READER_TAGS = wire.TO_READER_TAGS


def frame_tag(data: bytes) -> int | None:
    """The message tag of a native frame, or None if it is not one (legacy text, junk)."""
    return wire.peek_tag(data)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one :meth:`Binding.step` produced for the engine."""

    freed: tuple[FreeBlocks, ...] = ()
    """Holder: blocks the engine may reuse now."""
    failed: tuple[RequestFailed, ...] = ()
    """Reader: requests that must be recomputed."""
    confirmed: tuple[str, ...] = ()
    """Reader: requests whose loaded blocks are safe to use."""
    connects: tuple[Connect, ...] = ()
    """Reader: holders to make reachable (answer with :meth:`Binding.connected`)."""
    fenced: tuple[WriteFenced, ...] = ()
    """Holder, writable leases (push mode): ended while a writer may still write; the
    request recomputes, the blocks wait for their ``freed`` entry."""


NOTHING = StepResult()
"""What a step returns when the engine has nothing to do (most steps): one shared value."""

_EngineOutput = FreeBlocks | RequestFailed | ReadConfirmed | Connect | WriteFenced


def _step_result(outputs: list[_EngineOutput]) -> StepResult:
    """Sort the engine's outputs of one step by kind, each kind in the order it came."""
    return StepResult(
        freed=tuple(o for o in outputs if isinstance(o, FreeBlocks)),
        failed=tuple(o for o in outputs if isinstance(o, RequestFailed)),
        confirmed=tuple(o.request_id for o in outputs if isinstance(o, ReadConfirmed)),
        connects=tuple(o for o in outputs if isinstance(o, Connect)),
        fenced=tuple(o for o in outputs if isinstance(o, WriteFenced)),
    )


@dataclass(slots=True)
class BindingStats:
    """Plumbing counters (the cores keep the protocol ones)."""

    send_failures: int = 0
    """Sends the transport refused because the peer is unreachable or unknown."""
    oversize_sends: int = 0
    """Frames the transport refused as too large (a sizing bug: they are never truncated)."""
    dropped_sends: int = 0
    """Frames the transport refused for another reason (back-pressure); the protocol repeats."""
    unroutable: int = 0
    """Frames for a role this binding does not host."""
    failures_held: int = 0
    """Request failures held back until the request's reads in flight ended."""


@dataclass(slots=True)
class _Parts:
    """The transfers between one holder rank's share of a request and blocks that each
    hold several of the other side's (the decoder's are larger): one READ (pull: into a
    part of the reader's blocks) or WRITE (push: into a part of the holder's) per part,
    and the done only once all landed (a done attached to one of them could free the
    holder's blocks under the others, or tell it a half-written block is whole)."""

    request_id: str
    rank: int
    peer: PeerId
    notify: bytes
    """The done to send when the last transfer has landed (empty: a sibling carries it)."""
    left: int = 0
    """Transfers still in flight."""
    failed: bool = False
    write: bool = False
    """WRITEs (push mode), else READs."""


def part_slice(within: BlockSlice, part: int, parts: int) -> BlockSlice:
    """Slice ``within`` (a TP share) of part ``part`` of ``parts`` equal parts of a block."""
    return BlockSlice(index=part * within.parts + within.index, parts=parts * within.parts)


class Binding:
    """Binds one transport endpoint to an engine rank's holder and/or reader."""

    def __init__(
        self,
        transport: Transport,
        *,
        holder: Holder | None = None,
        reader: Reader | None = None,
    ) -> None:
        if holder is None and reader is None:
            raise LocalProtocolError("a binding needs a holder, a reader or both")
        self.transport = transport
        self.holder = holder
        self.reader = reader
        self.stats = BindingStats()
        self._reads: dict[ReadId, tuple[str, int] | _Parts] = {}
        self._writes: dict[WriteId, tuple[str, int] | _Parts] = {}
        """Writes in flight (push mode): (request id, holder rank), or a write in parts."""
        self._held_failures: dict[str, RequestFailed] = {}
        """Failures of requests with reads in flight, surfaced when the last read ends."""
        self._cores: tuple[Holder | Reader, ...] = tuple(
            c for c in (holder, reader) if c is not None
        )
        self._drain_cores: Callable[[], Sequence[HolderOutput | ReaderOutput]]
        if holder is not None and reader is not None:
            self._drain_cores = lambda: [*holder.drain(), *reader.drain()]
        else:
            self._drain_cores = self._cores[0].drain
        # Frame tag -> the core it goes to (None: unroutable); other tags use _any_role.
        self._route_by_tag: dict[int | None, Holder | Reader | None] = {None: holder}
        self._route_by_tag.update(dict.fromkeys(_HOLDER_TAGS, holder))
        self._route_by_tag.update(dict.fromkeys(_READER_TAGS, reader))
        self._any_role = holder if holder is not None else reader
        self._engine_outputs: list[_EngineOutput] = []
        self._drain_again = False  # a lost peer gave the cores more to do mid-flush

    # ----------------------------------------------------------- engine API

    def connected(self, now: float, *, engine: str, rank: int, metadata: bytes) -> PeerId:
        """The holder ``(engine, rank)``'s metadata arrived: add the peer and say Hello."""
        reader = self._need_reader()
        peer = self.transport.add_peer(metadata)
        reader.connected(now, engine=engine, rank=rank, peer=peer)
        self._flush(now)
        return peer

    def connect_failed(self, now: float, *, engine: str, rank: int) -> None:
        """The holder ``(engine, rank)`` cannot be reached: its requests recompute."""
        self._need_reader().connect_failed(now, engine=engine, rank=rank)
        self._flush(now)

    def start_read(
        self,
        now: float,
        request_id: str,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_parts: Sequence[int] = (),
        parts: int = 1,
    ) -> ReadGo | ReadDeferred | ReadDeclined:
        """Begin the reads of a request (one per holder rank), with the done attached.

        A partial prefix hit reads only the tail of ``remote_blocks``; zero
        local blocks still sends the done (the transport's notify-only read).
        With ``parts > 1`` each local block takes ``parts`` holder blocks (the
        decoder's blocks are larger): the lists are paired one to one, remote block
        ``i`` filling part ``local_parts[i]`` of local block ``i``; each part is one
        READ into that part of the local blocks, and the done follows the last.
        ``ReadDeferred``: nothing was read; the early heartbeat was sent here.
        Call again at a later step (after the holder's answer, which
        :meth:`step` applies); if it has not come by ``until`` the request
        shows up in ``StepResult.failed`` by itself.
        """
        reader = self._need_reader()
        decision = reader.begin_read(now, request_id)
        if isinstance(decision, ReadGo):
            tail = blocks_to_read(local_blocks, remote_blocks)
            split = (
                _split_parts(local_blocks, remote_blocks, local_parts, parts) if parts > 1 else {}
            )
            local = list(local_blocks)
            for order in decision.orders:
                if split and order.carries_data:
                    self._in_parts(now, request_id, order, split, parts, write=False)
                    continue
                if not order.notify and not (order.carries_data and tail):
                    # Nothing to move and no done to carry (a sibling's read carries the
                    # lease's done): landed as soon as issued.
                    reader.read_completed(now, request_id, order.holder_rank)
                    continue
                try:
                    # A done-only order (replicated KV read from another rank) is the
                    # transport's notify-only read: no block, the notification alone.
                    read_id = self.transport.read_blocks(
                        order.peer,
                        local_blocks=local if order.carries_data else [],
                        remote_blocks=tail if order.carries_data else [],
                        local_slice=order.local_slice,
                        remote_slice=order.remote_slice,
                        notify=order.notify or None,
                    )
                except TransportError as exc:
                    # Unreachable peer, layout mismatch, ...: that part cannot be read, so the
                    # request recomputes (read_failed fails the whole request once).
                    log.warning("read of %s from %s refused: %s", request_id, order.peer, exc)
                    reader.read_failed(now, request_id, order.holder_rank)
                    continue
                self._reads[read_id] = (request_id, order.holder_rank)
        self._flush(now)
        return decision

    def start_write(
        self,
        now: float,
        request_id: str,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        remote_parts: Sequence[int] = (),
        parts: int = 1,
    ) -> ReadGo | ReadDeferred | ReadDeclined:
        """Push mode: arm, then begin the writes of a ``writes=True`` request (one per
        holder rank), each with its done attached (spec/push-mode.md).

        ``ReadDeferred``: the Arms went out and nothing was written; call again at a
        later step (after the holder's answers, which :meth:`step` applies). The pairs
        are one to one: ``local_blocks[i]`` is written into the holder's
        ``remote_blocks[i]``. With ``parts > 1`` each holder block takes ``parts`` of
        ours (the holder's blocks are larger): ``local_blocks[i]`` fills part
        ``remote_parts[i]`` of ``remote_blocks[i]``, one WRITE per part, and the done
        follows once all landed (remote completion), alone, as a zero-block write's
        notification. The request's local blocks are read by the transport until
        the write ends: a failure of the request meanwhile is held back until then,
        as for a read. Misuse (:class:`LocalProtocolError`): a transport that does
        not write.
        """
        reader = self._need_reader()
        transport = self._writable()
        decision = reader.begin_write(now, request_id)
        if isinstance(decision, ReadGo):
            split = (
                _split_parts(remote_blocks, local_blocks, remote_parts, parts) if parts > 1 else {}
            )
            for order in decision.orders:
                if split and order.carries_data:
                    self._in_parts(now, request_id, order, split, parts, write=True)
                    continue
                try:
                    write_id = transport.write_blocks(
                        order.peer,
                        local_blocks=local_blocks if order.carries_data else [],
                        remote_blocks=remote_blocks if order.carries_data else [],
                        local_slice=order.local_slice,
                        remote_slice=order.remote_slice,
                        notify=order.notify or None,
                    )
                except TransportError as exc:
                    log.warning("write of %s to %s refused: %s", request_id, order.peer, exc)
                    reader.write_failed(now, request_id, order.holder_rank)
                    continue
                self._writes[write_id] = (request_id, order.holder_rank)
        self._flush(now)
        return decision

    def _in_parts(
        self,
        now: float,
        request_id: str,
        order: ReadOrder,
        split: dict[int, tuple[list[int], list[int]]],
        parts: int,
        *,
        write: bool,
    ) -> None:
        """One transfer per part of the larger blocks (ours for a READ, the holder's for
        a WRITE), no done attached (see :class:`_Parts`). ``split``: part -> (the blocks
        in parts, the whole ones paired with them)."""
        group = _Parts(request_id, order.holder_rank, order.peer, order.notify, write=write)
        for part, (in_parts, whole) in split.items():
            try:
                if write:
                    transfer_id = self._writable().write_blocks(
                        order.peer,
                        local_blocks=whole,
                        remote_blocks=in_parts,
                        local_slice=order.local_slice,
                        remote_slice=part_slice(order.remote_slice, part, parts),
                    )
                else:
                    transfer_id = self.transport.read_blocks(
                        order.peer,
                        local_blocks=in_parts,
                        remote_blocks=whole,
                        local_slice=part_slice(order.local_slice, part, parts),
                        remote_slice=order.remote_slice,
                    )
            except TransportError as exc:
                if write:
                    log.warning("write of %s to %s refused: %s", request_id, order.peer, exc)
                else:
                    log.warning("read of %s from %s refused: %s", request_id, order.peer, exc)
                group.failed = True
                break
            group.left += 1
            (self._writes if write else self._reads)[transfer_id] = group
        if not group.left:
            self._part_ended(now, request_id, order.holder_rank, write=write, ok=False)

    def _parts_landed(self, now: float, group: _Parts) -> None:
        """The last transfer of a :class:`_Parts` ended: fail it, or send its done."""
        if group.failed or not group.notify:
            ok = not group.failed
            self._part_ended(now, group.request_id, group.rank, write=group.write, ok=ok)
            return
        try:
            # Every part is in place now (in our memory, or remotely completed in the
            # holder's): the done may go, a zero-block transfer's notification.
            if group.write:
                done_id = self._writable().write_blocks(
                    group.peer, local_blocks=[], remote_blocks=[], notify=group.notify
                )
                self._writes[done_id] = (group.request_id, group.rank)
            else:
                done_id = self.transport.read_blocks(
                    group.peer, local_blocks=[], remote_blocks=[], notify=group.notify
                )
                self._reads[done_id] = (group.request_id, group.rank)
        except TransportError as exc:
            log.warning("done of %s to %s refused: %s", group.request_id, group.peer, exc)
            self._part_ended(now, group.request_id, group.rank, write=group.write, ok=False)

    def _part_ended(self, now: float, request_id: str, rank: int, *, write: bool, ok: bool) -> None:
        """Tell the reader core how the transfer to or from holder ``rank`` ended.

        A request finished (aborted) while its transfer was in flight is the core's
        counted no-op (``stats.late_read_results``), not an error."""
        reader = self._need_reader()
        if write:
            (reader.write_completed if ok else reader.write_failed)(now, request_id, rank)
        else:
            (reader.read_completed if ok else reader.read_failed)(now, request_id, rank)

    def _writable(self) -> WritableTransport:
        transport = self.transport
        if not isinstance(transport, WritableTransport) or not transport.capabilities.writes:
            raise LocalProtocolError(f"transport {transport.name} does not write")
        return transport

    def step(self, now: float) -> StepResult:
        """Poll, run timers, execute outputs. Returns what the engine must act on."""
        for event in self.transport.poll():
            if isinstance(event, Received):
                self._route(now, event.peer, event.payload)
            elif isinstance(event, PeerLost):
                self._peer_lost(now, event.peer)
            elif isinstance(event, ReadCompleted):
                self._transfer_result(now, event.read_id, write=False, ok=True)
            elif isinstance(event, ReadFailed):
                log.warning("read %d failed: %s", event.read_id, event.reason)
                self._transfer_result(now, event.read_id, write=False, ok=False)
            elif isinstance(event, WriteCompleted):
                self._transfer_result(now, event.write_id, write=True, ok=True)
            elif isinstance(event, WriteFailed):
                log.warning("write %d failed: %s", event.write_id, event.reason)
                self._transfer_result(now, event.write_id, write=True, ok=False)
        for core in self._cores:
            timer = core.get_timer()
            if timer is not None and timer <= now:
                core.handle_timer(now)
        self._flush(now)
        outputs = self._engine_outputs
        if not outputs:
            return NOTHING
        self._engine_outputs = []
        return _step_result(outputs)

    def next_deadline(self) -> float | None:
        """The earliest time a core needs :meth:`step` even if nothing arrives."""
        due = [t for t in (c.get_timer() for c in self._cores) if t is not None]
        return min(due) if due else None

    # ------------------------------------------------------------ plumbing

    def _route(self, now: float, peer: PeerId, payload: bytes) -> None:
        # Native holder-bound frames, legacy text and junk (tag None) go to the holder.
        target = self._route_by_tag.get(wire.peek_tag(payload), self._any_role)
        if target is None:
            self.stats.unroutable += 1
            return
        target.handle_frame(now, peer, payload)

    def _peer_lost(self, now: float, peer: PeerId) -> None:
        self._drain_again = True
        if self.holder is not None:
            reader = self.holder.reader_of(peer)
            before = self.holder.stats.peer_lost
            self.holder.peer_lost(now, peer)
            freed = self.holder.stats.peer_lost - before
            if reader is not None:
                # An operator's first question after a decoder dies: were its blocks freed?
                log.warning(
                    "reader %s rank %d (peer %s) lost: %d lease(s) freed at once (PEER_LOST)",
                    reader[0],
                    reader[1],
                    peer,
                    freed,
                )
        if self.reader is not None:
            self.reader.peer_lost(now, peer)

    def _transfer_result(self, now: float, transfer_id: int, *, write: bool, ok: bool) -> None:
        entry = (self._writes if write else self._reads).pop(transfer_id, None)
        if entry is None or self.reader is None:
            return
        if isinstance(entry, _Parts):
            entry.left -= 1
            entry.failed = entry.failed or not ok
            if entry.left:
                return
            request_id = entry.request_id
            self._parts_landed(now, entry)
        else:
            request_id, rank = entry
            self._part_ended(now, request_id, rank, write=write, ok=ok)
        if request_id in self._held_failures and not self._reading(request_id):
            self._engine_outputs.append(self._held_failures.pop(request_id))

    def _reading(self, request_id: str) -> bool:
        """Whether a transport read into ``request_id``'s blocks (or a write out of them)
        is still in flight."""
        # Asked only for failed requests (rare), so a scan beats a second index kept
        # up to date on every read.
        return any(
            (e.request_id if isinstance(e, _Parts) else e[0]) == request_id
            for e in self._reads.values()
        ) or self.writing(request_id)

    def writing(self, request_id: str) -> bool:
        """Whether a write out of ``request_id``'s blocks is still in flight (push mode: the
        writer's engine keeps those blocks until it ended, whatever its own leases say)."""
        return any(
            (e.request_id if isinstance(e, _Parts) else e[0]) == request_id
            for e in self._writes.values()
        )

    def _flush(self, now: float) -> None:
        """Carry out every output until the cores are quiet.

        Carrying out an output gives a core more only when a send finds its peer lost,
        so one drain per core suffices unless :meth:`_peer_lost` ran meanwhile.
        """
        while True:
            self._drain_again = False
            for out in self._drain_cores():  # every core's, before any is carried out
                if isinstance(out, SendFrame):
                    self._send(now, out)
                elif isinstance(out, RequestFailed) and self._reading(out.request_id):
                    # The reader gave the request up (its lease lost, say) while a READ
                    # into its blocks is still in flight: the engine would recompute into,
                    # or reuse, blocks that READ may still write. Surface the failure
                    # once the last read ended (_transfer_result).
                    self._held_failures[out.request_id] = out
                    self.stats.failures_held += 1
                else:
                    self._engine_outputs.append(out)
            if not self._drain_again:
                return

    def _send(self, now: float, out: SendFrame) -> None:
        try:
            self.transport.send(out.peer, out.payload)
        except FrameTooLarge:
            self.stats.oversize_sends += 1
            log.error(
                "frame of %d bytes refused as too large by %s",
                len(out.payload),
                self.transport.name,
            )
        except (PeerUnreachable, UnknownPeer) as exc:
            self.stats.send_failures += 1
            log.info("send to %s failed (%s): treating the peer as lost", out.peer, exc)
            self._peer_lost(now, out.peer)
        except TransportError as exc:
            # Back-pressure and the like: the frame is dropped. The protocol tolerates loss
            # (changes repeat until acknowledged, an unacknowledged done fences the read).
            self.stats.dropped_sends += 1
            log.warning("send to %s dropped: %s", out.peer, exc)

    def _need_reader(self) -> Reader:
        if self.reader is None:
            raise LocalProtocolError("this binding hosts no reader")
        return self.reader


def _split_parts(
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    local_parts: Sequence[int],
    parts: int,
) -> dict[int, tuple[list[int], list[int]]]:
    """part -> (local blocks, remote blocks) of its transfer, from one-to-one pair lists
    (``local``: the side whose blocks are in parts: ours for a read, the holder's for a
    write)."""
    if not len(local_blocks) == len(remote_blocks) == len(local_parts):
        raise LocalProtocolError(
            f"{len(local_blocks)} blocks in parts, {len(remote_blocks)} whole blocks and "
            f"{len(local_parts)} parts: the pairs of a transfer in parts are one to one"
        )
    split: dict[int, tuple[list[int], list[int]]] = {}
    for lb, rb, part in zip(local_blocks, remote_blocks, local_parts, strict=True):
        if not 0 <= part < parts:
            raise LocalProtocolError(f"part {part} of a block moved in {parts} parts")
        mine, theirs = split.setdefault(part, ([], []))
        mine.append(lb)
        theirs.append(rb)
    return split
