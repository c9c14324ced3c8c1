"""The connector's scheduler half inside real vLLM Schedulers, driven step by step.

Two real ``vllm.v1.core.sched.scheduler.Scheduler`` instances (one
``kv_producer``, one ``kv_consumer``) built from the tiny model's real
VllmConfig; vLLM's factory creates the connector's SCHEDULER half in each.
Real ``Request`` objects carry ``kv_transfer_params``; the worker's answers
(finished_sending / finished_recving / failed_recving) are fed back in a
``ModelRunnerOutput`` as the worker half would report them. No engine, no
NIXL: this pins the scheduler-side decisions.

P: a finished prefill gets a lease (ticket in kv_transfer_params and in the
next step's metadata), its blocks stay held until finished_sending; an
aborted prefill gets none.
D: a request is tracked from enqueue even while it cannot be scheduled
(max_num_seqs=1 and another request running), its read is planned when it
is scheduled, tracking stops on finished_recving, on abort before
scheduling and on abort while reading (blocks kept until the worker reports);
a failed read is recomputed locally; an unusable ticket is never tracked.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from kvproto.ticket import PARAMS_KEY, LeaseTicket  # noqa: E402
from kvproto_vllm.holder_scheduler import READERS_KEY  # noqa: E402
from kvproto_vllm.metadata import KvprotoMetadata  # noqa: E402

from .kvproto_config import kvproto_config  # noqa: E402

BLOCK = 32
PROMPT = list(range(1, 105))  # 104 tokens: 3 full blocks + 1 partial
NUM_BLOCKS = 64


def make_scheduler(model: Path, role: str, *, max_num_seqs: int = 8, **extra: Any) -> Any:
    """A real Scheduler; ``extra`` goes to kv_connector_extra_config."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(**kvproto_config(role, **extra)),
    )
    return scheduler_on(args.create_engine_config())


def scheduler_on(cfg: Any) -> Any:
    """A real Scheduler on ``cfg`` (a VllmConfig) over NUM_BLOCKS blocks of the tiny model."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32
                ),
            )
        ],
    )
    return Scheduler(
        cfg, kv_cache_config, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True
    )


def request(
    rid: str, *, max_tokens: int, params: dict[str, Any] | None, prompt: list[int] | None = None
) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    return Request(rid, list(PROMPT if prompt is None else prompt), sp, None)


def worker_output(
    sched_out: Any,
    *,
    sending: Iterable[str] = (),
    recving: Iterable[str] = (),
    failed: Iterable[str] = (),
) -> Any:
    """What a worker returns for a step: one token per request that completed its prompt."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    kv = KVConnectorOutput(
        finished_sending=set(sending) or None,
        finished_recving=set(recving) or None,
        failed_recving=set(failed),
    )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=(
            kv if (kv.finished_sending or kv.finished_recving or kv.failed_recving) else None
        ),
    )


def step(sched: Any, **worker: Iterable[str]) -> tuple[KvprotoMetadata, Any, dict[str, Any]]:
    """schedule() + update_from_output(); (metadata, scheduler output, outputs by id)."""
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvprotoMetadata)
    engine_outputs = sched.update_from_output(out, worker_output(out, **worker))
    by_id = {o.request_id: o for eo in engine_outputs.values() for o in eo.outputs}
    return meta, out, by_id


def free_blocks(sched: Any) -> int:
    return int(sched.kv_cache_manager.block_pool.get_num_free_blocks())


@pytest.fixture(scope="module")
def prefill_params(tiny_model_dir: Path) -> dict[str, Any]:
    """Run P's scheduler half once; return the kv_transfer_params it granted."""
    return _producer_flow(tiny_model_dir)


