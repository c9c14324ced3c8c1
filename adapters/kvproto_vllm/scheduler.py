"""The scheduler-side connector: the producer and/or consumer halves, and the step metadata.

Runs in the engine-core process on the scheduler's thread. It holds no lease
core: it mints tickets (P) and forwards request events (D) to the workers,
whose NIXL agents receive the lease frames.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .compat import side_channel_address, stock_side_channel_address, transfer_tp_size
from .config import AdapterConfig
from .consumer import Consumer
from .groups import TransferGroups, single_full_group
from .metadata import KvprotoMetadata
from .producer import Producer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from .stock_interop import StockHandshakeListener

log = logging.getLogger("vllm.kvproto_connector.scheduler")


class SchedulerSide:
    """Scheduler half of one engine (producer, consumer, or both for ``kv_both``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: AdapterConfig,
        *,
        engine_id: str,
        producer: bool,
        consumer: bool,
        groups: TransferGroups | None = None,
    ) -> None:
        """``groups``: the engine's KV cache groups (:func:`.groups.transfer_groups`);
        None is one full-attention group."""
        self.cfg = cfg
        self.groups = groups if groups is not None else single_full_group()
        self.vllm_config = vllm_config
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.stock_listener: StockHandshakeListener | None = None
        if producer:
            host, port = side_channel_address(vllm_config, cfg)
            _, stock_port = stock_side_channel_address(vllm_config)
            parallel = vllm_config.parallel_config
            self.producer = Producer(
                cfg.lease,
                engine_id=engine_id,
                tp_size=transfer_tp_size(vllm_config),
                host=host,
                port=port,
                stock_port=stock_port if cfg.lease.accept_legacy else None,
                dcp_size=int(parallel.decode_context_parallel_size),
                pp_size=int(parallel.pipeline_parallel_size),
                groups=self.groups,
            )
        if consumer:
            self.consumer = Consumer(
                recompute_threshold=cfg.kv_recompute_threshold,
                bidirectional=cfg.bidirectional_kv_xfer,
                groups=self.groups,
                tp_size=transfer_tp_size(vllm_config),
            )
            transfer = vllm_config.kv_transfer_config
            policy = getattr(transfer, "kv_load_failure_policy", "fail")
            if policy != "recompute":
                log.warning(
                    "kv_load_failure_policy is %r: a read that kvproto fences (lease lost, "
                    "holder unreachable, transfer failed) finishes its request with an error "
                    'instead of recomputing it. Set "kv_load_failure_policy": "recompute" '
                    "in --kv-transfer-config.",
                    policy,
                )

    # ------------------------------------------------------------ vLLM hooks

    def on_new_request(self, request: Request) -> None:
        if self.producer is not None:
            self.producer.on_new_request(request)
        if self.consumer is not None:
            self.consumer.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.consumer is None:
            return 0, False
        return self.consumer.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.consumer is not None:
            self.consumer.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_meta(self) -> KvprotoMetadata:
        meta = KvprotoMetadata()
        if self.producer is not None:
            meta.incarnation = self.producer.incarnation
            meta.grants = self.producer.take_grants()
        if self.consumer is not None:
            meta.tracks, meta.recvs, meta.finishes = self.consumer.take()
        return meta

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        if self.consumer is not None:
            self.consumer.finished_recving(finished_recving)

    def has_pending_work(self) -> bool:
        return self.consumer is not None and self.consumer.has_pending_work()

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if self.consumer is not None:
            # Stop tracking (a turn-2 prefill on P is tracked too): an unread lease is
            # aborted, so its holder frees at once.
            self.consumer.request_finished(request)
        if params and params.get("do_remote_decode"):
            if self.producer is None:
                log.warning(
                    "request %s asks for remote decode but this engine is not a kv_producer",
                    request.request_id,
                )
                return False, None
            return self.producer.request_finished(request, block_ids)
        if params and self.cfg.bidirectional_kv_xfer and self.producer is not None:
            # Stock's bidirectional D node: keep a decoded request's blocks (prompt and
            # output) for the conversation's next turn, under a decoder_kv_blocks_ttl lease.
            return self.producer.request_finished(request, block_ids, turn2=True)
        return False, None

    def set_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Interop mode: serve the workers' stock payloads on the stock port."""
        if self.producer is None or not self.cfg.lease.accept_legacy:
            return
        from .metadata import KvprotoHandshakeMetadata
        from .stock_interop import StockHandshakeListener

        payloads = {}
        for tp_rank, md in metadata.items():
            if isinstance(md, KvprotoHandshakeMetadata) and md.stock_payload is not None:
                payloads[(0, int(tp_rank))] = md.stock_payload
        if not payloads or self.stock_listener is not None:
            return
        host, port = stock_side_channel_address(self.vllm_config)
        self.stock_listener = StockHandshakeListener(host=host, port=port, payloads=payloads)
        log.info("interop: stock NixlConnector handshakes served on %s:%d", host, port)

    def shutdown(self) -> None:
        if self.stock_listener is not None:
            self.stock_listener.close()
