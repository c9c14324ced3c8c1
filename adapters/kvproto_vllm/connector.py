"""``KvprotoConnector``: vLLM's KV connector API bound to the kvproto lease core.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvprotoConnector",
                           "kv_connector_module_path": "kvproto_vllm.connector",
                           "kv_role": "kv_producer",            # or kv_consumer
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kv_lease_duration": 30}}'

vLLM imports this module in its front-end process too (config checks,
metrics), so it imports only vLLM's base class and the adapter's pure
modules; NIXL, ZMQ and the cores load when a role-specific half is built.

vLLM builds one instance with role SCHEDULER (engine-core process) and one
with role WORKER per worker process; each delegates to its half
(:mod:`.scheduler`, :mod:`.worker`). Every lease decision is the core's.

One code base serves vLLM 0.32 and 0.33 (spec/vllm-adapter.md, "vLLM
versions"): hooks a version lacks are never called by it, and nothing here
parses a version string. Sleep mode is refused (:meth:`supports_sleep_mode`;
on a vLLM without that check, the constructor refuses it). Importing this
module registers the class with vLLM's connector factory by name, which
``MultiConnector`` needs to rebuild our stats from their serialized form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import parse_extra_config
from .groups import UnsupportedShape, transfer_groups
from .metadata import KvprotoMetadata
from .plugin import register as register_with_factory

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .scheduler import SchedulerSide
    from .stats import DeltaTracker
    from .worker import WorkerSide


class KvprotoConnector(KVConnectorBase_V1, SupportsHMA):
    """A P/D KV connector whose block leases are kvproto's (see spec/vllm-adapter.md).

    ``SupportsHMA``: vLLM keeps its hybrid allocator on, as with stock
    NixlConnector, and every transfer group of a request (full attention,
    sliding window, SSM state) is moved under one lease (:mod:`.groups`).
    """

    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM >= 0.33 asks before building an engine with --enable-sleep-mode and
        # refuses it ("KvprotoConnector does not support sleep mode."). Sleep drops
        # the KV cache's contents and may remap its memory, while our transports keep
        # it registered and peers hold leases on its blocks; unregister_kv_caches /
        # restore_kv_caches are therefore never called on this connector.
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        model = vllm_config.model_config
        if model is not None and getattr(model, "enable_sleep_mode", False):
            # vLLM 0.33 refuses this already (supports_sleep_mode); 0.32 has no such
            # check and would keep the KV memory registered across a sleep.
            raise ValueError(SLEEP_MODE_REFUSAL)
        transfer = self._kv_transfer_config
        self.adapter_config = parse_extra_config(transfer.kv_connector_extra_config)
        engine_id = transfer.engine_id
        if engine_id is None:
            raise ValueError("kv_transfer_config.engine_id is unset")
        self.engine_id: str = engine_id
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._stats: DeltaTracker | None = None
        holds, reads = transfer.is_kv_producer, transfer.is_kv_consumer
        # Refused here, when the engine starts, with one line naming the shape: never a
        # per-request warning followed by a silent recompute.
        self.groups = transfer_groups(vllm_config, kv_cache_config)
        push = self.adapter_config.transfer_mode == "push"
        if self.groups.hybrid and (
            self.adapter_config.bidirectional_kv_xfer or self.adapter_config.lease.accept_legacy
        ):
            raise UnsupportedShape(
                f"KvprotoConnector transfers this model's KV cache groups "
                f"({self.groups.describe()}) in P/D (pull or push) only: bidirectional_kv_xfer "
                "and accept_legacy need a single full-attention group"
            )
        if self.adapter_config.bidirectional_kv_xfer or push:
            # Turn 2 reverses the roles: D holds the conversation's blocks and P reads
            # them. Push mode runs both directions at once: P holds its finished blocks
            # (D heartbeats them) and writes into D's, which D holds for it. Either way
            # every engine runs both halves (and serves its side channel).
            holds = reads = True
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerSide

            self._scheduler = SchedulerSide(
                vllm_config,
                self.adapter_config,
                engine_id=engine_id,
                holds=holds,
                reads=reads,
                groups=self.groups,
            )
        else:
            from .stats import DeltaTracker
            from .worker import WorkerSide

            self._worker = WorkerSide(
                vllm_config,
                self.adapter_config,
                engine_id=engine_id,
                num_blocks=int(kv_cache_config.num_blocks),
                holds=holds,
                reads=reads,
                groups=self.groups,
                kv_cache_config=kv_cache_config,
            )
            self._stats = DeltaTracker(f"{engine_id}/{self._worker.rank}")

    # ================================================================ worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        self._worker.start_load_kv(meta if isinstance(meta, KvprotoMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Pull: the decoder reads. Push: the finished blocks are written once the decoder
        # registered its own (the worker's pump, spec/push-mode.md), never layer by layer.
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # For callers that do not know get_transfer_results: failed reads still reach
        # vLLM through get_block_ids_with_load_errors, never as good data.
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_bad_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None or self._stats is None or not self._worker.stats_due():
            return None
        snapshot = self._worker.stats_snapshot()
        snapshot["worker_pump_gap_ms_max"] = self._worker.take_pump_gap_ms()
        return self._stats.delta(snapshot)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        return self._worker.handshake_metadata()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake_metadata(metadata)

    # ============================================================= scheduler

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # SSM hybrids: vLLM then keeps D's local full-attention hit even where no SSM
        # state was cached at its boundary, and the read brings P's state with the rest
        # (groups.pair_blocks fills the state block and the attention tail alike), as
        # stock does; otherwise the local hit is cut to zero and the whole prompt read.
        return True

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load fills the request's own blocks of every transfer group (vLLM's default,
        # the prefix-cacheable groups, would leave an SSM state marked as not loaded).
        return self.groups.group_ids

    def get_num_new_matched_tokens(
        self,
        request: Request,
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.finished_recving)

    def request_finished(
        self,
        request: Request,
        block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # vLLM's only hook that keeps an engine stepping without requests; used so an
        # aborted request's lease abort reaches the prefill engine (see reader_scheduler.py).
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # As stock NixlConnector: head-major blocks with K|V packed per head ("LBHNC"),
        # so a TP slice of a block is a slice of heads (heterogeneous TP) and stock
        # peers see the same layout (interop). MLA keeps vLLM's default.
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    # ================================================================ stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        from .stats import KvprotoStats

        return KvprotoStats(data=dict(data)) if data is not None else KvprotoStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from .stats import KvprotoPromMetrics

        return KvprotoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================ debug

    def debug_state(self) -> dict[str, Any]:
        """What this half holds now (tests and operators' debugging; not a stable API)."""
        out: dict[str, Any] = {"role": self.role.name, "engine_id": self.engine_id}
        if self._worker is not None:
            out["stats"] = self._worker.stats_snapshot()
            out["events"] = list(self._worker.events)
            out["agent"] = (
                self._worker.transport.local_peer if self._worker.transport is not None else None
            )
        if self._scheduler is not None:
            holder, reader = self._scheduler.holder_scheduler, self._scheduler.reader_scheduler
            if holder is not None:
                out["incarnation"] = holder.incarnation
                out["granted"] = holder.granted
                out["granted_turn2"] = holder.granted_turn2
                out["shared_children"] = holder.shared_children
            if reader is not None:
                out["tracked"] = reader.tracked_count()
                out["untracked"] = reader.untracked
        return out


SLEEP_MODE_REFUSAL = (
    "KvprotoConnector does not support sleep mode (--enable-sleep-mode): sleep drops "
    "the KV cache that prefill engines hold under lease and that the transport keeps "
    "registered. Run the engine without sleep mode."
)


# The vllm.general_plugins entry point (plugin.py) does this in every vLLM process; here for
# installs without it. MultiConnector rebuilds child stats by class name.
register_with_factory()