def _producer_flow(model: Path) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(model, "kv_producer")
    conn = sched.connector
    free0 = free_blocks(sched)

    sched.add_request(request("p1", max_tokens=1, params={"do_remote_decode": True}))
    meta, _, outs = step(sched)
    assert meta.incarnation == conn.debug_state()["incarnation"]
    assert meta.grants == []  # the lease is granted when the request finishes
    params = outs["p1"].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    assert params["remote_request_id"] == "p1"
    assert params["remote_engine_id"] == conn.engine_id
    assert params["remote_num_tokens"] == len(PROMPT)
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == 4
    ticket = LeaseTicket.from_params(params[PARAMS_KEY])
    assert ticket.holder_engine == conn.engine_id
    assert ticket.holder_incarnation == meta.incarnation
    # Unclaimed, the lease lives the claim window (the extension of the 30 s lease).
    assert ticket.request_id == "p1" and ticket.expires_in == 20
    # Delayed free: the finished request keeps its blocks.
    assert "p1" in sched.requests
    assert free_blocks(sched) == free0 - 4

    meta, _, _ = step(sched)
    assert [(g.request_id, g.ticket) for g in meta.grants] == [("p1", ticket)]
    meta, _, _ = step(sched)
    assert meta.grants == []  # shipped once

    # An aborted prefill gets no lease and frees at once.
    sched.add_request(request("p2", max_tokens=1, params={"do_remote_decode": True}))
    sched.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    meta, _, _ = step(sched)
    assert meta.grants == [] and "p2" not in sched.requests
    assert conn.debug_state()["granted"] == 1

    # The worker's FreeBlocks (any reason) comes back as finished_sending.
    step(sched, sending={"p1"})
    assert "p1" not in sched.requests
    assert free_blocks(sched) == free0
    return dict(params)


def test_producer_grants_and_delays_free(prefill_params: dict[str, Any]) -> None:
    # The flow's assertions run in the fixture (shared with the consumer tests).
    assert LeaseTicket.from_params(prefill_params[PARAMS_KEY]).lease == 1


def test_parallel_sampling_children_share_one_lease(tiny_model_dir: Path) -> None:
    """vLLM names the children of an n > 1 request "<index>_<parent>" and hands the decoder
    the last child's kv_transfer_params: every child names one lease, and the others'
    blocks go back at once instead of waiting under leases nobody claims."""
    sched = make_scheduler(tiny_model_dir, "kv_producer")
    conn = sched.connector
    free0 = free_blocks(sched)
    parent = "cmpl-x-0-1a2b3c4d"
    for index in range(3):
        sched.add_request(
            request(f"{index}_{parent}", max_tokens=1, params={"do_remote_decode": True})
        )
    sched.add_request(request("0_other", max_tokens=1, params={"do_remote_decode": True}))
    _, _, outs = step(sched)
    tickets = {
        rid: LeaseTicket.from_params(o.kv_transfer_params[PARAMS_KEY]) for rid, o in outs.items()
    }
    children = [tickets[f"{index}_{parent}"] for index in range(3)]
    assert children[0] == children[1] == children[2]
    assert tickets["0_other"].lease != children[0].lease  # another parent: its own lease
    block_ids = {
        tuple(outs[f"{i}_{parent}"].kv_transfer_params["remote_block_ids"][0]) for i in range(3)
    }
    assert len(block_ids) == 1  # the granted child's blocks, named by every child
    meta, _, _ = step(sched)
    assert sorted(g.request_id for g in meta.grants) == sorted([f"0_{parent}", "0_other"])
    assert f"0_{parent}" in sched.requests and f"1_{parent}" not in sched.requests
    assert f"2_{parent}" not in sched.requests
    assert free_blocks(sched) == free0 - 2 * 4  # two leases' blocks held, not four
    state = conn.debug_state()
    assert state["granted"] == 2 and state["shared_children"] == 2
    # Each child's params count the children answered so far: the last, which vLLM
    # forwards, names all three, and the decoder's children tell their reader so.
    forwarded = outs[f"2_{parent}"].kv_transfer_params
    assert [outs[f"{i}_{parent}"].kv_transfer_params[READERS_KEY] for i in range(3)] == [1, 2, 3]
    decoder = make_scheduler(tiny_model_dir, "kv_consumer")
    for index in range(3):
        decoder.add_request(
            request(f"{index}_{parent}", max_tokens=4, params=copy.deepcopy(forwarded))
        )
    meta, _, _ = step(decoder)
    assert [(t.request_id, t.readers) for t in meta.tracks] == [
        (f"{index}_{parent}", 3) for index in range(3)
    ]


