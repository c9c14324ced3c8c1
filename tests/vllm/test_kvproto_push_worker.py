"""Push mode's worker halves, P and D in one process over real NIXL (no engine).

Two push-mode ``WorkerSide`` objects (each holds and reads) register real tensors with
real NIXL agents and talk through the real side channel; the test plays both schedulers
(P's grant of its finished blocks; D's track of that lease, then its writable grant and
Recv of the allocated blocks) and checks what vLLM is told:

* D's registration reaches P, P claims, arms and WRITEs: D's blocks equal P's (the tail
  only, for a partial prefix hit), D reports finished_recving once and no failure; D's
  finish then ends P's lease, reported finished_sending once;
* P no longer holds the source blocks (its lease never granted): nothing is written, D's
  load fails (finished + failed + its blocks as load errors), so vLLM recomputes;
* P stalls with its write in flight past D's lease: D fences the lease (reports nothing
  while the write may land), then fails the load once the late done arrived;
* a registration is peer data: anything malformed decodes to None.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from kvproto.ticket import LeaseMint, LeaseTicket  # noqa: E402
from kvproto_vllm.config import parse_extra_config  # noqa: E402
from kvproto_vllm.metadata import Grant, KvprotoMetadata, Recv, Track  # noqa: E402
from kvproto_vllm.push_registration import (  # noqa: E402
    Registration,
    decode_registration,
    encode_registration,
)
from kvproto_vllm.worker import WorkerSide  # noqa: E402

from .engine_proc import free_port  # noqa: E402
from .test_kvproto_worker import BLOCK_SHAPE, LAYERS, NUM_BLOCKS, Loop, vllm_config  # noqa: E402

P_INCARNATION, D_INCARNATION = 71, 72
LEASE_S = 6
"""Short, so a write stalled past D's lease (extension 4 s) ends it within the test."""


def push_worker(cfg: Any, engine: str, *, prefill: bool) -> tuple[WorkerSide, dict[str, Any]]:
    adapter = parse_extra_config(
        {
            "kvproto_side_channel_port": free_port(),
            "transfer_mode": "push",
            "kv_lease_duration": LEASE_S,
            # The stalled write needs a P whose WRITE moves only inside its calls: NIXL's
            # progress thread would finish it while the test holds P's steps back.
            "nixl_progress_thread": False,
        }
    )
    side = WorkerSide(cfg, adapter, engine_id=engine, num_blocks=NUM_BLOCKS, holds=True, reads=True)
    fill = torch.randn if prefill else torch.zeros
    caches = {name: fill(NUM_BLOCKS, *BLOCK_SHAPE) for name in LAYERS}
    side.register_kv_caches(caches)
    return side, caches


@pytest.fixture(scope="module")
def push_pair(tiny_model_dir: Path) -> Iterator[tuple[WorkerSide, Any, WorkerSide, Any]]:
    cfg = vllm_config(tiny_model_dir)
    p, p_kv = push_worker(cfg, "P-push", prefill=True)
    d, d_kv = push_worker(cfg, "D-push", prefill=False)
    try:
        yield p, p_kv, d, d_kv
    finally:
        d.shutdown()
        p.shutdown()


_MINTS: dict[str, LeaseMint] = {}


def mint(engine: str, incarnation: int, request_id: str, side: WorkerSide) -> LeaseTicket:
    """What each scheduler half mints (P at request_finished, D at allocation)."""
    if engine not in _MINTS:
        _MINTS[engine] = LeaseMint(
            engine=engine,
            incarnation=incarnation,
            tp_size=1,
            params=side.cfg.lease.params,
            entropy=secrets.token_bytes,
        )
    return _MINTS[engine].mint(
        time.monotonic(), request_id=request_id, ttl=side.cfg.lease.grant_ttl
    )


def writer_events(p: WorkerSide, source: str) -> list[str]:
    """P's push events for the writes out of request ``source``'s blocks (tracked per
    writable lease: ``<source>#<D engine>#<lease>``)."""
    return [kind for _, kind, rid, _ in p.events if rid.startswith(source + "#")]


class PushLoop(Loop):
    """Steps both push workers like two engines (each holds: both send incarnations)."""

    def __init__(self, p: WorkerSide, d: WorkerSide) -> None:
        super().__init__(p, d, p_incarnation=P_INCARNATION, d_incarnation=D_INCARNATION)

    def request(
        self, p_rid: str, d_rid: str, local: list[int], remote: list[int], *, granted: bool = True
    ) -> None:
        """P's grant (unless not ``granted``), then D's track, writable grant and Recv."""
        t_p = mint("P-push", P_INCARNATION, p_rid, self.p)
        t_d = mint("D-push", D_INCARNATION, d_rid, self.d)
        grants = [Grant(request_id=p_rid, ticket=t_p)] if granted else []
        self.step(p_meta=KvprotoMetadata(incarnation=P_INCARNATION, grants=grants))
        track = Track(request_id=d_rid, ticket=t_p, host="127.0.0.1", port=self.p.base_port)
        recv = Recv(
            request_id=d_rid,
            local_block_ids=local,
            remote_block_ids=remote,
            awaiting=True,
            writable=t_d,
        )
        self.step(
            d_meta=KvprotoMetadata(
                incarnation=D_INCARNATION,
                tracks=[track],
                grants=[Grant(request_id=d_rid, ticket=t_d, writable=True)],
                recvs=[recv],
            )
        )


