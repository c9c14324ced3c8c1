"""D, worker side: heartbeat from enqueue, read when the session is open, trust only HELD.

Per request the worker sees, through the scheduler's metadata, ``Track``
(enqueued), ``Recv`` (blocks allocated: read into them) and a finish (left the
scheduler). The :class:`~kvproto.reader.Reader` decides; this class only
plumbs and keeps vLLM's reporting rules:

* ``finished_recving`` is reported only for a request that waits in
  WAITING_FOR_REMOTE_KVS (``Recv.awaiting``), exactly once, when the reader's
  verdict is in: ``ReadConfirmed`` (the holder answered HELD, so the blocks
  were held through the read) or ``RequestFailed`` -- then also in
  ``failed_recving`` and its local blocks in ``get_block_ids_with_load_errors``,
  so vLLM recomputes the request (policy ``recompute``) or fails it
  (``fail``); it is never decoded from unconfirmed blocks.
* A request aborted while its read is in flight is reported only once the
  read has ended (its verdict), so no READ can land in blocks vLLM reused; a
  request that failed while its read is in flight reaches us only then too
  (the binding holds the failure: ``Binding``).
* A failure before the blocks were allocated (handshake refused, lease lost
  while queued) is remembered and reported when the ``Recv`` arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import cast

from kvproto.events import ReadDeclined, ReadDeferred, RequestFailed
from kvproto.reader import Reader
from kvproto.transport import TransportError
from kvproto_binding.sidechannel import (
    CompatMismatch,
    HandshakeClient,
    HandshakeFailed,
    HandshakeSucceeded,
)
from kvproto_binding.step import Binding, StepResult

from .block_parts import CannotRegroup, PagedRegions
from .metadata import Recv, Track

log = logging.getLogger("vllm.kvproto_connector.reader")


@dataclass(frozen=True, slots=True)
class RegistrationKey:
    """The handshake key of a push-mode registration (other keys: (engine, rank))."""

    request_id: str
    """The decoder's request whose blocks are registered."""
    engine: str
    """The writer (prefill) engine."""
    rank: int
    """The writer rank it is sent to."""


@dataclass(slots=True)
class _Read:
    recv: Recv
    started: bool = False
    aborted: bool = False
    deferred: bool = False


@dataclass(slots=True)
class ReaderCounters:
    """Adapter-level counters of the reader half (the core keeps the protocol ones)."""

    finished_recving: int = 0
    """Requests reported finished_recving (confirmed or failed)."""
    failed_recving: int = 0
    """Requests reported failed_recving (recomputed by vLLM)."""
    handshake_failures: int = 0
    """Side-channel handshakes that failed (after retries)."""
    compat_mismatches: int = 0
    """Of those, refused because the engines' compat hashes differ."""
    track_errors: int = 0
    """Tracks the reader refused (duplicate id)."""
    read_errors: int = 0
    """Reads the transport refused synchronously (layout mismatch...)."""


