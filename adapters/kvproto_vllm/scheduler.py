"""The scheduler-side connector: the holder and/or reader halves, and the step metadata.

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
from .groups import TransferGroups, single_full_group
from .holder_scheduler import HolderScheduler
from .metadata import KvprotoMetadata
from .reader_scheduler import ReaderScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from .stock_interop import StockHandshakeListener

log = logging.getLogger("vllm.kvproto_connector.scheduler")


class SchedulerSide:
    """Scheduler half of one engine: the holder's (``kv_producer``), the reader's
    (``kv_consumer``), or both (``kv_both``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: AdapterConfig,
        *,
        engine_id: str,
        holds: bool,
        reads: bool,
        groups: TransferGroups | None = None,
    ) -> None:
        """``groups``: the engine's KV cache groups (:func:`.groups.transfer_groups`);
        None is one full-attention group."""
        self.cfg = cfg
        self.groups = groups if groups is not None else single_full_group()
        self.vllm_config = vllm_config
        self.holder_scheduler: HolderScheduler | None = None
        self.reader_scheduler: ReaderScheduler | None = None
        self.stock_listener: StockHandshakeListener | None = None
        if holds:
            host, port = side_channel_address(vllm_config, cfg)
            _, stock_port = stock_side_channel_address(vllm_config)
            parallel = vllm_config.parallel_config
            self.holder_scheduler = HolderScheduler(
                cfg.lease,
                engine_id=engine_id,
                tp_size=transfer_tp_size(vllm_config),
                host=host,
                port=port,
                stock_port=stock_port if cfg.lease.accept_legacy else None,
                dcp_size=int(parallel.decode_context_parallel_size),
                pp_size=int(parallel.pipeline_parallel_size),
                groups=self.groups,
                transfer_mode=cfg.transfer_mode,
            )
        if reads:
            self.reader_scheduler = ReaderScheduler(
                recompute_threshold=cfg.kv_recompute_threshold,
                bidirectional=cfg.bidirectional_kv_xfer,
                groups=self.groups,
                tp_size=transfer_tp_size(vllm_config),
                transfer_mode=cfg.transfer_mode,
                mint_writable=(
                    self.holder_scheduler.grant_writable
                    if cfg.transfer_mode == "push" and self.holder_scheduler is not None
                    else None
                ),
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
        if self.holder_scheduler is not None:
            self.holder_scheduler.on_new_request(request)
        if self.reader_scheduler is not None:
            self.reader_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.reader_scheduler is None:
            return 0, False
        return self.reader_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.reader_scheduler is not None:
            self.reader_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_meta(self) -> KvprotoMetadata:
        meta = KvprotoMetadata()
        if self.holder_scheduler is not None:
            meta.incarnation = self.holder_scheduler.incarnation
            meta.grants = self.holder_scheduler.take_grants()
            meta.prefills, meta.dropped = self.holder_scheduler.take_prefills()
        if self.reader_scheduler is not None:
            meta.tracks, meta.recvs, meta.finishes = self.reader_scheduler.take()
        return meta

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        if self.reader_scheduler is not None:
            self.reader_scheduler.finished_recving(finished_recving)

    def has_pending_work(self) -> bool:
        return self.reader_scheduler is not None and self.reader_scheduler.has_pending_work()

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if self.reader_scheduler is not None:
            # Stop tracking (a turn-2 prefill on P is tracked too): an unread lease is
            # aborted, so its holder frees at once.
            self.reader_scheduler.request_finished(request)
        if params and params.get("do_remote_decode"):
            if self.holder_scheduler is None:
                log.warning(
                    "request %s asks for remote decode but this engine is not a kv_producer",
                    request.request_id,
                )
                return False, None
            return self.holder_scheduler.request_finished(request, block_ids)
        if params and self.cfg.bidirectional_kv_xfer and self.holder_scheduler is not None:
            # Stock's bidirectional D node: keep a decoded request's blocks (prompt and
            # output) for the conversation's next turn, under a decoder_kv_blocks_ttl lease.
            return self.holder_scheduler.request_finished(request, block_ids, turn2=True)
        return False, None

    def set_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Interop mode: serve the workers' stock payloads on the stock port."""
        if self.holder_scheduler is None or not self.cfg.lease.accept_legacy:
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