def test_p_writes_into_ds_registered_blocks_and_both_report_once(push_pair: Any) -> None:
    p, p_kv, d, d_kv = push_pair
    loop = PushLoop(p, d)
    remote, local = [5, 6, 7, 8], [20, 21, 22, 23]
    loop.request("p-1", "d-1", local, remote)
    loop.run_until("written", lambda: loop.recving)
    assert loop.recving == ["d-1"] and loop.failed == [] and not loop.bad_blocks
    for name in LAYERS:
        assert torch.equal(d_kv[name][local], p_kv[name][remote])
    assert loop.sending == []  # P's lease lasts until D's scheduler finishes the request
    loop.step(d_meta=KvprotoMetadata(incarnation=D_INCARNATION, finishes=["d-1"]))
    loop.run_until("P freed", lambda: loop.sending)
    for _ in range(5):
        loop.step()
    assert loop.sending == ["p-1"] and loop.recving == ["d-1"]
    assert writer_events(p, "p-1") == ["registration", "writing", "written"]

    # Partial prefix hit: D registers two blocks, written from P's last two.
    loop.request("p-2", "d-2", [30, 31], [11, 12])
    loop.run_until("written", lambda: "d-2" in loop.recving)
    for name in LAYERS:
        assert torch.equal(d_kv[name][[30, 31]], p_kv[name][[11, 12]])
    loop.step(d_meta=KvprotoMetadata(incarnation=D_INCARNATION, finishes=["d-2"]))
    loop.run_until("P freed", lambda: "p-2" in loop.sending)
    assert loop.failed == []


def test_nothing_is_written_from_blocks_p_no_longer_holds(push_pair: Any) -> None:
    p, _, d, d_kv = push_pair
    loop = PushLoop(p, d)
    before = {name: d_kv[name][[40, 41]].clone() for name in LAYERS}
    loop.request("p-3", "d-3", [40, 41], [13, 14], granted=False)
    loop.run_until("load failed", lambda: "d-3" in loop.recving)
    assert loop.failed == ["d-3"] and loop.bad_blocks == {40, 41}
    for name in LAYERS:
        assert torch.equal(d_kv[name][[40, 41]], before[name])
    # P gives the write up (its source not held, or D's lease already revoked: D's claim
    # of P's lease failed first), never writes.
    loop.run_until("P gave up", lambda: "write-failed" in writer_events(p, "p-3"))
    assert writer_events(p, "p-3") == ["registration", "write-failed"]
    loop.step(d_meta=KvprotoMetadata(incarnation=D_INCARNATION, finishes=["d-3"]))


def test_a_write_stalled_past_the_lease_is_fenced_then_recomputed(push_pair: Any) -> None:
    """P stops progressing with its WRITE in flight (NIXL moves it only inside P's calls,
    and its done leaves only after it): D's writable lease ends, and D, armed, fences it
    instead of freeing: nothing reported while the write may land; once P resumes and
    the late done arrives, the load fails (recomputed into blocks no write reaches)."""
    p, _, d, _ = push_pair
    loop = PushLoop(p, d)
    assert d.push_holder is not None
    fenced = d.push_holder.fenced
    loop.request("p-4", "d-4", [44, 45], [15, 16])
    loop.run_until("writing", lambda: "writing" in writer_events(p, "p-4"))
    end = time.monotonic() + 3 * LEASE_S
    while d.push_holder.fenced == fenced:
        assert time.monotonic() < end, list(d.events)[-6:]
        loop.step(step_p=False)
        time.sleep(0.01)
    for _ in range(20):
        loop.step(step_p=False)
    assert "d-4" not in loop.recving, "reported while P's write may still land"
    loop.run_until("the late done", lambda: "d-4" in loop.recving)
    assert "d-4" in loop.failed and {44, 45} <= loop.bad_blocks
    assert ("load-failed", "d-4") in [e[1:3] for e in d.events]
    loop.step(d_meta=KvprotoMetadata(incarnation=D_INCARNATION, finishes=["d-4"]))
    loop.run_until("P freed", lambda: "p-4" in loop.sending)


