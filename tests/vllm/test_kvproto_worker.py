"""The connector's worker half, P and D in one process over real NIXL (no engine).

Two ``WorkerSide`` objects (what vLLM's WORKER-role connector delegates to)
register real torch tensors with real NIXL agents and talk through the real
side channel; the test plays the scheduler (metadata per step) and checks
vLLM's reporting rules byte for byte:

* a confirmed read moves exactly the holder's blocks (the tail only, for a
  partial prefix hit), is reported finished_recving once, and the holder
  reports finished_sending once;
* a request aborted while its READ is in flight is not reported until the
  READ ended (the holder is kept from progressing to hold the READ), then
  once;
* a holder that cannot be reached fails the request before its blocks are
  allocated; the failure is reported (finished + failed + its local blocks)
  when the Recv arrives;
* heterogeneous TP both ways (ranks overridden, several per process): each
  reader rank reads its slice (head-major CPU block), a holder rank frees only
  when every consumer it expects has read.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from kvproto.ticket import LeaseMint, LeaseTicket  # noqa: E402
from kvproto_vllm.config import parse_extra_config  # noqa: E402
from kvproto_vllm.metadata import Grant, KvprotoMetadata, Recv, Track  # noqa: E402
from kvproto_vllm.worker import STATS_EVERY_S, WorkerSide  # noqa: E402

from .engine_proc import free_port, free_port_pair  # noqa: E402
from .kvproto_config import kvproto_config  # noqa: E402

NUM_BLOCKS = 64
BLOCK_SHAPE = (2, 32, 64)  # CPU LBHNC block: heads x tokens x (K|V)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
INCARNATION = 77


def vllm_config(model: Path) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**kvproto_config("kv_both")),
    )
    return args.create_engine_config()


def make_worker(
    cfg: Any, engine: str, *, holds: bool, port: int, **extra: Any
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    adapter = parse_extra_config({"kvproto_side_channel_port": port, **extra})
    side = WorkerSide(
        cfg,
        adapter,
        engine_id=engine,
        num_blocks=NUM_BLOCKS,
        holds=holds,
        reads=not holds,
    )
    fill = torch.randn if holds else torch.zeros
    caches = {name: fill(NUM_BLOCKS, *BLOCK_SHAPE) for name in LAYERS}
    side.register_kv_caches(caches)
    return side, caches


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[WorkerSide, Any, WorkerSide, Any, Any]]:
    cfg = vllm_config(tiny_model_dir)
    p, p_kv = make_worker(cfg, "P-engine", holds=True, port=free_port())
    d, d_kv = make_worker(cfg, "D-engine", holds=False, port=free_port())
    try:
        yield p, p_kv, d, d_kv, cfg
    finally:
        d.shutdown()
        p.shutdown()


_MINTS: dict[str, LeaseMint] = {}


def mint(p: WorkerSide, request_id: str) -> LeaseTicket:
    """What P's scheduler half does at request_finished (one mint per engine)."""
    if p.engine_id not in _MINTS:
        _MINTS[p.engine_id] = LeaseMint(
            engine=p.engine_id,
            incarnation=INCARNATION,
            tp_size=1,
            params=p.cfg.lease.params,
            entropy=secrets.token_bytes,
        )
    return _MINTS[p.engine_id].mint(time.monotonic(), request_id=request_id, ttl=30)


