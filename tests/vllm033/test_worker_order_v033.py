"""Model Runner V2's call order on vLLM 0.33, with a speculator, driving our worker half.

With a speculator, 0.33's ``ActiveKVConnector.post_forward(...,
defer_finalize=True)`` calls ``get_transfer_results`` and
``build_connector_worker_meta`` *before* ``wait_for_save``, which runs later
in ``finalize_step`` (after the drafter), and the step's metadata stays
bound until then. Here vLLM 0.33's real ``ActiveKVConnector`` drives a
WORKER-role KvprotoConnector (P, real NIXL on CPU tensors) in exactly that
order, against a decode worker half (D) reading from it:

* while the lease is held, no step reports the request in finished_sending,
  although wait_for_save/finalize_step ran at every step: a send ends when
  the holder's lease ends (the reader's done), never because a save is
  assumed finished;
* once D's read is confirmed, P reports the request exactly once, from a
  post_forward that ran before that step's finalize_step;
* the blocks D received are P's blocks, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.fixtures import one_group_kv_cache_config

from .vllm033_required import require_vllm033

require_vllm033()

pytest.importorskip("nixl_cu12", reason="the worker half registers KV memory with NIXL")

import torch  # noqa: E402

from kvproto_vllm.metadata import Grant, KvprotoMetadata, Recv, Track  # noqa: E402
from tests.vllm.engine_proc import free_port  # noqa: E402
from tests.vllm.kvproto_config import kvproto_config  # noqa: E402
from tests.vllm.test_kvproto_worker import (  # noqa: E402
    BLOCK_SHAPE,
    INCARNATION,
    LAYERS,
    NUM_BLOCKS,
    make_worker,
    mint,
)

from .device_free import device_free_config  # noqa: E402


@pytest.fixture
def mrv2_pair(tiny_model_dir: Path) -> Iterator[tuple[Any, Any, dict[str, Any], Any, Any]]:
    """(vLLM's ActiveKVConnector over our P connector, that connector, P's KV tensors,
    D's worker half, D's KV tensors)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from kvproto_vllm.connector import KvprotoConnector

    p_port = free_port()
    p_cfg = device_free_config(
        tiny_model_dir, kvproto_config("kv_producer", kvproto_side_channel_port=p_port)
    )
    kv_cache_config = one_group_kv_cache_config(NUM_BLOCKS, tuple(LAYERS))
    p_conn = KvprotoConnector(p_cfg, KVConnectorRole.WORKER, kv_cache_config)
    p_kv = {name: torch.randn(NUM_BLOCKS, *BLOCK_SHAPE) for name in LAYERS}
    # The model runner takes the worker connector from vLLM's process-wide slot.
    kv_transfer_state._KV_CONNECTOR_AGENT = p_conn
    try:
        runner = ActiveKVConnector(p_cfg, p_kv)  # registers the KV caches, as vLLM does
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
    d_cfg = device_free_config(tiny_model_dir, kvproto_config("kv_both"))
    d, d_kv = make_worker(d_cfg, "D-engine", holds=False, port=free_port())
    try:
        yield runner, p_conn, p_kv, d, d_kv
    finally:
        d.shutdown()
        p_conn.shutdown()


def p_step(runner: Any, conn: Any, meta: KvprotoMetadata) -> set[str]:
    """One P engine step as 0.33's GPU model runner makes it with a speculator."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.kv_connector_metadata = meta
    runner.pre_forward(out)  # binds the metadata; the async load starts after forward
    runner.finish_forward()
    kv_out = runner.post_forward(set(), defer_finalize=True)
    assert kv_out is not None
    assert conn.has_connector_metadata()  # still bound: finalize_step comes later
    sending = set(kv_out.finished_sending or ())
    runner.finalize_step()  # the drafter ran; now wait_for_save and unbind
    assert not conn.has_connector_metadata()
    return sending


def test_send_ends_with_the_lease_not_the_save(mrv2_pair: Any) -> None:
    runner, p_conn, p_kv, d, d_kv = mrv2_pair
    p_side = p_conn._worker
    ticket = mint(p_side, "p-req-1")
    grant = Grant(request_id="p-req-1", ticket=ticket)
    sending: list[str] = []
    sending += p_step(runner, p_conn, KvprotoMetadata(incarnation=INCARNATION, grants=[grant]))
    for _ in range(20):  # held: saves "complete" every step, the send does not
        sending += p_step(runner, p_conn, KvprotoMetadata(incarnation=INCARNATION))
        time.sleep(0.002)
    assert sending == []
    kinds = [e[1] for e in p_side.events]
    assert kinds.count("granted") == 1 and "freed" not in kinds  # the lease is live

    remote, local = [5, 6, 7, 8], [20, 21, 22, 23]
    track = Track(request_id="d-req-1", ticket=ticket, host="127.0.0.1", port=p_side.base_port)
    recv = Recv(request_id="d-req-1", local_block_ids=local, remote_block_ids=remote, awaiting=True)
    d.start_load_kv(KvprotoMetadata(tracks=[track], recvs=[recv]))
    recving: list[str] = []
    end = time.monotonic() + 20
    while not (recving and sending):
        assert time.monotonic() < end, f"not confirmed; D events {list(d.events)[-6:]}"
        sending += p_step(runner, p_conn, KvprotoMetadata(incarnation=INCARNATION))
        d.start_load_kv(KvprotoMetadata())
        got, failed = d.get_transfer_results()[1:]
        assert not failed
        recving += sorted(got)
        time.sleep(0.002)
    for _ in range(5):  # nothing is reported twice
        sending += p_step(runner, p_conn, KvprotoMetadata(incarnation=INCARNATION))
    assert sending == ["p-req-1"] and recving == ["d-req-1"]
    for name in LAYERS:
        assert torch.equal(d_kv[name][local], p_kv[name][remote])
