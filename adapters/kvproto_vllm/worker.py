"""The worker-side connector: one transport, one ``kvproto_binding.Binding``, the lease cores.

Lifecycle (vLLM calls, all on the worker's execution thread, never concurrently):

* ``register_kv_caches`` -- the KV tensors become one
  :class:`~kvproto.tpmath.BlockLayout` registered with the transport that
  ``kv_transport`` names (:mod:`.transport_choice`: NIXL without a progress
  thread -- it would spin a core per agent; the engine polls every step
  instead, see spec/nixl-transport.md section 1 -- or UCX, whose engine thread
  sleeps when idle). Past this point the worker only uses the Transport
  protocol. A holder (``kv_producer``) opens its side-channel server here
  (serving this rank's metadata and taking readers' introductions); a reader
  (``kv_consumer``) creates its Reader and handshake client.
* every step: ``start_load_kv`` applies the scheduler's orders and pumps
  (unless the worker is idle: :meth:`WorkerSide._idle`);
  ``get_transfer_results`` reports, and pumps again first while a transfer
  may be under way (:meth:`WorkerSide._transfers_pending`). A pump = add
  introduced readers, apply finished handshakes, :meth:`Binding.step` (poll
  the transport, feed the cores, run their timers, send their frames), issue
  reads that became possible.

Why so few calls: inside an engine every hook runs with caches the forward
pass has just evicted, so a step costs what it touches more than what it
executes (spec/benchmarks.md, "vLLM step": one NIXL ``get_new_notifs`` is
tens of times dearer cold than in a hot loop, and every Python call costs a
few microseconds). So an engine with no remote request skips the pump, a step
with no transfer under way skips the second one, a step skips the calls that
have no orders or results to handle, the transport's thread hook runs only
when the thread changed, and the stats snapshot is read only when due
(:meth:`WorkerSide.stats_due`).

Bad peer input never raises out of a step: the cores drop and count it, the
binding absorbs unreachable peers, and this module catches what is left
(metadata, layout) and fails the affected request instead.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvproto.reader import Reader
from kvproto.stats import counts_of
from kvproto.transport import Transport, TransportError
from kvproto_binding.step import Binding

from .block_parts import CannotRegroup, PagedRegions, paged_regions, region_heads
from .compat import (
    compat_factors,
    compat_hash,
    neighbour_hashes,
    side_channel_address,
    transfer_tp_size,
)
from .config import AdapterConfig
from .groups import TransferGroups, single_full_group
from .holder_worker import HolderWorker
from .kv_layout import KvLayout, kv_layout
from .metadata import KvprotoHandshakeMetadata, KvprotoMetadata
from .push_holder import PushHolder
from .push_writer import PushWriter
from .reader_worker import ReaderWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from kvproto_binding.sidechannel import SideChannelServer

    from .transport_choice import TransportAwareClient

log = logging.getLogger("vllm.kvproto_connector.worker")

_EVENTS_KEPT = 512
STATS_EVERY_S = 1.0
"""Longest a counter change waits to reach vLLM's stats while the engine steps, when
nothing this worker reported or applied has made the stats due earlier (a tenth of
vLLM's default 10 s stats log interval)."""


def route_kvproto_logs() -> None:
    """Send the binding's and transports' ``kvproto.*`` log lines through vLLM's handler.

    They log under ``kvproto`` (they know nothing of vLLM); in a vLLM process that
    logger has no handler, so Python's last-resort handler would print WARNINGs bare
    (no level, time or process) and drop INFO. Borrowing vLLM's handler and level
    gives an operator one log format, e.g. the WARNING naming a lost decoder."""
    ours = logging.getLogger("kvproto")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class WorkerSide:
    """Everything one worker rank runs for the connector."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: AdapterConfig,
        *,
        engine_id: str,
        num_blocks: int,
        holds: bool,
        reads: bool,
        tp: tuple[int, int] | None = None,
        groups: TransferGroups | None = None,
        kv_cache_config: Any | None = None,
    ) -> None:
        """``tp`` = (rank, size) overrides vLLM's TP group (tests run several ranks in one
        process); by default both come from vLLM. ``groups`` and ``kv_cache_config``: the
        engine's KV cache groups and placement (None: one full-attention group, its
        per-layer tensors registered as they are)."""
        route_kvproto_logs()
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.holds = holds
        self.reads = reads
        self.rank, self.tp_size = (
            tp if tp is not None else (_tp_rank(), transfer_tp_size(vllm_config))
        )
        self.groups = groups if groups is not None else single_full_group()
        self.kv_cache_config = kv_cache_config
        factors = compat_factors(
            vllm_config,
            kv_transport=cfg.kv_transport,
            groups=self.groups,
        )
        self.compat = compat_hash(factors)
        self._neighbour_hashes = neighbour_hashes(factors)
        self._factors = factors
        self.host, self.base_port = side_channel_address(vllm_config, cfg)
        self.stock_payload: bytes | None = None
        """Interop mode: what the scheduler's stock-format listener serves for this rank."""
        self.transport: Transport | None = None
        self._enter_thread: Callable[[], None] = _nothing
        """The chosen transport's per-call thread hook (NIXL's owner-thread rule)."""
        self.server: SideChannelServer | None = None
        self.binding: Binding | None = None
        self.holder_worker: HolderWorker | None = None
        self.reader_worker: ReaderWorker | None = None
        self.push_holder: PushHolder | None = None
        """Push mode: the decoder's half (registers its blocks, reports their loads)."""
        self.push_writer: PushWriter | None = None
        """Push mode: the prefill engine's half (writes into registered blocks)."""
        self.events: deque[tuple[float, str, str, str]] = deque(maxlen=_EVENTS_KEPT)
        """(monotonic time, kind, request or engine id, detail): recent decisions, for
        operators' debugging and the tests."""
        self.intro_errors = 0
        """Introductions whose metadata the transport refused."""
        self._kv_tensors: list[torch.Tensor] = []
        self._client: TransportAwareClient | None = None
        self._closed = False
        self._last_pump: float | None = None
        self._max_gap = 0.0
        self._quiet = False
        """The last pump left nothing to do (:meth:`_idle`): the next gap is not a lag."""
        self._thread: int | None = None
        """The thread the transport was last entered from (:meth:`_enter`)."""
        self._active = True
        """Orders applied or results produced since the stats were last read."""
        self._stats_at = float("-inf")
        """Pump time at which the stats were last read."""

    def record(self, kind: str, subject: str, detail: str) -> None:
        self.events.append((time.monotonic(), kind, subject, detail))

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # tensor_layout imports neither NIXL nor torch: it serves every transport.
        from kvproto_binding.sidechannel import SideChannelServer

        from .transport_choice import TransportAwareClient, build_transport

        registered = kv_layout(kv_caches, self.kv_cache_config, num_blocks=self.num_blocks)
        layout, names = registered.layout, registered.region_names
        # Transports keep raw addresses: the tensors must outlive the registration.
        self._kv_tensors = registered.tensors
        chosen = build_transport(
            self.cfg, name_prefix=f"kvproto-{self.engine_id[:12]}-r{self.rank}"
        )
        transport = chosen.transport
        self._enter_thread = chosen.enter_thread
        transport.register_blocks(layout)
        self.transport = transport
        detail = (
            f"{transport.name}: {layout.num_regions} regions x {layout.num_blocks} blocks "
            f"({registered.placement}{', split K/V' if registered.split_k_and_v else ''}, "
            f"block {layout.block_lens[0]} B; groups {self.groups.describe()})"
        )
        self.record("registered", transport.local_peer, detail)
        log.info(
            "rank %d: registered KV caches with %s (%s)", self.rank, transport.local_peer, detail
        )
        if self.holds and self.cfg.lease.accept_legacy:
            # parse_extra_config refuses accept_legacy unless kv_transport is "nixl".
            from kvproto_transports.nixl.wire import decode_metadata

            from .stock_interop import build_stock_payload

            meta, _ = decode_metadata(transport.metadata())
            self.stock_payload = build_stock_payload(
                self.vllm_config,
                engine_id=self.engine_id,
                agent_metadata=meta.agent_metadata,
                layout=layout,
                region_names=names,
            )
        if self.holds:
            self.holder_worker = HolderWorker(
                self.cfg.lease,
                engine_id=self.engine_id,
                rank=self.rank,
                tp_size=self.tp_size,
                record=self.record,
            )
            self.server = SideChannelServer(
                host=self.host,
                base_port=self.base_port + self.rank,
                compat_hash=self.compat,
                secret=self.cfg.side_channel_secret,
            )
            self.server.set_metadata(self.rank, transport.metadata())
            log.info("rank %d: side channel on %s:%d", self.rank, self.host, self.server.port)
        if self.reads:
            reader = Reader(
                self.cfg.lease,
                engine=self.engine_id,
                incarnation=secrets.randbits(63),
                rank=self.rank,
                tp_size=self.tp_size,
                replicated_kv=self.groups.mla,
            )
            client = TransportAwareClient(
                kv_transport=self.cfg.kv_transport,
                neighbours=self._neighbour_hashes,
                factors=self._factors,
                record=self.record,
                requester=f"{self.engine_id}/{self.rank}",
                compat_hash=self.compat,
                secret=self.cfg.side_channel_secret,
                requester_metadata=transport.metadata(),
                timeout_s=self.cfg.handshake_timeout_s,
                max_attempts=self.cfg.handshake_attempts,
            )
            self.reader_worker = ReaderWorker(
                reader, client, record=self.record, pages=self._pages(registered)
            )
            self._client = client
            if not self.holds:
                self._make_binding()
        if self.cfg.transfer_mode == "push":
            # parse_extra_config and the connector make every push engine hold and read.
            assert self.holder_worker is not None and self.reader_worker is not None
            self.push_holder = PushHolder(
                self.holder_worker,
                self.reader_worker,
                rank=self.rank,
                tp_size=self.tp_size,
                host=self.host,
                port=self.base_port,
                record=self.record,
            )
            self.push_writer = PushWriter(
                self.holder_worker,
                self.reader_worker,
                record=self.record,
                groups=self.groups,
                unknown_after_s=self.cfg.lease.kv_lease_duration,
            )

    def _pages(self, registered: KvLayout) -> PagedRegions | str:
        """The registered regions as pages (reads into blocks larger than the holder's
        regroup them), or why not: then such reads are refused, their requests recomputed."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        try:
            backends = {b.get_name() for b in get_current_attn_backends(self.vllm_config)}
            if len(backends) != 1:
                raise CannotRegroup(f"attention backends {sorted(backends)}")
            heads = region_heads(registered.region_names, self.kv_cache_config)
            return paged_regions(
                registered.layout, registered.tensors, heads, backend=backends.pop()
            )
        except (ValueError, AttributeError) as exc:  # CannotRegroup, or vLLM's config lacks it
            log.info("rank %d: larger-block reads not possible here: %s", self.rank, exc)
            return str(exc)

    def handshake_metadata(self) -> KvprotoHandshakeMetadata:
        return KvprotoHandshakeMetadata(rank=self.rank, stock_payload=self.stock_payload)

    def _make_binding(self) -> None:
        assert self.transport is not None
        holder = self.holder_worker.holder if self.holder_worker is not None else None
        reader = self.reader_worker.reader if self.reader_worker is not None else None
        self.binding = Binding(self.transport, holder=holder, reader=reader)
        if self.reader_worker is not None:
            self.reader_worker.binding = self.binding

    # ------------------------------------------------------------ per step

    def start_load_kv(self, meta: KvprotoMetadata | None) -> None:
        if self.transport is None or self._closed:
            return
        self._enter()
        now = time.monotonic()
        if meta is not None and not meta.is_empty():
            self._active = True
            self._apply(now, meta)
            self._pump(now)  # always: orders may have queued frames (a finish's abort)
            return
        if meta is not None and self.binding is None and meta.incarnation is not None:
            self._apply(now, meta)  # the first step: the holder and the binding
        if self._idle():
            self._last_pump = now  # nothing was due: no heartbeat lag to bound
            self._quiet = True
            return
        self._pump(now)

    def _apply(self, now: float, meta: KvprotoMetadata) -> None:
        """The scheduler's orders of this step (most steps have none and skip this)."""
        if self.holder_worker is not None and meta.incarnation is not None:
            self.holder_worker.ensure(meta.incarnation)
            if self.binding is None:
                self._make_binding()
            self.holder_worker.adopt(now, meta.grants)
        elif meta.grants and self.holder_worker is not None:
            self.holder_worker.adopt(now, meta.grants)  # refused: freed at once
        if self.push_writer is not None and (meta.prefills or meta.dropped or meta.grants):
            self.push_writer.on_orders(now, meta.prefills, meta.dropped, meta.grants)
        recvs = meta.recvs
        if self.push_holder is not None:
            pushed = [r for r in recvs if r.writable is not None]
            if pushed or meta.tracks:
                recvs = [r for r in recvs if r.writable is None]
                self.push_holder.apply(now, meta.tracks, pushed)
        if self.reader_worker is not None:
            self.reader_worker.apply(now, meta.tracks, recvs, meta.finishes)
        if self.push_holder is not None:
            for rid in meta.finishes:
                self.push_holder.finish(now, rid)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        if self.transport is None or self._closed:
            return set(), set(), set()
        if self._transfers_pending():
            self._enter()
            self._pump(time.monotonic())
        sending = self.holder_worker.take_sending() if self.holder_worker is not None else set()
        recving, failed = (
            self.reader_worker.take() if self.reader_worker is not None else (set(), set())
        )
        if self.push_holder is not None:
            loaded, load_failed = self.push_holder.take()
            if loaded:
                recving, failed = recving | loaded, failed | load_failed
        if sending or recving or failed:
            self._active = True
        return sending, recving, failed

    def _transfers_pending(self) -> bool:
        """Whether get_transfer_results pumps again (after the forward pass).

        Only while a transfer may be under way: a live lease on the holder (a reader's
        one-sided READ of its blocks progresses only inside our calls, and a done can
        free it) or a planned read on the reader (its verdict is then reported this
        step, not the next). Otherwise heartbeats, acks and introductions wait for the
        next step's start_load_kv, and a step saves one cold transport poll."""
        holder = self.holder_worker.holder if self.holder_worker is not None else None
        reader = self.reader_worker
        return (holder is not None and holder.live_leases() > 0) or (
            reader is not None and reader.pending() > 0
        )

    def _enter(self) -> None:
        """Run the transport's thread hook (NIXL's owner-thread rule) if this thread is
        not the one last entered from: vLLM may move the worker to another thread, and
        the hook runs only when it did, not at every step."""
        ident = threading.get_ident()
        if ident != self._thread:
            self._enter_thread()
            self._thread = ident

    def take_bad_blocks(self) -> set[int]:
        bad = self.reader_worker.take_bad_blocks() if self.reader_worker is not None else set()
        if self.push_holder is not None:
            bad |= self.push_holder.take_bad_blocks()
        if self.groups.num_groups > 1:
            # Block ids are per KV cache group, so vLLM cannot map a flat set of them back
            # to requests: with more than one group it stops the engine on any
            # (scheduler._handle_invalid_blocks, "not supported for models with multiple
            # KV cache groups"). Those requests are in failed_recving too, which vLLM
            # recomputes (or fails, by the policy) whole.
            return set()
        return bad

    def _pump(self, now: float) -> None:
        # Heartbeats, acks and done verdicts move only here: the longest gap between
        # pumps bounds how late a due heartbeat can leave (the lag vLLM's step adds).
        # A gap after a pump that left nothing to do is not such a lag: vLLM does not
        # step an engine without requests, and that wait is not the connector's.
        gap = None if self._last_pump is None or self._quiet else now - self._last_pump
        if gap is not None and gap > self._max_gap:
            self._max_gap = gap
        self._last_pump = now
        self._pump_once(now)
        self._quiet = self._idle()

    def _pump_once(self, now: float) -> None:
        assert self.transport is not None
        if self.server is not None:
            for intro in self.server.poll_introductions():
                self._active = True
                try:
                    self.transport.add_peer(intro.metadata)
                except TransportError as exc:
                    self.intro_errors += 1
                    log.warning("introduction from %s refused: %s", intro.requester, exc)
                    continue
                if self.push_writer is not None:
                    self.push_writer.on_introduction(now, intro)
        if self.binding is None:
            return
        if self.reader_worker is not None:
            self.reader_worker.poll_handshakes(now)
            if self.push_holder is not None and self.reader_worker.registrations_failed:
                self.push_holder.registrations_failed(now, self.reader_worker.registrations_failed)
        self._step(now)
        if self.reader_worker is not None and self.reader_worker.start_ready_reads(now):
            self._active = True
            self._step(now)  # declined reads and notify-only completions, this step
        if self.push_writer is not None and self.push_writer.start_ready(now, self.binding):
            self._active = True
            self._step(now)  # the Arms, or the writes' refusals, this step

    def _writing_from(self, request_id: str) -> bool:
        """Push mode, P: whether a write reads ``request_id``'s blocks (never in pull)."""
        writer, binding = self.push_writer, self.binding
        return (
            writer is not None and binding is not None and writer.writing_from(request_id, binding)
        )

    def _idle(self) -> bool:
        """Whether start_load_kv's pump can have no work: the holder holds no lease and
        waits for no timer (open sessions and tombstones set one), and the reader is
        idle too (:meth:`ReaderWorker.idle`).

        Then no peer has anything this engine must answer before its next order (the
        grant or track that ends the idleness pumps in its own step; frames wait in
        NIXL's queue, introductions in the side-channel server), so the step skips the
        transport's cold poll (~20-50 us inside vLLM), the side channel's lock and the
        cores' timers -- as vLLM's own loop, with no request, skips the step."""
        holder = self.holder_worker.holder if self.holder_worker is not None else None
        if holder is not None and (holder.live_leases() or holder.get_timer() is not None):
            return False
        return self.reader_worker is None or self.reader_worker.idle()

    def _step(self, now: float) -> None:
        assert self.binding is not None
        result = self.binding.step(now)
        if self.push_writer is not None and self.holder_worker is not None:
            # Push mode, P: a free held while a write read the blocks, whose write ended.
            self.holder_worker.release_written(self._writing_from)
        if not (
            result.freed or result.failed or result.confirmed or result.connects or result.fenced
        ):
            return  # most steps: nothing for either side
        self._active = True
        if self.push_writer is not None:
            result = self.push_writer.take_own(now, result)
        if self.holder_worker is not None:
            loads = self.holder_worker.on_freed(result.freed, self._writing_from)
            if self.push_holder is not None:
                self.push_holder.on_fenced(result.fenced)
                self.push_holder.on_ended(loads)
                for failed in result.failed:
                    if self.push_holder.owns(failed.request_id):
                        self.push_holder.prefill_failed(now, failed.request_id)
        if self.reader_worker is not None:
            self.reader_worker.on_result(now, result)

    # ------------------------------------------------------------ stats, end

    def stats_due(self) -> bool:
        """Whether vLLM's per-step stats call should read the counters now.

        Due after a step that applied orders or produced results (grants, tracks,
        reads, freed leases, verdicts, connects), else every :data:`STATS_EVERY_S`
        of pump time, for what moves on its own (heartbeats, acks, timers, the side
        channel's thread). A snapshot reads some forty cold counters: ~50 us per step
        inside an engine, for a value that had almost never changed."""
        now = self._last_pump
        if not self._active and now is not None and now - self._stats_at < STATS_EVERY_S:
            return False
        self._active = False
        if now is not None:
            self._stats_at = now
        return True

    def take_pump_gap_ms(self) -> int:
        """Longest gap between two pumps since the last call, in ms (heartbeat lag bound)."""
        gap, self._max_gap = self._max_gap, 0.0
        return round(gap * 1000)

    def stats_snapshot(self) -> dict[str, int]:
        """Cumulative counters and current gauges of this rank, flat names.

        Called at every engine step (vLLM asks for connector stats at each one):
        counts_of reads each counter class in ~1 µs where dataclasses.asdict took ~50.
        """
        snap: dict[str, int] = {}
        if self.holder_worker is not None and self.holder_worker.holder is not None:
            snap.update(self.holder_worker.holder.stats_snapshot("holder_"))
            snap["holder_bad_grants"] = self.holder_worker.bad_grants
        if self.reader_worker is not None:
            snap.update(self.reader_worker.reader.stats_snapshot("reader_"))
            snap.update(counts_of(self.reader_worker.counters, "reader_"))
            snap["reader_pending_reads"] = self.reader_worker.pending()
        if self.binding is not None:
            snap.update(counts_of(self.binding.stats, "binding_"))
        if self.server is not None:
            snap.update(counts_of(self.server.stats(), "sidechannel_"))
        if self.push_holder is not None:
            snap["push_registrations"] = self.push_holder.registrations
            snap["push_fenced"] = self.push_holder.fenced
        if self.push_writer is not None:
            snap["push_bad_registrations"] = self.push_writer.bad_registrations
            snap["push_written"] = self.push_writer.written
            snap["push_write_failures"] = self.push_writer.write_failures
        snap["worker_intro_errors"] = self.intro_errors
        if self._client is not None:
            snap["worker_transport_mismatches"] = self._client.transport_mismatches
        return snap

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.close()
        if self.reader_worker is not None:
            self.reader_worker.client.close()
        if self.transport is not None:
            try:
                self._enter()
                self.transport.close()
            except TransportError as exc:
                log.warning("closing the %s transport: %s", self.transport.name, exc)


def _nothing() -> None:
    return


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0  # no TP group (a unit test building the worker directly)