class Loop:
    """Steps both workers like two engines would; collects what they report.

    ``d_incarnation``: D's holder incarnation, sent with each of its steps (push mode:
    D holds too)."""

    def __init__(
        self,
        p: WorkerSide,
        d: WorkerSide,
        *,
        p_incarnation: int = INCARNATION,
        d_incarnation: int | None = None,
    ) -> None:
        self.p, self.d = p, d
        self.p_incarnation, self.d_incarnation = p_incarnation, d_incarnation
        self.sending: list[str] = []
        self.recving: list[str] = []
        self.failed: list[str] = []
        self.bad_blocks: set[int] = set()

    def step(
        self,
        p_meta: KvprotoMetadata | None = None,
        d_meta: KvprotoMetadata | None = None,
        *,
        step_p: bool = True,
    ) -> None:
        if step_p:
            self.p.start_load_kv(p_meta or KvprotoMetadata(incarnation=self.p_incarnation))
            sending, _, _ = self.p.get_transfer_results()
            self.sending += sorted(sending)
        self.d.start_load_kv(d_meta or KvprotoMetadata(incarnation=self.d_incarnation))
        _, recving, failed = self.d.get_transfer_results()
        self.recving += sorted(recving)
        self.failed += sorted(failed)
        self.bad_blocks |= self.d.take_bad_blocks()

    def run_until(
        self, what: str, cond: Any, *, step_p: bool = True, timeout_s: float = 20
    ) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < end, (
                f"{what}: not reached; P events {list(self.p.events)[-6:]}, "
                f"D events {list(self.d.events)[-6:]}"
            )
            self.step(step_p=step_p)
            time.sleep(0.002)


def orders(rid: str, ticket: LeaseTicket, port: int, local: list[int], remote: list[int]) -> Any:
    track = Track(request_id=rid, ticket=ticket, host="127.0.0.1", port=port)
    recv = Recv(request_id=rid, local_block_ids=local, remote_block_ids=remote, awaiting=True)
    return track, recv


def grant_and_orders(
    ticket: LeaseTicket,
    port: int,
    local: list[int],
    remote: list[int],
    *,
    p_rid: str = "p-tp",
    d_rid: str = "d-tp",
) -> tuple[KvprotoMetadata, KvprotoMetadata]:
    """P's grant, D's track and recv of one request: both schedulers' orders of one step."""
    track, recv = orders(d_rid, ticket, port, local, remote)
    return (
        KvprotoMetadata(incarnation=INCARNATION, grants=[Grant(request_id=p_rid, ticket=ticket)]),
        KvprotoMetadata(tracks=[track], recvs=[recv]),
    )


def test_read_moves_the_blocks_and_reports_once(pair: Any) -> None:
    p, p_kv, d, d_kv, _ = pair
    loop = Loop(p, d)
    ticket = mint(p, "p-req-1")
    remote, local = [5, 6, 7, 8], [20, 21, 22, 23]
    track, recv = orders("d-req-1", ticket, p.base_port, local, remote)
    loop.step(
        KvprotoMetadata(
            incarnation=INCARNATION, grants=[Grant(request_id="p-req-1", ticket=ticket)]
        ),
        KvprotoMetadata(tracks=[track], recvs=[recv]),
    )
    loop.run_until("confirmed", lambda: loop.recving and loop.sending)
    for _ in range(5):
        loop.step()
    assert loop.recving == ["d-req-1"] and loop.failed == [] and not loop.bad_blocks
    assert loop.sending == ["p-req-1"]
    for name in LAYERS:
        assert torch.equal(d_kv[name][local], p_kv[name][remote])
    loop.step(d_meta=KvprotoMetadata(finishes=["d-req-1"]))  # scheduler stops tracking

    # Partial prefix hit: two local blocks are filled from the last two remote ones.
    ticket2 = mint(p, "p-req-2")
    track2, recv2 = orders("d-req-2", ticket2, p.base_port, [30, 31], [9, 10, 11, 12])
    loop.step(
        KvprotoMetadata(
            incarnation=INCARNATION, grants=[Grant(request_id="p-req-2", ticket=ticket2)]
        ),
        KvprotoMetadata(tracks=[track2], recvs=[recv2]),
    )
    loop.run_until("confirmed", lambda: "d-req-2" in loop.recving and "p-req-2" in loop.sending)
    for name in LAYERS:
        assert torch.equal(d_kv[name][[30, 31]], p_kv[name][[11, 12]])
    assert not torch.equal(d_kv[name][[30, 31]], p_kv[name][[9, 10]])
    loop.step(d_meta=KvprotoMetadata(finishes=["d-req-2"]))


