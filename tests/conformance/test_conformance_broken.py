"""The suite is itself tested: deliberately broken transports fail exactly the cases meant to
catch them, and every MUST case is failed by at least one of them (the write cases, T6, by
broken writers: a transport that does not write has them UNSUPPORTED).

Each broken transport wraps a loopback endpoint and breaks one promise; they live here, in
the tests, never in the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence

import pytest

from kvproto.tpmath import BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    PeerId,
    PeerLost,
    PeerUnreachable,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    Transport,
    TransportEvent,
    UnknownPeer,
    WriteCompleted,
    WriteFailed,
    WriteId,
)
from kvproto_transports.conformance import (
    Level,
    TransportFactory,
    Verdict,
    all_cases,
    run_conformance,
)
from kvproto_transports.forwarding import ForwardingTransport, ForwardingWrites
from kvproto_transports.loopback import LinkFaults, LoopbackGroup, LoopbackTransport

# --- the broken transports ----------------------------------------------------------


class Wrapper(ForwardingTransport[LoopbackTransport]):
    """Delegates every Transport call to a loopback endpoint; subclasses break one thing."""

    LINK: LinkFaults | None = None
    """Faults of every link of the group (None: the kit's default)."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner)
        self.group = group

    @property
    def max_size(self) -> int:
        cap = self.inner.max_notification_size
        assert cap is not None
        return cap


class Truncates(Wrapper):
    """Oversize payloads are cut to the maximum and sent."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(peer, payload[: self.max_size])


class DropsOversize(Wrapper):
    """Oversize payloads are accepted and silently dropped."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        if len(payload) <= self.max_size:
            self.inner.send(peer, payload)


class NotifyBeforeData(Wrapper):
    """The read's notify goes out when the read is issued, not when its data has landed."""

    def read_blocks(self, peer: PeerId, *, notify: bytes | None = None, **kw: object) -> ReadId:
        rid = super().read_blocks(peer, notify=None, **kw)  # type: ignore[arg-type]
        if notify is not None:
            self.inner.send(peer, notify)
        return rid


class NoDetectionBound(Wrapper):
    """Claims to detect peer failure but declares no bound."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(self.inner.capabilities, failure_detection_bound_s=None)


class AliasIds(Wrapper):
    """add_peer returns an alias, not the peer's local_peer (notifications carry the real name)."""

    def add_peer(self, metadata: bytes) -> PeerId:
        return "alias:" + self.inner.add_peer(metadata)

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(peer.removeprefix("alias:"), payload)

    def remove_peer(self, peer: PeerId) -> None:
        self.inner.remove_peer(peer.removeprefix("alias:"))

    def read_blocks(self, peer: PeerId, **kw: object) -> ReadId:
        return super().read_blocks(peer.removeprefix("alias:"), **kw)  # type: ignore[arg-type]

    def poll(self) -> Sequence[TransportEvent]:
        return [
            PeerLost(peer="alias:" + e.peer, reason=e.reason) if isinstance(e, PeerLost) else e
            for e in self.inner.poll()
        ]


class UnstableIds(Wrapper):
    """Names a sender afresh every 50 notifications (as if it reconnected)."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.counts: dict[str, int] = {}

    def poll(self) -> Sequence[TransportEvent]:
        out: list[TransportEvent] = []
        for e in self.inner.poll():
            if isinstance(e, Received):
                n = self.counts[e.peer] = self.counts.get(e.peer, 0) + 1
                if n > 50:
                    out.append(Received(peer=f"{e.peer}~{n // 50}", payload=e.payload))
                    continue
            out.append(e)
        return out


class ReusesIncarnation(Wrapper):
    """Names peers without their incarnation: a restarted peer keeps its old id."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.real: dict[str, str] = {}

    @property
    def local_peer(self) -> PeerId:
        return self.inner.base_name

    def add_peer(self, metadata: bytes) -> PeerId:
        real = self.inner.add_peer(metadata)
        self.real[real.split("#")[0]] = real
        return real.split("#")[0]

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(self.real.get(peer, peer), payload)

    def remove_peer(self, peer: PeerId) -> None:
        self.inner.remove_peer(self.real.get(peer, peer))

    def read_blocks(self, peer: PeerId, **kw: object) -> ReadId:
        return super().read_blocks(self.real.get(peer, peer), **kw)  # type: ignore[arg-type]

    def poll(self) -> Sequence[TransportEvent]:
        out: list[TransportEvent] = []
        for e in self.inner.poll():
            if isinstance(e, Received):
                out.append(Received(peer=e.peer.split("#")[0], payload=e.payload))
            elif isinstance(e, PeerLost):
                out.append(PeerLost(peer=e.peer.split("#")[0], reason=e.reason))
            else:
                out.append(e)
        return out


class CloseTwiceRaises(Wrapper):
    """A second close() raises."""

    def close(self) -> None:
        if not self.inner.alive:
            raise RuntimeError("already closed")
        self.inner.close()


class SendAfterCloseIgnored(Wrapper):
    """send() on a closed endpoint silently does nothing."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        if self.inner.alive:
            self.inner.send(peer, payload)


class PollAfterCloseEmpty(Wrapper):
    """poll() on a closed endpoint returns nothing instead of raising (a SHOULD)."""

    def poll(self) -> Sequence[TransportEvent]:
        return self.inner.poll() if self.inner.alive else []


class UnknownPeerAccepted(Wrapper):
    """send() to a peer never added is silently dropped."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        with contextlib.suppress(UnknownPeer):
            self.inner.send(peer, payload)


class BadMetadataUntyped(Wrapper):
    """Garbage metadata raises ValueError, not BadMetadata (a SHOULD)."""

    def add_peer(self, metadata: bytes) -> PeerId:
        try:
            return self.inner.add_peer(metadata)
        except BadMetadata as exc:
            raise ValueError("cannot parse") from exc


class NulToSpace(Wrapper):
    """Treats payloads as C strings: NUL bytes become spaces (length kept)."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(peer, payload.replace(b"\x00", b" "))


class DropsEmpty(Wrapper):
    """An empty payload is accepted and never sent."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        if payload:
            self.inner.send(peer, payload)


class OffByOneMax(Wrapper):
    """Refuses a payload of exactly the declared maximum."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        if len(payload) >= self.max_size:
            raise FrameTooLarge(f"{len(payload)} bytes")
        self.inner.send(peer, payload)


class FalselyOrdered(Wrapper):
    """Runs on links that reorder, yet declares ordered."""

    LINK = LinkFaults(delay=50e-6, reorder=0.3, reorder_window=1e-3)

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(self.inner.capabilities, ordered=True)


class FalselyNoDuplicates(Wrapper):
    """Declares may_duplicate=False but sends every 10th notification twice."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.sent = 0

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.inner.send(peer, payload)
        self.sent += 1
        if self.sent % 10 == 0:
            self.inner.send(peer, payload)


class Lossy(Wrapper):
    """Silently loses every 100th notification."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.sent = 0

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.sent += 1
        if self.sent % 100:
            self.inner.send(peer, payload)


class BlocksWhenIdle(Wrapper):
    """The 1000th consecutive empty poll blocks (waits for traffic) for 0.6 s."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.idle = 0

    def poll(self) -> Sequence[TransportEvent]:
        got = self.inner.poll()
        self.idle = 0 if got else self.idle + 1
        if self.idle == 1000:
            time.sleep(0.6)
        return got


class MisattributesFanIn(Wrapper):
    """When one poll returns notifications from several senders, swaps two senders' names."""

    def poll(self) -> Sequence[TransportEvent]:
        got = list(self.inner.poll())
        senders = list(dict.fromkeys(e.peer for e in got if isinstance(e, Received)))
        if len(senders) < 2:
            return got
        swap = {senders[0]: senders[1], senders[1]: senders[0]}
        return [
            Received(peer=swap.get(e.peer, e.peer), payload=e.payload)
            if isinstance(e, Received)
            else e
            for e in got
        ]


class BlocksOnBacklog(Wrapper):
    """Blocks 0.3 s in each send once 5000 are made without the sender polling (five of them,
    to keep the test short: a real blocking transport would go on blocking)."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.unpolled = 0

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.unpolled += 1
        if 5000 <= self.unpolled < 5005:
            time.sleep(0.3)
        self.inner.send(peer, payload)

    def poll(self) -> Sequence[TransportEvent]:
        self.unpolled = 0
        return self.inner.poll()


class DoubleCompletion(Wrapper):
    """Reports every ReadCompleted twice."""

    def poll(self) -> Sequence[TransportEvent]:
        out: list[TransportEvent] = []
        for e in self.inner.poll():
            out += [e, e] if isinstance(e, ReadCompleted) else [e]
        return out


class IgnoresRemoteSlice(Wrapper):
    """Reads the mirror-image slice of each remote block."""

    def read_blocks(
        self, peer: PeerId, *, remote_slice: BlockSlice = BlockSlice.FULL, **kw: object
    ) -> ReadId:
        flipped = BlockSlice(
            index=remote_slice.parts - 1 - remote_slice.index, parts=remote_slice.parts
        )
        return super().read_blocks(peer, remote_slice=flipped, **kw)  # type: ignore[arg-type]


class ClampsRange(Wrapper):
    """Clamps remote block ids past the holder's layout to its last block."""

    def read_blocks(self, peer: PeerId, *, remote_blocks: Sequence[int], **kw: object) -> ReadId:
        holder = self.group.net.current(peer)
        layout = holder.layout if holder is not None else None
        if layout is not None:
            remote_blocks = [min(b, layout.num_blocks - 1) for b in remote_blocks]
        return super().read_blocks(peer, remote_blocks=remote_blocks, **kw)  # type: ignore[arg-type]


class FakesUnregistered(Wrapper):
    """A read from a peer with no registered memory 'completes' (reading nothing)."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.fake: list[TransportEvent] = []

    def read_blocks(self, peer: PeerId, **kw: object) -> ReadId:
        holder = self.group.net.current(peer)
        if self.inner.alive and holder is not None and holder.alive and holder.layout is None:
            rid = 10_000 + len(self.fake)
            self.fake.append(ReadCompleted(read_id=rid))
            return rid
        return super().read_blocks(peer, **kw)  # type: ignore[arg-type]

    def poll(self) -> Sequence[TransportEvent]:
        got = [*self.inner.poll(), *self.fake]
        self.fake = []
        return got


class ZeroBlockHangs(Wrapper):
    """A read of no blocks never completes and its notify is never sent."""

    def read_blocks(self, peer: PeerId, *, local_blocks: Sequence[int], **kw: object) -> ReadId:
        if not local_blocks:
            return 99_999
        return super().read_blocks(peer, local_blocks=local_blocks, **kw)  # type: ignore[arg-type]


class OptimisticBound(Wrapper):
    """Declares a 0.1 s failure-detection bound; it really takes 0.5 s."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(self.inner.capabilities, failure_detection_bound_s=0.1)


class UntypedDeadSend(Wrapper):
    """Sending to a peer known dead raises RuntimeError instead of a TransportError."""

    def send(self, peer: PeerId, payload: bytes) -> None:
        try:
            self.inner.send(peer, payload)
        except PeerUnreachable as exc:
            raise RuntimeError("connection reset") from exc


class MasksDeadPeerReads(Wrapper):
    """A read that failed because the holder died is reported completed."""

    def poll(self) -> Sequence[TransportEvent]:
        return [
            ReadCompleted(read_id=e.read_id)
            if isinstance(e, ReadFailed) and "dead" in e.reason
            else e
            for e in self.inner.poll()
        ]


class OverReportsLoss(Wrapper):
    """When one peer is lost, reports every peer lost."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.peers: list[PeerId] = []

    def add_peer(self, metadata: bytes) -> PeerId:
        pid = self.inner.add_peer(metadata)
        self.peers.append(pid)
        return pid

    def poll(self) -> Sequence[TransportEvent]:
        got = list(self.inner.poll())
        if any(isinstance(e, PeerLost) for e in got):
            got += [PeerLost(peer=p, reason="everyone") for p in self.peers]
        return got


class Leaky(Wrapper):
    """Keeps every payload it ever sent."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.kept: list[bytes] = []

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.kept.append(bytes(payload))
        self.inner.send(peer, payload)


# --- broken writers (push mode, T6): each breaks one promise of write_blocks ----------


class WriteWrapper(Wrapper, ForwardingWrites[LoopbackTransport]):
    """A :class:`Wrapper` that also writes; subclasses break one promise of ``write_blocks``."""


class WriteNotifyBeforeData(WriteWrapper):
    """The write's notify goes out when the write is issued, not once its data landed."""

    def write_blocks(self, peer: PeerId, *, notify: bytes | None = None, **kw: object) -> WriteId:
        wid = super().write_blocks(peer, notify=None, **kw)  # type: ignore[arg-type]
        if notify is not None:
            self.inner.send(peer, notify)
        return wid


class WriteCompletesEarly(WriteWrapper):
    """Reports WriteCompleted as soon as the write is issued (a local completion)."""

    def __init__(self, inner: LoopbackTransport, group: BrokenGroup) -> None:
        super().__init__(inner, group)
        self.early: list[WriteId] = []
        self.done: set[WriteId] = set()

    def write_blocks(self, peer: PeerId, **kw: object) -> WriteId:
        wid = super().write_blocks(peer, **kw)  # type: ignore[arg-type]
        self.early.append(wid)
        return wid

    def poll(self) -> Sequence[TransportEvent]:
        out: list[TransportEvent] = [WriteCompleted(write_id=w) for w in self.early]
        reported = set(self.early)
        self.early.clear()
        for e in self.inner.poll():
            if isinstance(e, WriteCompleted | WriteFailed) and e.write_id in self.done:
                continue  # the real outcome of a write already reported complete
            out.append(e)
        self.done |= reported
        return out


class WriteDoubleCompletion(WriteWrapper):
    """Reports every WriteCompleted twice."""

    def poll(self) -> Sequence[TransportEvent]:
        out: list[TransportEvent] = []
        for e in self.inner.poll():
            out += [e, e] if isinstance(e, WriteCompleted) else [e]
        return out


class WriteClampsRange(WriteWrapper):
    """Clamps holder block ids past its layout to its last block."""

    def write_blocks(self, peer: PeerId, *, remote_blocks: Sequence[int], **kw: object) -> WriteId:
        holder = self.group.net.current(peer)
        layout = holder.layout if holder is not None else None
        if layout is not None:
            remote_blocks = [min(b, layout.num_blocks - 1) for b in remote_blocks]
        return super().write_blocks(peer, remote_blocks=remote_blocks, **kw)  # type: ignore[arg-type]


class WriteIgnoresRemoteSlice(WriteWrapper):
    """Writes into the mirror-image slice of each holder block."""

    def write_blocks(
        self, peer: PeerId, *, remote_slice: BlockSlice = BlockSlice.FULL, **kw: object
    ) -> WriteId:
        flipped = BlockSlice(
            index=remote_slice.parts - 1 - remote_slice.index, parts=remote_slice.parts
        )
        return super().write_blocks(peer, remote_slice=flipped, **kw)  # type: ignore[arg-type]


class WriteMasksDeadPeer(WriteWrapper):
    """A write that failed because the holder died is reported completed."""

    def poll(self) -> Sequence[TransportEvent]:
        return [
            WriteCompleted(write_id=e.write_id)
            if isinstance(e, WriteFailed) and "dead" in e.reason
            else e
            for e in self.inner.poll()
        ]


class BrokenGroup(LoopbackGroup):
    """A loopback group whose endpoints are wrapped in one flaw."""

    def __init__(self, size: int, flaw: type[Wrapper]) -> None:
        super().__init__(size, default_link=flaw.LINK)
        self.flaw = flaw
        self.wrapped: list[Wrapper] = [flaw(ep, self) for ep in self.loopback_endpoints]

    @property
    def endpoints(self) -> Sequence[Transport]:
        return self.wrapped

    def restart(self, index: int) -> Transport:
        inner = super().restart(index)
        assert isinstance(inner, LoopbackTransport)
        self.wrapped[index] = self.flaw(inner, self)
        return self.wrapped[index]


def broken_factory(flaw: type[Wrapper]) -> TransportFactory:
    # Fewer resource cycles keep 30 full runs fast; the leak rate is per cycle, so the
    # leaking transport is still caught, and the healthy ones stay far below the bound.
    return TransportFactory(
        name=f"broken-{flaw.__name__}",
        create_group=lambda n: BrokenGroup(n, flaw),
        resource_cycles=4000,
    )


# flaw -> the cases that must FAIL (and nothing else may)
EXPECTED: dict[type[Wrapper], set[str]] = {
    Truncates: {"T2.4", "T2.5"},
    DropsOversize: {"T2.4"},
    NotifyBeforeData: {"T3.2"},
    NoDetectionBound: {"T0.1"},
    AliasIds: {"T1.1", "T1.3"},
    UnstableIds: {"T1.2", "T2.10"},
    ReusesIncarnation: {"T1.3"},
    CloseTwiceRaises: {"T1.4"},
    SendAfterCloseIgnored: {"T1.5"},
    UnknownPeerAccepted: {"T1.7"},
    NulToSpace: {"T2.1", "T2.3"},
    DropsEmpty: {"T2.2"},
    OffByOneMax: {"T2.3"},
    FalselyOrdered: {"T2.6", "T2.10"},
    FalselyNoDuplicates: {"T2.7", "T2.10"},
    Lossy: {"T2.8", "T2.10", "T2.11"},
    BlocksWhenIdle: {"T2.9"},
    MisattributesFanIn: {"T2.10"},
    BlocksOnBacklog: {"T2.11"},
    DoubleCompletion: {"T3.1", "T3.6"},
    IgnoresRemoteSlice: {"T3.3"},
    ClampsRange: {"T3.4"},
    FakesUnregistered: {"T3.5"},
    ZeroBlockHangs: {"T3.6"},
    OptimisticBound: {"T4.1"},
    UntypedDeadSend: {"T4.2"},
    MasksDeadPeerReads: {"T4.3", "T4.4"},
    OverReportsLoss: {"T4.4"},
    Leaky: {"T5.1"},
    WriteNotifyBeforeData: {"T6.2"},
    # Reported done at issue: every case that judges a completion against the data sees it
    # before the data (or for a write that failed: out of range, dead holder).
    WriteCompletesEarly: {"T6.3", "T6.4", "T6.5", "T6.6"},
    WriteDoubleCompletion: {"T6.1", "T6.2", "T6.3", "T6.5", "T6.7"},
    WriteClampsRange: {"T6.4"},
    WriteIgnoresRemoteSlice: {"T6.5"},
    WriteMasksDeadPeer: {"T6.6"},
}

# flaw -> the SHOULD cases it breaks (NON-STRICT normally, FAIL with --strict)
EXPECTED_SHOULD: dict[type[Wrapper], set[str]] = {
    PollAfterCloseEmpty: {"T1.6"},
    BadMetadataUntyped: {"T1.8"},
}


@pytest.mark.parametrize("flaw", list(EXPECTED), ids=lambda f: f.__name__)
def test_broken_transport_fails_exactly_the_cases_that_catch_it(flaw: type[Wrapper]) -> None:
    report = run_conformance(broken_factory(flaw))
    failed = set(report.by_verdict(Verdict.FAIL))
    details = {c: report.case(c).detail for c in failed ^ EXPECTED[flaw]}
    assert failed == EXPECTED[flaw], details
    assert report.by_verdict(Verdict.NON_STRICT) == []
    assert report.failed


@pytest.mark.parametrize("flaw", list(EXPECTED_SHOULD), ids=lambda f: f.__name__)
def test_should_violations_are_non_strict_unless_strict(flaw: type[Wrapper]) -> None:
    lenient = run_conformance(broken_factory(flaw), only=["T1"])
    assert set(lenient.by_verdict(Verdict.NON_STRICT)) == EXPECTED_SHOULD[flaw]
    assert not lenient.failed
    strict = run_conformance(broken_factory(flaw), strict=True, only=["T1"])
    assert set(strict.by_verdict(Verdict.FAIL)) == EXPECTED_SHOULD[flaw]
    assert strict.failed


def test_every_must_case_is_failed_by_some_broken_transport() -> None:
    must = {c.id for c in all_cases() if c.level is Level.MUST}
    caught = set().union(*EXPECTED.values())
    assert must - caught == set()
    assert caught <= must
    should = {c.id for c in all_cases() if c.level is Level.SHOULD}
    assert set().union(*EXPECTED_SHOULD.values()) == should


def test_a_transport_that_raises_inside_a_case_fails_that_case_with_the_reason() -> None:
    class Explodes(Wrapper):
        def metadata(self) -> bytes:
            raise KeyError("boom")

    report = run_conformance(broken_factory(Explodes), only=["T1.1"])
    assert report.by_verdict(Verdict.FAIL) == ["T1.1"]
    assert "KeyError" in report.case("T1.1").detail


def test_truncation_is_named_in_the_detail() -> None:
    report = run_conformance(broken_factory(Truncates), only=["T2.4", "T2.5"])
    assert "accepted without FrameTooLarge" in report.case("T2.4").detail
    assert "delivered altered" in report.case("T2.5").detail
    dropped = run_conformance(broken_factory(DropsOversize), only=["T2.4"])
    assert "silently dropped" in dropped.case("T2.4").detail