def test_a_registration_is_peer_data_decoded_totally() -> None:
    d_mint = _MINTS.get("D-push") or LeaseMint(
        engine="D-push",
        incarnation=D_INCARNATION,
        tp_size=1,
        params=parse_extra_config({}).lease.params,
        entropy=secrets.token_bytes,
    )
    t_d = d_mint.mint(time.monotonic(), request_id="d-9", ttl=8)
    good = Registration(
        ticket=t_d,
        writer_request_id="p-9",
        host="127.0.0.1",
        port=5600,
        holder_blocks=[1, 2],
        writer_blocks=[7, 8],
    )
    in_parts = msgspec.structs.replace(good, holder_blocks=[1, 1], parts=2, holder_parts=[0, 1])
    assert decode_registration(encode_registration(good)) == good
    assert decode_registration(encode_registration(in_parts)) == in_parts
    for bad in (
        b"",
        b"\xff" * 9,
        encode_registration(msgspec.structs.replace(good, writer_blocks=[7])),
        encode_registration(msgspec.structs.replace(good, holder_blocks=[])),
        encode_registration(msgspec.structs.replace(good, port=0)),
        encode_registration(msgspec.structs.replace(good, writer_request_id="")),
        # Parts: one per pair, each inside the block, and only with blocks in parts.
        encode_registration(msgspec.structs.replace(in_parts, holder_parts=[0])),
        encode_registration(msgspec.structs.replace(in_parts, holder_parts=[0, 2])),
        encode_registration(msgspec.structs.replace(in_parts, holder_parts=[-1, 0])),
        encode_registration(msgspec.structs.replace(in_parts, parts=0)),
        encode_registration(msgspec.structs.replace(good, holder_parts=[0, 0])),
    ):
        assert decode_registration(bad) is None


def _writable_ticket() -> LeaseTicket:
    mint = LeaseMint(
        engine="D-push",
        incarnation=D_INCARNATION,
        tp_size=1,
        params=parse_extra_config({}).lease.params,
        entropy=secrets.token_bytes,
    )
    return mint.mint(time.monotonic(), request_id="d-9", ttl=8)


_TICKET = _writable_ticket()


@st.composite
def _registration_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A registration's fields, mostly well formed, each of them broken now and then."""
    n = draw(st.integers(0, 4))
    blocks = st.lists(st.integers(-1, 9), min_size=n, max_size=n)
    parts = draw(st.one_of(st.integers(1, 3), st.integers(-1, 4), st.text(max_size=1)))
    fields: dict[str, Any] = {
        "ticket": _TICKET,
        "writer_request_id": draw(
            st.one_of(st.just("p-9"), st.text(max_size=2), st.integers(-5, 5))
        ),
        "host": "127.0.0.1",
        "port": draw(st.one_of(st.just(5600), st.integers(-1, 70000))),
        "holder_blocks": draw(st.one_of(blocks, st.lists(st.integers(0, 9), max_size=4))),
        "writer_blocks": draw(blocks),
    }
    if draw(st.booleans()):
        fields["parts"] = parts
        if isinstance(parts, int) and parts > 1 and draw(st.booleans()):
            fields["holder_parts"] = draw(
                st.lists(st.integers(0, parts - 1), min_size=n, max_size=n)
            )
    if "holder_parts" not in fields and draw(st.booleans()):
        wrong = st.lists(st.integers(-1, 3), min_size=max(0, n - 1), max_size=n + 1)
        fields["holder_parts"] = draw(wrong)
    if draw(st.booleans()):
        # Early (before P's prefill finished): D's groups instead of pairs.
        groups = draw(st.lists(st.lists(st.integers(-1, 9), max_size=3), min_size=1, max_size=3))
        fields["holder_groups"] = groups
        fields["allocated"] = [len(g) + draw(st.sampled_from([0, 0, 1, -1])) for g in groups]
        fields["block_size"] = draw(st.sampled_from([32, 0, -1]))
        if draw(st.integers(0, 4)):
            fields["holder_blocks"] = fields["writer_blocks"] = []
    return fields


@given(st.one_of(st.binary(max_size=64), _registration_fields().map(msgspec.msgpack.encode)))
def test_any_registration_bytes_decode_to_a_consistent_one_or_none(data: bytes) -> None:
    """Peer data: whatever arrives decodes to None or to pairs P can write as they are."""
    reg = decode_registration(data)
    if reg is None:
        return
    assert reg.ticket == _TICKET and reg.writer_request_id and 0 < reg.port < 65536
    if reg.early:
        # No pairs: P pairs D's groups with its blocks (a group's blocks fit its allocation).
        assert not (reg.holder_blocks or reg.writer_blocks or reg.holder_parts)
        assert reg.parts == 1 and reg.block_size >= 0
        assert len(reg.allocated) == len(reg.holder_groups)
        assert all(
            n >= len(g) and min(g, default=0) >= 0
            for n, g in zip(reg.allocated, reg.holder_groups, strict=True)
        )
        return
    assert len(reg.holder_blocks) == len(reg.writer_blocks) > 0
    assert min(reg.holder_blocks + reg.writer_blocks) >= 0
    assert reg.parts >= 1
    assert len(reg.holder_parts) == (len(reg.holder_blocks) if reg.parts > 1 else 0)
    assert all(0 <= part < reg.parts for part in reg.holder_parts)
