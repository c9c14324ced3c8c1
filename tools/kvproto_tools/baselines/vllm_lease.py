"""vLLM NixlConnector lease renewal as vLLM 0.32.0 ships it, restated faithfully.

This is a *comparison baseline*, not something to deploy: it keeps vLLM's
behaviour, including its known failures, so the simulator and the benchmarks
can show them next to kvproto. spec/vllm-api.md cites the vLLM 0.32.0 source
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``) for every rule below.

What is restated, and where vLLM 0.32.0 does it:

* **Holder (P worker)** — :class:`VllmLeaseHolder`, ``NixlConnectorWorker``'s
  ``_reqs_to_send`` (an insertion-ordered ``dict`` of request id → deadline)
  and ``consumer_notification_counts_by_req``:

  - grant: ``_reqs_to_send[id] = now + kv_lease_duration`` (or
    ``decoder_kv_blocks_ttl`` for turn-2 blocks), an assignment
    (``pull_worker.start_load_kv``);
  - heartbeat ``HB:id1,id2`` (``base_worker._handle_heartbeat``): each *known*
    id gets ``max(old, now + kv_lease_duration * 2 // 3)`` **in place** (its
    position in the dict does not move); unknown ids are ignored;
  - completion ``id:n`` (``pull_worker._get_new_notifs``): ``count += 1`` per
    notification and free when the count *equals* ``n`` — raw counting, so a
    duplicated notification counts twice and frees the blocks while another
    consumer may still be reading; a completion for a request no longer held
    counts ``num_notifications_after_expiry`` ("Potentially invalid KV blocks
    ...") and is dropped;
  - expiry (``base_worker._reap_expired_send_leases``, every engine step): a
    **full scan** of the dict, counting ``num_kv_expired_reqs``
    (``reaper="full-scan"``, the default). ``reaper="head-stop"`` is the walk
    that vLLM's first lease release had (PR #41383, fixed since, vLLM #58222):
    it stops at the first live entry, so an expired lease inserted after a
    heartbeated one stays held until that one leaves. Only the historical
    ``vllm-v4`` simulator policy uses it.

* **Reader (D scheduler)** — :class:`VllmLeaseReader`, ``NixlConnectorScheduler``
  (``base_scheduler``): ``on_new_request`` starts tracking a request under its
  remote engine; one **global** throttle
  (``now - last >= kv_lease_duration // 6``) ships the whole
  ``heartbeat_by_engine`` map to the workers; tracking stops on
  ``finished_recving`` (success or failure) and on abort. A turn-2 request on
  P is not tracked ("heartbeats are effectively disabled for Bidirectional KV
  transfer"): D's blocks for it live for the fixed ``decoder_kv_blocks_ttl``.

* **Reader (D worker)** — :func:`worker_heartbeats`, ``base_worker._send_heartbeats``:
  one text heartbeat per remote engine to every holder rank the worker
  handshook with; for an engine not yet handshaken the worker starts a
  background handshake and **drops that tick's heartbeat**.

* Completion frames (:func:`completion_frame`) ride the READ as its
  notification; the turn-2 read check (:func:`turn2_read_allowed`,
  ``pull_worker._is_turn2_read_expired``) is ``now + 5 s < deadline - offset``,
  ``offset`` being the handshake's clock-offset estimate
  (``clock_sync=True``, the default; ``False`` models the first lease release,
  which compared the holder's ``perf_counter`` deadline with the reader's own).

There is no fencing: a reader uses whatever it read. Frames are parsed with
:mod:`kvproto.legacy` (total: malformed input raises
:class:`~kvproto.errors.RemoteProtocolError`, where vLLM's ``msg.rsplit`` /
``int()`` raise out of ``get_finished()``; callers decide what that means).

Sans-I/O like the kvproto core: every call takes ``now`` in the caller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Literal

from kvproto import legacy

Reaper = Literal["head-stop", "full-scan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmLeaseConfig:
    """vLLM's ``kv_connector_extra_config`` lease settings, plus the restatement's switches."""

    kv_lease_duration: int = 30
    """Initial lease at grant, seconds (vLLM's default; never validated by vLLM)."""
    decoder_kv_blocks_ttl: int = 480
    """Fixed lease of bidirectional turn-2 blocks held by the decoder, seconds."""
    reaper: Reaper = "full-scan"
    """``"full-scan"``: vLLM 0.32's reaper (every entry); ``"head-stop"``: the first release's
    walk, which stops at the first live entry (vLLM #58222)."""
    heartbeats: bool = True
    """False models vLLM before leases: one fixed timeout, nothing renews it."""
    clock_sync: bool = True
    """True: vLLM 0.32 (the handshake's clock offset is applied to turn-2 deadlines);
    False: the first lease release (deadlines compared across unrelated clocks)."""
    turn2_margin: float = 5.0
    """A turn-2 read is declined if ``now + margin >= deadline - offset`` (vLLM: 5 s)."""

    @property
    def interval(self) -> int:
        """``kv_lease_duration // 6``: the global heartbeat throttle (5 s at the default)."""
        return self.kv_lease_duration // 6

    @property
    def extension(self) -> int:
        """``kv_lease_duration * 2 // 3``: how far a heartbeat pushes a deadline (20 s)."""
        return self.kv_lease_duration * 2 // 3


@dataclass(slots=True)
class VllmHolderStats:
    """Counters of one :class:`VllmLeaseHolder` (vLLM 0.32 exports ``expired`` and
    ``notifications_after_expiry`` as ``vllm:nixl_num_kv_expired_reqs`` and
    ``vllm:nixl_num_notifications_after_expiry``; it logs or ignores the rest)."""

    heartbeats: int = 0
    """``HB:`` frames applied."""
    heartbeat_ids: int = 0
    """Request ids carried by those frames."""
    unknown_ids: int = 0
    """Heartbeat ids not (or no longer) held: ignored."""
    completions: int = 0
    """Completion notifications counted."""
    notifications_after_expiry: int = 0
    """Completions for a request no longer held: vLLM's ``num_notifications_after_expiry``
    ("Potentially invalid KV blocks for unrecognized request ...")."""
    released: int = 0
    """Leases freed because the completion count reached the expected count."""
    expired: int = 0
    """Leases freed by the reaper: vLLM's ``num_kv_expired_reqs``."""
    reaper_visits: int = 0
    """Dict entries the reaper looked at (its cost)."""


class VllmLeaseHolder:
    """One P worker's (holder rank's) lease table, as in vLLM 0.32's NixlConnectorWorker."""

    def __init__(self, config: VllmLeaseConfig | None = None) -> None:
        self.config = config or VllmLeaseConfig()
        self.stats = VllmHolderStats()
        # Insertion-ordered, as vLLM's: the historical head-stop reaper depends on it.
        self._reqs_to_send: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._released: list[str] = []
        self.last_expired: tuple[str, ...] = ()
        """The requests the last :meth:`get_finished` call freed because they expired."""

    def grant(self, now: float, request_id: str, *, ttl: float | None = None) -> float:
        """Hold ``request_id``'s blocks until ``now + ttl`` (default ``kv_lease_duration``).

        Returns the deadline (in this holder's clock), which vLLM also sends to
        the reader for turn-2 blocks.
        """
        deadline = now + (self.config.kv_lease_duration if ttl is None else ttl)
        # vLLM assigns into the dict: a re-grant's value replaces the old one, its
        # position (which only the head-stop reaper cares about) does not move.
        self._reqs_to_send[request_id] = deadline
        return deadline

    def handle_notification(self, now: float, data: bytes) -> None:
        """Apply one NIXL notification (``HB:...`` or ``id:n``).

        Raises :class:`~kvproto.errors.RemoteProtocolError` on malformed input,
        where vLLM raises out of ``get_finished()``.
        """
        frame = legacy.parse(data)
        if isinstance(frame, legacy.LegacyHeartbeat):
            self.stats.heartbeats += 1
            self.stats.heartbeat_ids += len(frame.request_ids)
            renewed = now + self.config.extension
            for request_id in frame.request_ids:
                old = self._reqs_to_send.get(request_id)
                if old is None:
                    self.stats.unknown_ids += 1
                else:
                    self._reqs_to_send[request_id] = max(old, renewed)
            return
        request_id = frame.request_id
        if request_id not in self._reqs_to_send:
            self.stats.notifications_after_expiry += 1
            return
        self.stats.completions += 1
        count = self._counts.get(request_id, 0) + 1
        if count == frame.expected:
            del self._reqs_to_send[request_id]
            self._counts.pop(request_id, None)
            self.stats.released += 1
            self._released.append(request_id)
        else:
            self._counts[request_id] = count

    def get_finished(self, now: float) -> list[str]:
        """This step's ``done_sending``: requests released by completions, then by the reaper."""
        done, self._released = self._released, []
        released = len(done)
        if self.config.reaper == "head-stop":
            while self._reqs_to_send:
                request_id, expires = next(iter(self._reqs_to_send.items()))
                self.stats.reaper_visits += 1
                if now < expires:
                    break  # vLLM #58222 (fixed in 0.32): everything behind a live head waits
                self._expire(request_id)
                done.append(request_id)
        else:
            for request_id, expires in list(self._reqs_to_send.items()):
                self.stats.reaper_visits += 1
                if now >= expires:
                    self._expire(request_id)
                    done.append(request_id)
        self.last_expired = tuple(done[released:])
        return done

    def _expire(self, request_id: str) -> None:
        del self._reqs_to_send[request_id]
        self._counts.pop(request_id, None)
        self.stats.expired += 1

    # ------------------------------------------------------------ queries

    def deadline(self, request_id: str) -> float | None:
        """The current deadline of a held request, or None."""
        return self._reqs_to_send.get(request_id)

    def held(self) -> list[str]:
        """Held request ids in the reaper's (insertion) order."""
        return list(self._reqs_to_send)

    def __len__(self) -> int:
        return len(self._reqs_to_send)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs_to_send

    def next_due(self) -> float | None:
        """When :meth:`get_finished` can next change anything (for event-driven callers).

        vLLM itself calls ``get_finished`` every step. The full scan needs the
        earliest deadline; with the head-stop reaper only the head's matters.
        """
        if self._released:
            return -math.inf
        if not self._reqs_to_send:
            return None
        if self.config.reaper == "head-stop":
            return next(iter(self._reqs_to_send.values()))
        return min(self._reqs_to_send.values())


class VllmLeaseReader:
    """One D engine's scheduler-side lease tracking (``heartbeat_by_engine`` + throttle)."""

    def __init__(self, config: VllmLeaseConfig | None = None) -> None:
        self.config = config or VllmLeaseConfig()
        self._by_engine: dict[str, dict[str, None]] = {}
        self._engine_of: dict[str, str] = {}
        self._last = -math.inf

    def on_new_request(self, request_id: str, engine: str) -> None:
        """The request entered D's scheduler (``do_remote_prefill``): start heartbeating it.

        ``request_id`` is vLLM's ``remote_request_id`` (the holder's id), ``engine``
        its ``remote_engine_id``. Nothing is tracked when heartbeats are off.
        """
        if not self.config.heartbeats or request_id in self._engine_of:
            return
        self._engine_of[request_id] = engine
        self._by_engine.setdefault(engine, {})[request_id] = None

    def stop(self, request_id: str) -> None:
        """Stop heartbeating (``finished_recving`` including failures, or abort). Idempotent."""
        engine = self._engine_of.pop(request_id, None)
        if engine is None:
            return
        ids = self._by_engine[engine]
        del ids[request_id]
        if not ids:
            del self._by_engine[engine]

    def build_meta(self, now: float) -> dict[str, tuple[str, ...]] | None:
        """``build_connector_meta``: the whole map if the global throttle allows, else None."""
        if not self._by_engine or now - self._last < self.config.interval:
            return None
        self._last = now
        return {engine: tuple(ids) for engine, ids in self._by_engine.items()}

    def next_heartbeat(self) -> float | None:
        """The earliest ``now`` at which :meth:`build_meta` returns a map, or None."""
        if not self._by_engine:
            return None
        due = self._last + self.config.interval
        while due - self._last < self.config.interval:  # the throttle subtracts; so do we
            due = math.nextafter(due, math.inf)
        return due

    def tracked(self) -> int:
        """Requests being heartbeated."""
        return len(self._engine_of)


def worker_heartbeats(
    meta: Mapping[str, tuple[str, ...]], handshaken: Container[str]
) -> tuple[list[tuple[str, bytes]], list[str]]:
    """One D worker's ``_send_heartbeats``: (engine, frame) to send, and engines to handshake.

    An engine the worker has not handshaken with gets no heartbeat this tick
    (vLLM submits the handshake in the background and drops the beat); the
    caller sends each frame to every holder rank of that engine it reads from.
    """
    frames: list[tuple[str, bytes]] = []
    need: list[str] = []
    for engine, ids in meta.items():
        if engine not in handshaken:
            need.append(engine)
        elif ids:
            frames.append((engine, legacy.encode_heartbeat(ids)))
    return frames, need


def completion_frame(request_id: str, expected_consumers: int) -> bytes:
    """The ``id:n`` notification attached to a READ (or sent alone on a full prefix hit)."""
    return legacy.encode_done(request_id, expected_consumers)


def turn2_read_allowed(
    now: float, deadline: float, *, offset: float = 0.0, margin: float = 5.0
) -> bool:
    """vLLM's turn-2 check: read only if ``now + margin < deadline - offset``.

    ``deadline`` is in the holder's clock; ``offset`` is the handshake's estimate of
    (holder clock - reader clock) (0 in the first lease release, which had none).
    """
    return now + margin < deadline - offset