def test_consumer_tracks_from_enqueue(tiny_model_dir: Path, prefill_params: dict[str, Any]) -> None:
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_model_dir, "kv_consumer", max_num_seqs=1)
    conn = sched.connector
    # A local request occupies the only running slot.
    sched.add_request(request("busy", max_tokens=50, params=None))
    meta, out, _ = step(sched)
    assert "busy" in out.num_scheduled_tokens and meta.tracks == []

    # d1 is tracked at enqueue although it cannot be scheduled yet.
    sched.add_request(request("d1", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, out, _ = step(sched)
    assert "d1" not in out.num_scheduled_tokens
    assert sched.requests["d1"].status == RequestStatus.WAITING
    (track,) = meta.tracks
    assert track.request_id == "d1"
    assert track.ticket == LeaseTicket.from_params(prefill_params[PARAMS_KEY])
    assert (track.host, track.port) == (
        prefill_params["remote_host"],
        prefill_params["remote_port"],
    )
    assert meta.recvs == []
    for _ in range(3):  # still queued: no new orders, still tracked
        meta, out, _ = step(sched)
        assert meta.is_empty() and "d1" not in out.num_scheduled_tokens
    assert conn.debug_state()["tracked"] == 1

    # The slot frees: d1 is scheduled and its read planned (all 4 blocks, awaited).
    sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
    meta, out, _ = step(sched)
    assert sched.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = meta.recvs
    assert recv.request_id == "d1" and recv.awaiting
    assert len(recv.local_block_ids) == 4
    assert recv.remote_block_ids == prefill_params["remote_block_ids"][0]
    meta, _, _ = step(sched)
    assert meta.recvs == []  # one transfer per request

    # ReadConfirmed -> finished_recving: tracking stops, d1 decodes from the loaded blocks.
    step(sched, recving={"d1"})
    meta, out, _ = step(sched)
    assert meta.finishes == ["d1"]
    assert out.num_scheduled_tokens.get("d1") == 1  # only the last prompt token is recomputed
    assert conn.debug_state()["tracked"] == 0


def test_consumer_aborts(tiny_model_dir: Path, prefill_params: dict[str, Any]) -> None:
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_model_dir, "kv_consumer", max_num_seqs=1)
    free0 = free_blocks(sched)
    # Aborted before it was ever scheduled: finish (the reader aborts the lease), and
    # the engine keeps stepping briefly so the abort can leave.
    sched.add_request(request("busy", max_tokens=50, params=None))
    sched.add_request(request("d2", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, _, _ = step(sched)
    assert [t.request_id for t in meta.tracks] == ["d2"]
    sched.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    assert sched.connector.has_pending_push_work()
    meta, _, _ = step(sched)
    assert meta.finishes == ["d2"] and "d2" not in sched.requests

    # Aborted while its read is in flight: vLLM keeps the blocks until the worker reports.
    sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
    sched.add_request(request("d3", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, _, _ = step(sched)
    assert [r.request_id for r in meta.recvs] == ["d3"]
    sched.finish_requests("d3", RequestStatus.FINISHED_ABORTED)
    meta, _, _ = step(sched)
    assert meta.finishes == ["d3"]
    assert "d3" in sched.requests  # blocks held: a READ may still land in them
    step(sched, recving={"d3"})  # the worker's verdict after the read ended
    assert "d3" not in sched.requests
    step(sched)
    assert not sched.requests and free_blocks(sched) == free0


def test_consumer_failed_read_recomputes(
    tiny_model_dir: Path, prefill_params: dict[str, Any]
) -> None:
    sched = make_scheduler(tiny_model_dir, "kv_consumer")
    sched.add_request(request("d4", max_tokens=4, params=copy.deepcopy(prefill_params)))
    meta, _, _ = step(sched)
    assert [r.request_id for r in meta.recvs] == ["d4"]
    # The worker's verdict for a fenced/declined/failed read.
    step(sched, recving={"d4"}, failed={"d4"})
    meta, out, _ = step(sched)
    assert out.num_scheduled_tokens.get("d4") == len(PROMPT)  # recomputed from token 0
    assert meta.finishes == ["d4"]


def test_consumer_bad_ticket_is_not_tracked(
    tiny_model_dir: Path, prefill_params: dict[str, Any]
) -> None:
    sched = make_scheduler(tiny_model_dir, "kv_consumer")
    bad = copy.deepcopy(prefill_params)
    bad[PARAMS_KEY] = dict(bad[PARAMS_KEY], token="not-hex")
    sched.add_request(request("d5", max_tokens=4, params=bad))
    meta, out, _ = step(sched)
    assert meta.tracks == [] and meta.recvs == []
    assert out.num_scheduled_tokens.get("d5") == len(PROMPT)
    assert sched.connector.debug_state()["untracked"] == 1


# --------------------------------------------------------------- bidirectional turn 2

BIDIR = {"bidirectional_kv_xfer": True}
TURN1_OUT = 4  # tokens D decodes in turn 1 (the fake worker samples token 7)


def _decoder_turn2_flow(model: Path, prefill_params: dict[str, Any]) -> dict[str, Any]:
    """D (bidirectional): read turn 1, decode, keep the blocks for turn 2 under a TTL lease."""
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(model, "kv_consumer", **BIDIR)
    conn = sched.connector
    free0 = free_blocks(sched)
    req = request("d1", max_tokens=TURN1_OUT, params=copy.deepcopy(prefill_params))
    sched.add_request(req)
    meta, _, _ = step(sched)
    assert [t.request_id for t in meta.tracks] == ["d1"]
    assert [r.request_id for r in meta.recvs] == ["d1"]
    step(sched, recving={"d1"})
    outs: dict[str, Any] = {}
    finishes: list[str] = []
    for _ in range(TURN1_OUT + 2):
        meta, _, outs = step(sched)
        assert meta.grants == []  # nothing granted before the request finishes
        finishes += meta.finishes
        if "d1" in outs and outs["d1"].finished:
            break
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    params = outs["d1"].kv_transfer_params
    assert params is not None
    # Stock's turn-2 fields: D's blocks and address, for P to read with the next turn.
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_engine_id"] == conn.engine_id
    assert params["remote_request_id"] == "d1"
    assert params["remote_num_tokens"] == req.num_computed_tokens == len(PROMPT) + TURN1_OUT - 1
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == 4  # 107 tokens in 32-token blocks
    ticket = LeaseTicket.from_params(params[PARAMS_KEY])
    assert ticket.holder_engine == conn.engine_id and ticket.request_id == "d1"
    assert ticket.expires_in == 480  # decoder_kv_blocks_ttl, not kv_lease_duration
    assert params["remote_blocks_expiry_time"] == ticket.deadline
    # The blocks stay held for P until the worker's holder frees them.
    assert "d1" in sched.requests and free_blocks(sched) < free0
    meta, _, _ = step(sched)
    assert meta.incarnation == ticket.holder_incarnation
    assert [(g.request_id, g.ticket) for g in meta.grants] == [("d1", ticket)]
    assert finishes == ["d1"]  # the turn-1 read's tracking ended at finished_recving
    step(sched, sending={"d1"})  # P's done (or the TTL lapse) came back as FreeBlocks
    assert "d1" not in sched.requests and free_blocks(sched) == free0
    assert conn.debug_state()["granted"] == conn.debug_state()["granted_turn2"] == 1
    return dict(params)


@pytest.fixture(scope="module")
def turn2_params(tiny_model_dir: Path, prefill_params: dict[str, Any]) -> dict[str, Any]:
    return _decoder_turn2_flow(tiny_model_dir, prefill_params)


def turn2_prompt() -> list[int]:
    """Turn 1's prompt, its output and a few new tokens."""
    return [*PROMPT, *([7] * TURN1_OUT), 21, 22, 23]


def test_decoder_keeps_blocks_for_turn2(turn2_params: dict[str, Any]) -> None:
    # The flow's assertions run in the fixture (shared with the prefill-side tests).
    assert turn2_params["remote_num_tokens"] == 107


def test_decoder_without_bidirectional_frees_at_finish(
    tiny_model_dir: Path, prefill_params: dict[str, Any]
) -> None:
    sched = make_scheduler(tiny_model_dir, "kv_consumer")
    free0 = free_blocks(sched)
    sched.add_request(request("d6", max_tokens=2, params=copy.deepcopy(prefill_params)))
    step(sched)
    step(sched, recving={"d6"})
    outs: dict[str, Any] = {}
    while "d6" not in outs or not outs["d6"].finished:
        _, _, outs = step(sched)
    assert outs["d6"].kv_transfer_params is None
    assert "d6" not in sched.requests and free_blocks(sched) == free0


def test_prefill_reads_turn2_prefix(tiny_model_dir: Path, turn2_params: dict[str, Any]) -> None:
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_model_dir, "kv_producer", **BIDIR)
    conn = sched.connector
    prompt = turn2_prompt()
    remote_tokens = turn2_params["remote_num_tokens"]
    req = request("t2", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=prompt)
    sched.add_request(req)
    meta, out, _ = step(sched)
    # Tracked at enqueue (P's reader claims and heartbeats D's lease) and read planned.
    (track,) = meta.tracks
    assert track.request_id == "t2"
    assert track.ticket == LeaseTicket.from_params(turn2_params[PARAMS_KEY])
    assert (track.host, track.port) == (turn2_params["remote_host"], turn2_params["remote_port"])
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == remote_tokens  # external = min(remote, prompt) - 0
    (recv,) = meta.recvs
    assert recv.awaiting and len(recv.local_block_ids) == 4
    assert recv.remote_block_ids == turn2_params["remote_block_ids"][0]
    assert req.kv_transfer_params["_remote_blocks_processed"] is True
    assert req.kv_transfer_params["do_remote_decode"] is True  # still a prefill for D
    meta, _, _ = step(sched)
    assert meta.recvs == []  # planned once
    # Confirmed: P computes only the new tokens, then grants D a turn-1-style lease.
    step(sched, recving={"t2"})
    meta, out, outs = step(sched)
    assert meta.finishes == ["t2"]
    assert out.num_scheduled_tokens.get("t2") == len(prompt) - remote_tokens
    params = outs["t2"].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(prompt)
    ticket = LeaseTicket.from_params(params[PARAMS_KEY])
    assert ticket.expires_in == 20 and ticket.holder_engine == conn.engine_id  # claim window
    meta, _, _ = step(sched)
    assert [g.request_id for g in meta.grants] == ["t2"]
    assert conn.debug_state()["tracked"] == 0


def test_prefill_turn2_failed_read_recomputes(
    tiny_model_dir: Path, turn2_params: dict[str, Any]
) -> None:
    sched = make_scheduler(tiny_model_dir, "kv_producer", **BIDIR)
    prompt = turn2_prompt()
    sched.add_request(
        request("t3", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=prompt)
    )
    meta, _, _ = step(sched)
    assert [r.request_id for r in meta.recvs] == ["t3"]
    # The reader's verdict for a lapsed/declined/fenced turn-2 read.
    step(sched, recving={"t3"}, failed={"t3"})
    meta, out, outs = step(sched)
    assert out.num_scheduled_tokens.get("t3") == len(prompt)  # recomputed from token 0
    assert meta.recvs == [] and meta.finishes == ["t3"]  # never read again
    assert outs["t3"].kv_transfer_params["do_remote_prefill"] is True  # D still gets a lease


def test_prefill_turn2_abort_and_threshold(
    tiny_model_dir: Path, turn2_params: dict[str, Any]
) -> None:
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_model_dir, "kv_producer", max_num_seqs=1, **BIDIR)
    prompt = turn2_prompt()
    # Aborted while queued: tracking stops, the reader aborts D's lease (D frees at once).
    sched.add_request(request("busy", max_tokens=50, params=None))
    sched.add_request(
        request("t4", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=prompt)
    )
    meta, _, _ = step(sched)
    assert [t.request_id for t in meta.tracks] == ["t4"] and meta.recvs == []
    sched.finish_requests("t4", RequestStatus.FINISHED_ABORTED)
    meta, _, _ = step(sched)
    assert meta.finishes == ["t4"] and "t4" not in sched.requests
    sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
    step(sched)

    # Below kv_recompute_threshold: nothing is loaded, D is told at once (notify-only).
    sched = make_scheduler(tiny_model_dir, "kv_producer", kv_recompute_threshold=1000, **BIDIR)
    sched.add_request(
        request("t5", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=prompt)
    )
    meta, out, _ = step(sched)
    (recv,) = meta.recvs
    assert recv.local_block_ids == [] and not recv.awaiting
    assert out.num_scheduled_tokens.get("t5") == len(prompt)


def test_turn2_params_ignored_without_bidirectional(
    tiny_model_dir: Path, turn2_params: dict[str, Any]
) -> None:
    sched = make_scheduler(tiny_model_dir, "kv_producer")
    prompt = turn2_prompt()
    sched.add_request(
        request("t6", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=prompt)
    )
    meta, out, _ = step(sched)
    assert meta.tracks == [] and meta.recvs == []
    assert out.num_scheduled_tokens.get("t6") == len(prompt)


def test_read_ends_where_the_request_ends(
    tiny_model_dir: Path, turn2_params: dict[str, Any]
) -> None:
    """The holder's blocks cover more tokens than this prompt: read its first blocks.

    D kept 107 tokens (4 blocks); a turn-2 prompt of 40 tokens loads 40 of them
    into 2 blocks, which must come from D's blocks 0 and 1, not from its tail."""
    sched = make_scheduler(tiny_model_dir, "kv_producer", **BIDIR)
    short = PROMPT[:40]
    sched.add_request(request("t7", max_tokens=1, params=copy.deepcopy(turn2_params), prompt=short))
    meta, _, _ = step(sched)
    (recv,) = meta.recvs
    (remote,) = turn2_params["remote_block_ids"]
    assert len(recv.local_block_ids) == 2
    assert recv.remote_block_ids == remote[:2]