def test_abort_during_read_waits_for_the_read(pair: Any) -> None:
    p, _, d, _, _ = pair
    loop = Loop(p, d)
    ticket = mint(p, "p-req-3")
    track, recv = orders("d-req-3", ticket, p.base_port, [40, 41], [13, 14])
    before = d.stats_snapshot()["reader_reads_started"]
    # The session is open from the previous test: the READ is issued in this very step,
    # after P's turn, and P does not progress again until the test lets it.
    loop.step(
        KvprotoMetadata(
            incarnation=INCARNATION, grants=[Grant(request_id="p-req-3", ticket=ticket)]
        ),
        KvprotoMetadata(tracks=[track], recvs=[recv]),
    )
    assert d.stats_snapshot()["reader_reads_started"] == before + 1
    loop.step(d_meta=KvprotoMetadata(finishes=["d-req-3"]), step_p=False)  # client aborts
    for _ in range(20):  # the READ cannot finish while P does not progress
        loop.step(step_p=False)
        time.sleep(0.005)
    assert "d-req-3" not in loop.recving, "reported while a READ may still land in the blocks"
    loop.run_until("verdict after the read", lambda: "d-req-3" in loop.recving)
    for _ in range(5):
        loop.step()
    assert loop.recving.count("d-req-3") == 1
    assert "d-req-3" not in loop.failed  # aborted: nothing to recompute
    assert loop.sending.count("p-req-3") == 1


def test_unreachable_holder_fails_before_allocation(pair: Any) -> None:
    p, _, _, _, cfg = pair
    d2, _ = make_worker(
        cfg,
        "D2-engine",
        holds=False,
        port=free_port(),
        handshake_attempts=1,
        handshake_timeout_s=0.3,
    )
    try:
        loop = Loop(p, d2)
        ticket = mint(p, "p-req-4")
        dead_port = free_port()  # nobody listens: the handshake times out
        track, recv = orders("d-req-4", ticket, dead_port, [50, 51], [1, 2])
        loop.step(d_meta=KvprotoMetadata(tracks=[track]), step_p=False)
        loop.run_until(
            "handshake failure",
            lambda: d2.stats_snapshot()["reader_handshake_failures"] == 1,
            step_p=False,
        )
        loop.step(step_p=False)
        assert loop.recving == []  # not allocated yet: nothing may be reported
        loop.step(d_meta=KvprotoMetadata(recvs=[recv]), step_p=False)
        assert loop.recving == ["d-req-4"] and loop.failed == ["d-req-4"]
        assert loop.bad_blocks == {50, 51}
        events = [e[1:] for e in d2.events]
        assert ("failed", "d-req-4", "connect-failed (queued)") in events
    finally:
        d2.shutdown()


def test_stats_are_read_after_a_change_or_the_interval(pair: Any) -> None:
    """vLLM asks for stats at every step; the snapshot is read only when it can differ."""
    p, _, d, _, _ = pair
    loop = Loop(p, d)
    loop.run_until("an idle step", lambda: not d.stats_due())
    assert not d.stats_due(), "nothing happened since the last read"
    before = d.stats_snapshot()["reader_untracked_finishes"]
    loop.step(d_meta=KvprotoMetadata(finishes=["never-tracked"]))  # an order: a counter moves
    assert d.stats_due()
    assert d.stats_snapshot()["reader_untracked_finishes"] == before + 1
    loop.run_until("an idle step", lambda: not d.stats_due())
    time.sleep(STATS_EVERY_S)  # heartbeats and acks move counters with no order or result
    loop.step()
    assert d.stats_due()