class LoadReports:
    """What a decoder half reports to vLLM about its loads (a read's, or push mode's
    write's): finished, failed (recomputed), and the failed loads' blocks."""

    def __init__(self) -> None:
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._bad_blocks: set[int] = set()

    def take(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) for this step."""
        out = (self._recving, self._failed)
        self._recving, self._failed = set(), set()
        return out

    def take_bad_blocks(self) -> set[int]:
        """Local blocks of failed loads (vLLM's get_block_ids_with_load_errors)."""
        out, self._bad_blocks = self._bad_blocks, set()
        return out


class ReaderWorker(LoadReports):
    """The reader half of one worker rank."""

    def __init__(
        self,
        reader: Reader,
        client: HandshakeClient,
        *,
        record: Callable[[str, str, str], None],
        pages: PagedRegions | str = "no page views",
    ) -> None:
        """``pages``: this rank's registered regions as pages, for reads of larger local
        blocks from smaller holder blocks (:mod:`.block_parts`), or why there are none
        (such reads then fail, and their requests are recomputed)."""
        super().__init__()
        self.reader = reader
        self.client = client
        self.binding: Binding | None = None
        self.counters = ReaderCounters()
        self._record = record
        self._pages = pages
        self._holders: dict[str, tuple[str, int]] = {}
        self._reads: dict[str, _Read] = {}
        self._verdicts: dict[str, str | None] = {}
        self._handshakes: dict[Hashable, int] = {}
        """Per holder rank, handshakes started (``submit`` returned True) whose result is
        not polled yet: while there are none, poll_handshakes skips the client's lock (a
        cold call at every engine step)."""
        self._refusal_queued = False
        """A ``submit`` returned False: refused, its failure already queued for
        ``poll_results``, or already pending (no result of its own)."""
        self.registrations_failed: list[str] = []
        """Push mode: requests whose registration did not reach a writer rank (the
        worker's :class:`~.push_holder.PushHolder` takes them)."""

    # ------------------------------------------------------------ orders

    def apply(
        self, now: float, tracks: list[Track], recvs: list[Recv], finishes: list[str]
    ) -> None:
        """This step's orders from the scheduler, in their causal order."""
        for track in tracks:
            self._holders[track.ticket.holder_engine] = (track.host, track.port)
            if self.reader.is_tracked(track.request_id):
                # Our scheduler half sent one request's Track twice: a bug, counted and
                # logged; the first tracking stands.
                self.counters.track_errors += 1
                log.error("request %s not tracked: it is tracked already", track.request_id)
                self._verdicts[track.request_id] = "track-refused"
                continue
            self.reader.track(
                now, request_id=track.request_id, ticket=track.ticket, readers=track.readers
            )
            self._record("tracked", track.request_id, f"lease {track.ticket.lease}")
        for recv in recvs:
            rid = recv.request_id
            if recv.problem is not None and rid not in self._verdicts:
                self._reader_finish(now, rid)  # nothing will be read: the holder frees now
                self._verdicts[rid] = "unpairable-blocks"
            if rid in self._verdicts:
                # Failed while it waited for blocks (or never tracked): report now.
                reason = self._verdicts.pop(rid)
                self._reads[rid] = _Read(recv, started=True)
                self._resolve(now, rid, failure=reason or "failed-before-read")
                continue
            self._reads[rid] = _Read(recv)
        for rid in finishes:
            self._finish(now, rid)

    def _finish(self, now: float, rid: str) -> None:
        read = self._reads.get(rid)
        if read is not None and read.started:
            read.aborted = True  # report when its read has ended
            return
        self._verdicts.pop(rid, None)
        self._reader_finish(now, rid)
        if read is not None:
            del self._reads[rid]
            if read.recv.awaiting:
                # vLLM delayed the free of an aborted WAITING_FOR_REMOTE_KVS request
                # until we report it; nothing was read into its blocks.
                self._recving.add(rid)
                self.counters.finished_recving += 1
            self._record("aborted", rid, "before read")

    def _reader_finish(self, now: float, rid: str) -> None:
        # Not tracked or already finished: the reader counts it (stats.untracked_finishes).
        self.reader.finish(now, rid)

    def add_holder(self, engine: str, host: str, port: int) -> None:
        """Where holder ``engine``'s rank-0 side channel listens (push mode: a decoder
        that registered blocks for this engine to write)."""
        self._holders[engine] = (host, port)

    def register(self, key: RegistrationKey, host: str, port: int, payload: bytes) -> None:
        """Push mode: send a registration on the side channel of ``key``'s writer rank;
        a failure shows up in :attr:`registrations_failed` after a later pump."""
        self._submit(key, host, port, key.rank, registration=payload)

    def _submit(
        self, key: Hashable, host: str, port: int, rank: int, *, registration: bytes = b""
    ) -> None:
        if self.client.submit(key, host, port, rank, registration=registration):
            self._handshakes[key] = self._handshakes.get(key, 0) + 1
        else:
            self._refusal_queued = True

    # ------------------------------------------------------------ the loop

    def poll_handshakes(self, now: float) -> None:
        assert self.binding is not None
        if not self._handshakes and not self._refusal_queued:
            return
        self._refusal_queued = False
        for res in self.client.poll_results():
            # A refusal comes only while its key is not pending: a started handshake of
            # that key has then queued its result too, in this batch (floor at zero).
            started = self._handshakes.pop(res.peer_key, 0)
            if started > 1:
                self._handshakes[res.peer_key] = started - 1
            if isinstance(res.peer_key, RegistrationKey):
                if isinstance(res, HandshakeFailed):
                    self._handshake_failed(res)
                    self.registrations_failed.append(res.peer_key.request_id)
                continue
            engine, rank = cast(tuple[str, int], res.peer_key)
            if isinstance(res, HandshakeSucceeded):
                try:
                    self.binding.connected(
                        now, engine=engine, rank=rank, metadata=res.reply.metadata
                    )
                    self._record("connected", engine, f"rank {rank}, {res.attempts} attempt(s)")
                    continue
                except TransportError as exc:
                    log.error("holder %s rank %d: unusable metadata: %s", engine, rank, exc)
            else:
                self._handshake_failed(res)
            self.binding.connect_failed(now, engine=engine, rank=rank)

    def _handshake_failed(self, res: HandshakeFailed) -> None:
        self.counters.handshake_failures += 1
        key = res.peer_key
        engine, rank = (
            (key.engine, key.rank)
            if isinstance(key, RegistrationKey)
            else cast(tuple[str, int], key)
        )
        if isinstance(res.error, CompatMismatch):
            self.counters.compat_mismatches += 1
            log.error(
                "KV handshake with prefill engine %s (rank %d at %s:%d) refused: the engines "
                "are not compatible (%s). They must run the same vLLM and model -- loaded from "
                "the same path --, dtype, KV cache dtype, KV cache groups and kv_transport. Its "
                "requests are recomputed locally.",
                engine,
                rank,
                res.host,
                res.port,
                res.error,
            )
            self._record("handshake-failed", engine, "compat-mismatch")
        else:
            log.warning(
                "KV handshake with prefill engine %s (rank %d at %s:%d) failed after %d "
                "attempt(s): %s; its requests are recomputed locally",
                engine,
                rank,
                res.host,
                res.port,
                res.attempts,
                res.reason,
            )
            self._record("handshake-failed", engine, type(res.error).__name__)

    def on_result(self, now: float, result: StepResult) -> None:
        for connect in result.connects:
            host, port = self._holders.get(connect.engine, ("", 0))
            if not host:
                assert self.binding is not None
                self.binding.connect_failed(now, engine=connect.engine, rank=connect.rank)
                continue
            key = (connect.engine, connect.rank)
            self._submit(key, host, port + connect.rank, connect.rank)
        for failed in result.failed:
            self._failed_request(now, failed)
        for rid in result.confirmed:
            self._resolve(now, rid, failure=None)

    def _failed_request(self, now: float, failed: RequestFailed) -> None:
        rid = failed.request_id
        if rid in self._reads:
            self._resolve(now, rid, failure=failed.reason.value)
        else:
            self._verdicts[rid] = failed.reason.value
            self._record("failed", rid, failed.reason.value + " (queued)")

    def start_ready_reads(self, now: float) -> bool:
        """Issue every planned read whose holder sessions are open; whether any started.

        A deferred read stays planned and is tried again at every later pump."""
        assert self.binding is not None
        if not self._reads:
            return False  # most pumps: nothing planned, no list to build
        started = False
        for rid, read in list(self._reads.items()):
            if read.started:
                continue
            if not self.reader.is_tracked(rid):
                read.started = True
                self._resolve(now, rid, failure="not-tracked")
                continue
            if not self.reader.ready_to_read(rid):
                continue
            read.started = True
            if read.recv.ratio > 1 and isinstance(self._pages, str):
                # Unreachable with vLLM 0.32's layouts; reading would leave a page
                # that attention cannot use, so the holder frees and vLLM recomputes.
                log.error("request %s: blocks in parts not readable: %s", rid, self._pages)
                self._fail_parts(now, rid)
                started = True
                continue
            try:
                decision = self.binding.start_read(
                    now,
                    rid,
                    local_blocks=read.recv.local_block_ids,
                    remote_blocks=read.recv.remote_block_ids,
                    local_parts=read.recv.local_parts,
                    parts=read.recv.ratio,
                )
            except TransportError as exc:
                # The binding only absorbs unreachable peers; a layout or registration
                # mismatch surfaces here. Fail the request rather than the step.
                self.counters.read_errors += 1
                log.error("request %s: read refused: %s", rid, exc)
                self._fail_parts(now, rid)
                started = True
                continue
            if isinstance(decision, ReadDeferred):
                # The lease was renewed early (a long step left it unheartbeated): ask
                # again at the next pump, once the holder answered. Without an answer
                # by ``until`` the reader fails the request itself (on_result reports it).
                read.started = False
                if not read.deferred:  # once, not at every pump it is asked again
                    read.deferred = True
                    self._record("deferred", rid, f"until {decision.until:.3f}")
                continue
            started = True
            if isinstance(decision, ReadDeclined):
                self._record("declined", rid, decision.reason.value)
        return started

    def _fail_parts(self, now: float, rid: str) -> None:
        # Every holder rank the request reads from; none once the reader stopped tracking it.
        ranks = list(self.reader.state(rid)) if self.reader.is_tracked(rid) else []
        for rank in ranks:
            self.reader.read_failed(now, rid, rank)
        if not ranks:
            self._resolve(now, rid, failure="read-failed")

    def _resolve(self, now: float, rid: str, *, failure: str | None) -> None:
        read = self._reads.pop(rid, None)
        if read is None:
            return
        if read.aborted:
            self._reader_finish(now, rid)
        if failure is None and not read.aborted:
            failure = self.regroup(rid, read.recv)
        if failure is None:
            self._record("confirmed", rid, f"{len(read.recv.local_block_ids)} blocks")
        else:
            self._record("failed", rid, failure)
            if not read.aborted:
                log.info("request %s: load failed (%s): vLLM recomputes it", rid, failure)
        if not read.recv.awaiting:
            return  # full local hit: the request never waited for us
        self._recving.add(rid)
        self.counters.finished_recving += 1
        if failure is not None and not read.aborted:
            self._failed.add(rid)
            self._bad_blocks.update(read.recv.local_block_ids)
            self.counters.failed_recving += 1

    def regroup(self, rid: str, recv: Recv) -> str | None:
        """Put the parts of a confirmed read's (or a filled write's) blocks in page order;
        why not, as a failure reason (nothing to do at ratio 1)."""
        if recv.ratio == 1:
            return None
        try:
            if isinstance(self._pages, str):
                raise CannotRegroup(self._pages)
            self._pages.regroup(
                recv.ratio, recv.local_block_ids, recv.local_parts, recv.filled_block_ids
            )
        except (CannotRegroup, KeyError, IndexError) as exc:
            log.error("request %s: blocks not regrouped (recomputed): %s", rid, exc)
            return "regroup-failed"
        return None

    # ------------------------------------------------------------ reporting

    def verdict(self, rid: str) -> str | None:
        """Why ``rid``'s tracking failed before its blocks were allocated, if it did."""
        return self._verdicts.get(rid)

    def pending(self) -> int:
        """Planned reads without a verdict yet."""
        return len(self._reads)

    def idle(self) -> bool:
        """Nothing to pump for: no planned read, no handshake that can have a result,
        no tracked request and no timer of the reader (a done to re-send, say)."""
        return (
            not self._reads
            and not self._handshakes
            and not self._refusal_queued
            and self.reader.tracked() == 0
            and self.reader.get_timer() is None
        )
