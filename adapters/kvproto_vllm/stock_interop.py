"""Interop with stock NixlConnector decoders (legacy mode, ``accept_legacy: true``).

A kvproto prefill engine can serve a *stock* decoder:

* the decoder handshakes on ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (+ dp index) with
  stock's wire format: a ZMQ REQ sends msgpack ``("get_meta_msg", pp_rank,
  tp_rank)`` and expects ``[NixlHandshakePayload, msgpack(perf_counter())]``.
  :class:`StockHandshakeListener` answers exactly that, from the scheduler
  process like stock, with one payload per rank built by
  :func:`build_stock_payload` in each worker (vLLM's handshake-metadata
  channel carries it to the scheduler). Unlike stock's listener, a malformed
  request is dropped and counted instead of killing the thread.
* the payload names this worker's own NIXL agent and registered KV regions in
  stock's ``NixlAgentMetadata`` form, with stock's compat hash, so the stock
  decoder READs the blocks straight from the kvproto transport's memory;
* its heartbeats (``HB:<id>``) and done frames (``<id>:<n>``) arrive at that
  agent as text frames, which the Holder applies to the lease named by the
  request id (``LeaseConfig.accept_legacy``).

Limits (spec/vllm-adapter.md): legacy frames carry no token, so any engine
that can reach the agent can renew or finish a lease by request id; a stock
decoder gets no HELD verdict, so its read is not fenced (stock semantics);
single-KV-group models, equal block sizes and TP sizes only. The reverse
direction (stock prefill, kvproto decoder) is refused by design: the kvproto
reader trusts only reads a holder confirmed, which a stock prefill engine
cannot do, so such requests are prefilled locally.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvproto.tpmath import BlockLayout

log = logging.getLogger("vllm.kvproto_connector.stock")

_POLL_MS = 100


def build_stock_payload(
    vllm_config: VllmConfig,
    *,
    engine_id: str,
    agent_metadata: bytes,
    layout: BlockLayout,
    region_names: list[str],
) -> bytes:
    """Stock's encoded ``NixlHandshakePayload`` for this worker's registered KV memory.

    Mirrors what stock's worker advertises for a single-group, full-attention
    model (checked field by field against a stock engine in
    tests/vllm/test_kvproto_interop.py).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
        compute_nixl_compatibility_hash,
    )

    backend = get_current_attn_backends(vllm_config)[0].get_name()
    regions = len(layout.region_addrs)
    metadata = NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=list(layout.region_addrs),
        device_id=layout.device_id,
        num_blocks=layout.num_blocks,
        block_lens=list(layout.block_lens),
        block_strides=list(layout.block_lens),
        kv_cache_layout=vllm_config.cache_config.get_resolved_kv_cache_layout().name,
        block_size=vllm_config.cache_config.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=backend,
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[layout.num_blocks] * regions,
        region_group_ids=[0] * regions,
        region_names=list(region_names),
        region_mem_types=[layout.memory_kind] * regions,
        dcp_size=int(vllm_config.parallel_config.decode_context_parallel_size),
        pcp_size=int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1)),
    )
    encoder = msgspec.msgpack.Encoder()
    payload = NixlHandshakePayload(
        compatibility_hash=compute_nixl_compatibility_hash(vllm_config, backend, "pull"),
        agent_metadata_bytes=encoder.encode(metadata),
    )
    return encoder.encode(payload)


class StockHandshakeListener:
    """Stock-format handshake server (ZMQ ROUTER on its own thread). Binds at construction."""

    def __init__(self, *, host: str, port: int, payloads: dict[tuple[int, int], bytes]) -> None:
        self._payloads = dict(payloads)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.served = 0
        """Handshakes answered."""
        self.refused = 0
        """Requests dropped (undecodable, unknown rank)."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self._sock.close()
            self._ctx.term()
            raise
        self.port = port
        log.warning(
            "accept_legacy on: stock HB:/id:n frames are UNAUTHENTICATED "
            "(any peer can renew or finish a legacy lease)"
        )
        self._thread = threading.Thread(
            target=self._run, name=f"kvproto-stock-handshake-{port}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                try:
                    if not sock.poll(_POLL_MS):
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    self._answer(frames)
                except zmq.Again:
                    continue
                except Exception:  # never let one request end the listener (stock's does)
                    with self._lock:
                        self.refused += 1
                    self._stop.wait(0.01)
        finally:
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        payload = None
        if len(frames) == 3 and frames[1] == b"":
            with contextlib.suppress(msgspec.DecodeError, ValueError, TypeError):
                request: Any = msgspec.msgpack.decode(frames[2])
                if isinstance(request, list | tuple) and len(request) == 3:
                    _, pp_rank, tp_rank = request
                    payload = self._payloads.get((int(pp_rank), int(tp_rank)))
        if payload is None:
            with self._lock:
                self.refused += 1
            log.warning("stock handshake request dropped (undecodable or unknown rank)")
            return
        stamp = msgspec.msgpack.encode(time.perf_counter())
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart([frames[0], b"", payload, stamp], zmq.NOBLOCK)
        with self._lock:
            self.served += 1

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(2.0)
        if not self._thread.is_alive():
            self._ctx.term()