def test_idle_engines_skip_the_pump_and_wake_on_their_first_order(pair: Any) -> None:
    """Engines with no remote request skip the pump; the orders that end the idleness
    pump in their own step: a read completes after idle steps (the introduction waited
    in the side channel, the Hello in NIXL), and a request aborted before its read
    frees the holder's blocks although the reader tracks nothing after the abort."""
    _, _, _, _, cfg = pair
    p, _ = make_worker(cfg, "P-idle", holds=True, port=free_port())
    d, _ = make_worker(cfg, "D-idle", holds=False, port=free_port())
    try:
        loop = Loop(p, d)
        for _ in range(20):  # no lease, no session, nothing tracked: no pump
            loop.step()

        ticket = mint(p, "p-idle-1")
        first = grant_and_orders(
            ticket, p.base_port, [3, 4], [5, 6], p_rid="p-idle-1", d_rid="d-idle-1"
        )
        loop.step(*first)
        loop.run_until("confirmed", lambda: loop.recving and loop.sending)
        assert loop.recving == ["d-idle-1"] and loop.sending == ["p-idle-1"] and not loop.failed
        loop.step(d_meta=KvprotoMetadata(finishes=["d-idle-1"]))

        ticket2 = mint(p, "p-idle-2")
        track2, _ = orders("d-idle-2", ticket2, p.base_port, [7], [8])
        loop.step(
            KvprotoMetadata(
                incarnation=INCARNATION, grants=[Grant(request_id="p-idle-2", ticket=ticket2)]
            ),
            KvprotoMetadata(tracks=[track2]),
        )
        loop.step(d_meta=KvprotoMetadata(finishes=["d-idle-2"]))  # aborted before its read
        loop.run_until("freed", lambda: "p-idle-2" in loop.sending)
        assert ("freed", "p-idle-2", "ABORTED") in [e[1:] for e in p.events]
    finally:
        d.shutdown()
        p.shutdown()


def test_the_pump_gap_counts_waits_with_work_pending_only(pair: Any) -> None:
    """``worker_pump_gap_ms_max`` bounds how late a due heartbeat answer or done can be: a
    wait while a lease is held counts, a wait with nothing to do (vLLM does not step an
    engine without requests) does not."""
    _, _, _, _, cfg = pair
    p, _ = make_worker(cfg, "P-gap", holds=True, port=free_port())
    d, _ = make_worker(cfg, "D-gap", holds=False, port=free_port())
    try:
        loop = Loop(p, d)
        loop.step()
        p.take_pump_gap_ms()
        time.sleep(0.3)  # no request anywhere: nothing is late
        ticket = mint(p, "p-gap-1")
        p_meta, _ = grant_and_orders(
            ticket, p.base_port, [3, 4], [5, 6], p_rid="p-gap-1", d_rid="d-gap-1"
        )
        loop.step(p_meta)
        assert p.take_pump_gap_ms() < 300
        time.sleep(0.3)  # a lease is held: its reader's frames wait for this pump
        loop.step()
        assert p.take_pump_gap_ms() >= 300
    finally:
        d.shutdown()
        p.shutdown()


class Ranks:
    """Several worker ranks of a P and a D engine, stepped together."""

    def __init__(self, ps: list[WorkerSide], ds: list[WorkerSide]) -> None:
        self.ps, self.ds = ps, ds
        self.sending: dict[int, list[str]] = {i: [] for i in range(len(ps))}
        self.recving: dict[int, list[str]] = {i: [] for i in range(len(ds))}
        self.failed: list[str] = []

    def step(
        self,
        p_meta: KvprotoMetadata | None = None,
        d_meta: KvprotoMetadata | None = None,
        *,
        only_d: set[int] | None = None,
    ) -> None:
        for i, p in enumerate(self.ps):  # vLLM broadcasts one metadata to every rank
            p.start_load_kv(p_meta or KvprotoMetadata(incarnation=INCARNATION))
            self.sending[i] += sorted(p.get_transfer_results()[0])
        for i, d in enumerate(self.ds):
            if only_d is not None and i not in only_d:
                continue
            d.start_load_kv(d_meta or KvprotoMetadata())
            _, recving, failed = d.get_transfer_results()
            self.recving[i] += sorted(recving)
            self.failed += sorted(failed)

    def run_until(self, what: str, cond: Any, *, only_d: set[int] | None = None) -> None:
        end = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < end, f"{what}: not reached"
            self.step(only_d=only_d)
            time.sleep(0.002)


