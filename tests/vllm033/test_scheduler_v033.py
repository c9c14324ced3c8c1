"""The connector's scheduler half inside real vLLM 0.33 Schedulers (no engine, no device).

1. Every scenario of tests/vllm/test_kvproto_scheduler.py (P grants and
   delays the free; D tracks from enqueue, plans one read, stops tracking on
   finished_recving and on aborts; failed reads recompute; bad tickets are
   not tracked; bidirectional turn 2), run unchanged against 0.33's
   Scheduler and Request: only the config builder differs
   (``EngineArgs.create_engine_config`` needs a device, so the VllmConfig is
   assembled with ``DeviceConfig("cpu")``, see device_free.py).
2. 0.33's fault-tolerant executor replays a failed step's KV connector
   outputs at the next aggregate (``KVOutputAggregator.
   ft_defer_kv_connector_outputs``): a finished_recving can reach the
   scheduler a step late, after the request was aborted. The connector's
   answer is the same: exactly one finish per request, blocks freed once the
   late report arrives.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from .vllm033_required import require_vllm033

require_vllm033()

import tests.vllm.test_kvproto_scheduler as scenarios  # noqa: E402
from tests.vllm.kvproto_config import kvproto_config  # noqa: E402
from tests.vllm.test_kvproto_scheduler import (  # noqa: E402
    BLOCK,
    free_blocks,
    prefill_params,
    request,
    test_consumer_aborts,
    test_consumer_bad_ticket_is_not_tracked,
    test_consumer_failed_read_recomputes,
    test_consumer_tracks_from_enqueue,
    test_decoder_keeps_blocks_for_turn2,
    test_decoder_without_bidirectional_frees_at_finish,
    test_prefill_reads_turn2_prefix,
    test_prefill_turn2_abort_and_threshold,
    test_prefill_turn2_failed_read_recomputes,
    test_producer_grants_and_delays_free,
    test_read_ends_where_the_request_ends,
    test_turn2_params_ignored_without_bidirectional,
    turn2_params,
    turn2_prompt,
    worker_output,
)

from .device_free import device_free_config  # noqa: E402

__all__ = [  # collected here, run against vLLM 0.33
    "prefill_params",
    "test_consumer_aborts",
    "test_consumer_bad_ticket_is_not_tracked",
    "test_consumer_failed_read_recomputes",
    "test_consumer_tracks_from_enqueue",
    "test_decoder_keeps_blocks_for_turn2",
    "test_decoder_without_bidirectional_frees_at_finish",
    "test_prefill_reads_turn2_prefix",
    "test_prefill_turn2_abort_and_threshold",
    "test_prefill_turn2_failed_read_recomputes",
    "test_producer_grants_and_delays_free",
    "test_read_ends_where_the_request_ends",
    "test_turn2_params_ignored_without_bidirectional",
    "turn2_params",
    "turn2_prompt",
]


def make_scheduler(model: Path, role: str, *, max_num_seqs: int = 8, **extra: Any) -> Any:
    """tests/vllm's make_scheduler, on a device-free VllmConfig."""
    return scenarios.scheduler_on(
        device_free_config(
            model, kvproto_config(role, **extra), block_size=BLOCK, max_num_seqs=max_num_seqs
        )
    )


# The scenarios above call their module's make_scheduler: point it at this one.
scenarios.make_scheduler = make_scheduler


def _replayed_step(sched: Any, aggregator: Any, **worker: Any) -> tuple[Any, Any]:
    """schedule() + update_from_output() with the worker output passed through vLLM's
    real KVOutputAggregator (world size 1), as the multiprocessing executor does."""
    out = sched.schedule()
    merged = aggregator.aggregate([worker_output(out, **worker)])
    sched.update_from_output(out, merged)
    return out.kv_connector_metadata, out


def test_late_finished_recving_after_ft_replay(
    tiny_model_dir: Path, prefill_params: dict[str, Any]
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_model_dir, "kv_consumer")
    aggregator = KVOutputAggregator(expected_finished_count=1)
    free0 = free_blocks(sched)
    finishes: list[str] = []

    # d6 is read and confirmed, but the step that reports it fails: its outputs are
    # stashed and replayed one step later.
    sched.add_request(request("d6", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, _ = _replayed_step(sched, aggregator)
    assert [r.request_id for r in meta.recvs] == ["d6"]
    aggregator.ft_defer_kv_connector_outputs([KVConnectorOutput(finished_recving={"d6"})])
    meta, out = _replayed_step(sched, aggregator)  # replayed into this step's output
    finishes += meta.finishes
    assert "d6" not in out.num_scheduled_tokens  # not yet known to be loaded
    meta, out = _replayed_step(sched, aggregator)
    finishes += meta.finishes
    assert meta.finishes == ["d6"]
    assert out.num_scheduled_tokens.get("d6") == 1  # decoded from the loaded blocks

    # d7 is aborted while its read is in flight; the worker's verdict comes a step late
    # (replayed), after the connector has already sent the finish.
    sched.add_request(request("d7", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, _ = _replayed_step(sched, aggregator)
    assert [r.request_id for r in meta.recvs] == ["d7"]
    sched.finish_requests("d7", RequestStatus.FINISHED_ABORTED)
    meta, _ = _replayed_step(sched, aggregator)
    finishes += meta.finishes
    assert "d7" in sched.requests  # blocks held until the worker reports
    aggregator.ft_defer_kv_connector_outputs([KVConnectorOutput(finished_recving={"d7"})])
    meta, _ = _replayed_step(sched, aggregator)
    finishes += meta.finishes
    assert "d7" not in sched.requests
    for _ in range(6):  # d6 decodes to its end
        meta, _ = _replayed_step(sched, aggregator)
        finishes += meta.finishes
    assert sorted(finishes) == ["d6", "d7"]  # one finish each, none repeated
    assert sched.connector.debug_state()["tracked"] == 0
    assert not sched.requests and free_blocks(sched) == free0