def tp_worker(
    cfg: Any, engine: str, rank: int, size: int, heads: int, *, holds: bool, port: int
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    adapter = parse_extra_config({"kvproto_side_channel_port": port})
    side = WorkerSide(
        cfg,
        adapter,
        engine_id=engine,
        num_blocks=NUM_BLOCKS,
        holds=holds,
        reads=not holds,
        tp=(rank, size),
    )
    fill = torch.randn if holds else torch.zeros
    # A TP rank holds heads / size KV heads of the head-major CPU block.
    caches = {name: fill(NUM_BLOCKS, heads, 32, 64) for name in LAYERS}
    side.register_kv_caches(caches)
    return side, caches


def test_reader_tp_wider_than_holder(pair: Any) -> None:
    """P TP 1 -> D TP 2: each D rank reads its half (its head) of every P block; P frees
    only after both D ranks' done frames (expected consumers = 2)."""
    cfg = pair[4]
    base = free_port()
    p, p_kv = tp_worker(cfg, "P-tp1", 0, 1, 2, holds=True, port=base)
    d0, d0_kv = tp_worker(cfg, "D-tp2", 0, 2, 1, holds=False, port=free_port())
    d1, d1_kv = tp_worker(cfg, "D-tp2", 1, 2, 1, holds=False, port=free_port())
    try:
        ranks = Ranks([p], [d0, d1])
        mint_ = LeaseMint(
            engine="P-tp1",
            incarnation=INCARNATION,
            tp_size=1,
            params=p.cfg.lease.params,
            entropy=secrets.token_bytes,
        )
        ticket = mint_.mint(time.monotonic(), request_id="p-tp", ttl=30)
        p_meta, d_meta = grant_and_orders(ticket, base, [3, 4], [7, 8])
        ranks.step(p_meta, d_meta, only_d={0})
        ranks.run_until("rank 0 confirmed", lambda: ranks.recving[0], only_d={0})
        for _ in range(10):
            ranks.step(only_d={0})
        assert ranks.sending[0] == [], "P freed before its second consumer read"
        ranks.step(d_meta=d_meta, only_d={1})
        ranks.run_until("P freed", lambda: ranks.sending[0])
        assert ranks.recving == {0: ["d-tp"], 1: ["d-tp"]} and ranks.failed == []
        assert ranks.sending[0] == ["p-tp"]
        for name in LAYERS:
            assert torch.equal(d0_kv[name][[3, 4]], p_kv[name][[7, 8]][:, 0:1])
            assert torch.equal(d1_kv[name][[3, 4]], p_kv[name][[7, 8]][:, 1:2])
    finally:
        for side in (d1, d0, p):
            side.shutdown()


def test_holder_tp_wider_than_reader(pair: Any) -> None:
    """P TP 2 -> D TP 1: the D rank reads whole blocks from both P ranks (side channels on
    base + rank) into the two halves of its block; each P rank frees on its own done."""
    cfg = pair[4]
    base = free_port_pair()
    p0, p0_kv = tp_worker(cfg, "P-tp2", 0, 2, 1, holds=True, port=base)
    p1, p1_kv = tp_worker(cfg, "P-tp2", 1, 2, 1, holds=True, port=base)
    d, d_kv = tp_worker(cfg, "D-tp1", 0, 1, 2, holds=False, port=free_port())
    try:
        assert (p0.server.port, p1.server.port) == (base, base + 1)  # type: ignore[union-attr]
        ranks = Ranks([p0, p1], [d])
        mint_ = LeaseMint(
            engine="P-tp2",
            incarnation=INCARNATION,
            tp_size=2,
            params=p0.cfg.lease.params,
            entropy=secrets.token_bytes,
        )
        ticket = mint_.mint(time.monotonic(), request_id="p-tp", ttl=30)
        p_meta, d_meta = grant_and_orders(ticket, base, [5, 6], [9, 10])
        ranks.step(p_meta, d_meta)
        ranks.run_until("both P ranks freed", lambda: ranks.sending[0] and ranks.sending[1])
        ranks.run_until("confirmed", lambda: ranks.recving[0])
        assert ranks.sending == {0: ["p-tp"], 1: ["p-tp"]} and ranks.failed == []
        for name in LAYERS:
            assert torch.equal(d_kv[name][[5, 6]][:, 0:1], p0_kv[name][[9, 10]])
            assert torch.equal(d_kv[name][[5, 6]][:, 1:2], p1_kv[name][[9, 10]])
    finally:
        for side in (d, p1, p0):
            side.shutdown()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_partial_hit_across_tp_ratio(pair: Any, p_tp: int, d_tp: int) -> None:
    """A partial prefix hit with a TP ratio: D has the first two of P's four blocks
    cached, so every D rank reads only the last two, each from its holder rank(s) and
    into its head slice -- nothing else in D's cache changes. Every holder rank counts
    one done per expected consumer and frees exactly once (no late or duplicate done);
    every rank reports exactly once."""
    cfg = pair[4]
    heads = 2  # the tiny Llama's KV heads; a rank holds heads // tp of them
    base = free_port_pair()
    p_engine, d_engine = f"P-part-{p_tp}{d_tp}", f"D-part-{p_tp}{d_tp}"
    ps = [
        tp_worker(cfg, p_engine, r, p_tp, heads // p_tp, holds=True, port=base) for r in range(p_tp)
    ]
    ds = [
        tp_worker(cfg, d_engine, r, d_tp, heads // d_tp, holds=False, port=free_port())
        for r in range(d_tp)
    ]
    try:
        ranks = Ranks([p for p, _ in ps], [d for d, _ in ds])
        mint_ = LeaseMint(
            engine=p_engine,
            incarnation=INCARNATION,
            tp_size=p_tp,
            params=ps[0][0].cfg.lease.params,
            entropy=secrets.token_bytes,
        )
        ticket = mint_.mint(time.monotonic(), request_id="p-tp", ttl=30)
        local, remote = [12, 13], [20, 21, 22, 23]
        p_meta, d_meta = grant_and_orders(ticket, base, local, remote)
        ranks.step(p_meta, d_meta)
        ranks.run_until(
            "every rank reported",
            lambda: all(ranks.sending.values()) and all(ranks.recving.values()),
        )
        for _ in range(10):  # nothing is reported twice
            ranks.step()
        assert ranks.sending == {r: ["p-tp"] for r in range(p_tp)}
        assert ranks.recving == {r: ["d-tp"] for r in range(d_tp)} and ranks.failed == []

        consumers = d_tp // p_tp if d_tp > p_tp else 1  # D ranks reading one P rank
        for p, _ in ps:
            stats = p.stats_snapshot()
            assert stats["holder_done_frames"] == consumers, stats
            assert stats["holder_released_done"] == 1 and stats["holder_late_done"] == 0
            assert stats["holder_duplicate_done"] == 0 and stats["holder_expired"] == 0
        for d, _ in ds:
            stats = d.stats_snapshot()
            assert stats["reader_reads_started"] == (p_tp // d_tp if p_tp > d_tp else 1)
            assert stats["reader_reads_confirmed"] == 1 and stats["reader_failed_recving"] == 0

        tail = remote[-len(local) :]
        for name in LAYERS:
            for d_rank, (_, d_kv) in enumerate(ds):
                for p_rank, (_, p_kv) in enumerate(ps):
                    if d_tp > p_tp:  # D rank r holds head r of P's only rank
                        want = p_kv[name][tail][:, d_rank : d_rank + 1]
                        got = d_kv[name][local]
                    else:  # D's only rank holds P rank h's head at slice h
                        want = p_kv[name][tail]
                        got = d_kv[name][local][:, p_rank : p_rank + 1]
                    assert torch.equal(got, want), (name, d_rank, p_rank)
                others = [b for b in range(NUM_BLOCKS) if b not in local]
                assert not d_kv[name][others].any(), "a block outside the read changed"
    finally:
        for side, _ in (*ds, *ps):
            side.shutdown()
