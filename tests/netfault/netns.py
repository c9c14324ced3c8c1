"""Test hosts in network namespaces, joined by a veth link whose faults a test controls.

A :class:`Link` makes two namespaces (``p`` and ``d``, one per host) and one
veth pair between them, with addresses that exist only inside those
namespaces. Its :class:`Faults` change the link for real, in the kernel:

* ``partition()`` / ``heal()``: iptables DROP of everything arriving on the
  veth, in both namespaces (packets leave and are lost on the "wire"; the
  senders see no error, exactly as across a dead switch);
* ``loss(p)``: iptables ``statistic --mode random`` DROP of a fraction ``p``
  of the packets arriving in each namespace (so ``p`` per direction);
* ``stall_bulk(n)``: iptables DROP of the packets of ``n`` bytes or more arriving at D (P's
  bulk data stalls on the wire, TCP retransmits it once healed; small packets pass);
* ``link_down()`` / ``link_up()``: ``ip link set down`` on the D end (the P end
  loses carrier);
* ``delay(ms, jitter_ms)``: only on a :class:`Link` made with ``delayer=True``:
  the two hosts then sit on two veth pairs joined by a third namespace, in
  which a userspace bridge (:func:`_bridge_main`, raw ``AF_PACKET`` sockets)
  forwards every frame after ``ms ± jitter_ms``; frames with different delays
  leave in order of their due time, so jitter reorders them. This kernel has
  no ``netem`` qdisc; the bridge is the delayer, and its delay is measured by
  the tests, not assumed.

Processes run inside a namespace by entering it (``setns``, and a private
/sys as ``ip netns exec`` mounts one) first thing in a spawned child
(:func:`kvproto_tools.netns.spawn_in`); a socket made by
:func:`kvproto_tools.netns.socket_in` belongs to the namespace it was made in,
whichever thread uses it later. Those primitives live in
:mod:`kvproto_tools.netns`, shared with ``kvproto chaos``.

Every namespace and interface carries :data:`~kvproto_tools.netns.PREFIX` and a
per-run id, and :func:`~kvproto_tools.netns.remove_stale` deletes those of a run
that crashed. Nothing here reaches outside the namespaces it created.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import multiprocessing
import os
import random
import select
import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from kvproto_tools.netns import (
    PREFIX,
    NetnsUnavailable,
    answers,
    netns_names,
    run_tool,
    spawn_in,
)

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4


class Faults:
    """The link's faults, applied inside the two namespaces (kernel iptables and links)."""

    CHAIN = "KVNF"

    def __init__(self, link: Link) -> None:
        self._link = link
        self.state = "healthy"
        """What is applied now: ``healthy``, ``partition``, ``loss <p>``, ``stall-bulk <n>``
        or ``down``."""
        for host in (link.p, link.d):
            self._ipt(host, "-N", self.CHAIN)
            self._ipt(host, "-I", "INPUT", "-i", link.ifname[host], "-j", self.CHAIN)

    def _ipt(self, host: str, *args: str) -> None:
        run_tool("ip", "netns", "exec", host, "iptables", "-w", *args)

    def _flush(self) -> None:
        for host in (self._link.p, self._link.d):
            self._ipt(host, "-F", self.CHAIN)

    def partition(self) -> None:
        """Drop every packet arriving at either host over the link."""
        self._flush()
        for host in (self._link.p, self._link.d):
            self._ipt(host, "-A", self.CHAIN, "-j", "DROP")
        self.state = "partition"

    def loss(self, fraction: float) -> None:
        """Drop each packet arriving at either host with probability ``fraction``."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"loss fraction {fraction} not in (0, 1)")
        self._flush()
        for host in (self._link.p, self._link.d):
            self._ipt(
                host,
                "-A",
                self.CHAIN,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                f"{fraction:.4f}",
                "-j",
                "DROP",
            )
        self.state = f"loss {fraction:g}"

    def stall_bulk(self, min_bytes: int = 1000) -> None:
        """Drop every packet of ``min_bytes`` or more arriving at D: P's bulk data (a WRITE
        into D's blocks) stops on the wire while small packets (acks, D's own frames to P,
        side-channel messages) still pass. TCP delivers in order, so what P sends after the
        bulk on the same connection waits behind it; :meth:`heal` lets TCP's retransmission
        land it late."""
        self._flush()
        self._ipt(
            self._link.d, "-A", self.CHAIN, "-m", "length", "--length", f"{min_bytes}:65535",
            "-j", "DROP",
        )  # fmt: skip
        self.state = f"stall-bulk {min_bytes}"

    def link_down(self) -> None:
        """``ip link set down`` the D end of the link (the P end loses carrier)."""
        run_tool("ip", "-n", self._link.d, "link", "set", self._link.ifname[self._link.d], "down")
        self.state = "down"

    def link_up(self) -> None:
        """Bring the D end back up and wait (bounded) until P answers over it again."""
        run_tool("ip", "-n", self._link.d, "link", "set", self._link.ifname[self._link.d], "up")
        self.state = "healthy"
        self._link.wait_reachable(timeout_s=5.0)

    def heal(self) -> None:
        """Remove every iptables fault (and bring a downed link up)."""
        self._flush()
        if self.state == "down":
            self.link_up()
        self.state = "healthy"

    def delay(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Forward every frame after ``ms ± jitter_ms`` (needs ``Link(delayer=True)``)."""
        self._link.set_delay(ms, jitter_ms)


class Link:
    """Two hosts (namespaces ``p`` and ``d``) and a link between them; see the module doc.

    Use as a context manager (or call :meth:`close`): teardown deletes the
    namespaces (and so every interface and rule in them) and ends the delayer,
    whatever happened in between.
    """

    SUBNET = "10.213.{n}."

    _count = 0

    def __init__(self, *, delayer: bool = False) -> None:
        Link._count += 1
        n = Link._count
        tag = f"{os.getpid()}-{n}"
        self.p = f"{PREFIX}-{tag}-p"
        """Namespace of the holder host."""
        self.d = f"{PREFIX}-{tag}-d"
        """Namespace of the reader host."""
        self.r = f"{PREFIX}-{tag}-r" if delayer else ""
        """Namespace of the delaying bridge ('' without one)."""
        net = self.SUBNET.format(n=n % 250 + 1)
        self.addr = {self.p: net + "1", self.d: net + "2"}
        """Address of each host on the link."""
        short = f"{os.getpid() % 100000}{n}"
        self.ifname = {self.p: f"kvp{short}", self.d: f"kvd{short}"}
        """Name of each host's link interface (in its own namespace)."""
        self._bridge: multiprocessing.process.BaseProcess | None = None
        self._bridge_conn: Connection | None = None
        self.faults: Faults
        try:
            self._build(delayer, short)
            self.faults = Faults(self)
            self.wait_reachable(timeout_s=5.0)
        except BaseException:
            self.close()
            raise

    def _build(self, delayer: bool, short: str) -> None:
        hosts = [self.p, self.d] + ([self.r] if delayer else [])
        for ns in hosts:
            run_tool("ip", "netns", "add", ns)
            run_tool("ip", "-n", ns, "link", "set", "lo", "up")
        if not delayer:
            run_tool(
                "ip", "link", "add", self.ifname[self.p], "netns", self.p,
                "type", "veth", "peer", "name", self.ifname[self.d], "netns", self.d,
            )  # fmt: skip
        else:
            self.bridge_ifs = (f"kvrp{short}", f"kvrd{short}")
            for host, bif in zip((self.p, self.d), self.bridge_ifs, strict=True):
                run_tool(
                    "ip", "link", "add", self.ifname[host], "netns", host,
                    "type", "veth", "peer", "name", bif, "netns", self.r,
                )  # fmt: skip
                run_tool("ip", "-n", self.r, "link", "set", bif, "up")
                # Offloads would hand the raw socket 64 KiB super-frames it cannot resend,
                # and frames whose checksum the receiving host would still have to fill in.
                for off in ("tx", "rx", "tso", "gso", "gro"):
                    with contextlib.suppress(NetnsUnavailable):
                        run_tool("ip", "netns", "exec", self.r, "ethtool", "-K", bif, off, "off")
        for host in (self.p, self.d):
            ifn = self.ifname[host]
            run_tool("ip", "-n", host, "addr", "add", f"{self.addr[host]}/24", "dev", ifn)
            run_tool("ip", "-n", host, "link", "set", ifn, "up")
            if delayer:  # the same reason: frames must fit the bridge's MTU
                for off in ("tx", "rx", "tso", "gso", "gro"):
                    with contextlib.suppress(NetnsUnavailable):
                        run_tool("ip", "netns", "exec", host, "ethtool", "-K", ifn, off, "off")
        if delayer:
            parent, child = multiprocessing.get_context("spawn").Pipe()
            self._bridge = spawn_in(
                self.r, _bridge_main, (child, *self.bridge_ifs), name="kvnf-bridge"
            )
            child.close()
            self._bridge_conn = parent
            if not parent.poll(30.0) or parent.recv() != "ready":
                raise NetnsUnavailable("the delaying bridge did not start")

    def set_delay(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Tell the bridge to hold each frame ``ms ± jitter_ms`` (uniform) before forwarding."""
        if self._bridge_conn is None:
            raise NetnsUnavailable("this link has no delayer (Link(delayer=True))")
        self._bridge_conn.send(("delay", ms / 1e3, jitter_ms / 1e3))
        if not self._bridge_conn.poll(5.0):
            raise TimeoutError("the bridge did not confirm the delay")
        self._bridge_conn.recv()

    def bridge_stats(self) -> dict[str, int]:
        """Frames the bridge forwarded and the reorderings it made (``{}`` without one)."""
        if self._bridge_conn is None:
            return {}
        self._bridge_conn.send(("stats",))
        if not self._bridge_conn.poll(5.0):
            raise TimeoutError("the bridge did not answer")
        stats: dict[str, int] = self._bridge_conn.recv()
        return stats

    def rx_bytes(self, host: str) -> int:
        """Bytes ``host``'s link interface has received."""
        out = run_tool("ip", "-j", "-s", "-n", host, "link", "show", "dev", self.ifname[host])
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def wait_reachable(self, timeout_s: float) -> float:
        """Bounded wait until a TCP connect from D to P gets an answer; returns seconds."""
        start = time.monotonic()
        while not answers(self.d, self.addr[self.p]):
            if time.monotonic() - start >= timeout_s:
                raise TimeoutError(f"{self.p} not reachable from {self.d}")
            time.sleep(0.05)
        return time.monotonic() - start

    def close(self) -> None:
        """End the delayer and delete the namespaces (idempotent, never raises)."""
        if self._bridge is not None:
            with contextlib.suppress(OSError, EOFError):
                assert self._bridge_conn is not None
                self._bridge_conn.send(("exit",))
            self._bridge.join(3)
            if self._bridge.is_alive():
                self._bridge.kill()
                self._bridge.join(3)
            self._bridge = None
        if self._bridge_conn is not None:
            self._bridge_conn.close()
            self._bridge_conn = None
        existing = set()
        with contextlib.suppress(NetnsUnavailable):
            existing = set(netns_names())
        for ns in (self.p, self.d, self.r):
            if ns and ns in existing:
                with contextlib.suppress(NetnsUnavailable):
                    run_tool("ip", "netns", "del", ns)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def link(*, delayer: bool = False) -> Iterator[Link]:
    """A :class:`Link`, always torn down."""
    made = Link(delayer=delayer)
    try:
        yield made
    finally:
        made.close()


def _raw_socket(ifname: str) -> socket.socket:
    """A non-blocking packet socket that sees and sends every frame of ``ifname``."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    s.bind((ifname, 0))
    s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return s


def _bridge_main(conn: Connection, if_a: str, if_b: str) -> None:
    """The delayer: forward frames between ``if_a`` and ``if_b``, each after its own delay.

    Runs in the bridge namespace. Every frame gets ``delay ± jitter``
    (uniform) and leaves when due: two frames whose delays differ by more than
    their spacing swap order. Bounded: it exits on ``exit`` or when its parent
    goes away (the pipe closes).
    """
    socks = {ifn: _raw_socket(ifn) for ifn in (if_a, if_b)}
    other = {socks[if_a]: socks[if_b], socks[if_b]: socks[if_a]}
    delay, jitter = 0.0, 0.0
    rng = random.Random(0x6B76)
    heap: list[tuple[float, int, socket.socket, bytes]] = []
    seq = 0
    stats = {"forwarded": 0, "reordered": 0, "send_errors": 0}
    last_sent_seq: dict[socket.socket, int] = {}
    conn.send("ready")
    while True:
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _due, n, out, frame = heapq.heappop(heap)
            try:
                out.send(frame)
                stats["forwarded"] += 1
            except OSError:
                stats["send_errors"] += 1
            if n < last_sent_seq.get(out, -1):
                stats["reordered"] += 1
            last_sent_seq[out] = max(n, last_sent_seq.get(out, -1))
        timeout = 0.05 if not heap else max(0.0, min(0.05, heap[0][0] - time.monotonic()))
        waitables: list[Any] = [*socks.values(), conn]
        ready, _, _ = select.select(waitables, [], [], timeout)
        for r in ready:
            if r is conn:
                try:
                    msg = conn.recv()
                except EOFError:
                    return
                if msg[0] == "exit":
                    return
                if msg[0] == "delay":
                    delay, jitter = float(msg[1]), float(msg[2])
                    conn.send("ok")
                elif msg[0] == "stats":
                    conn.send(dict(stats))
                continue
            assert isinstance(r, socket.socket)
            for _ in range(256):  # drain, bounded
                try:
                    frame, addr = r.recvfrom(65535)
                except BlockingIOError:
                    break
                if addr[2] == _PACKET_OUTGOING:
                    continue  # our own send, seen on the way out
                seq += 1
                hold = max(0.0, delay + rng.uniform(-jitter, jitter)) if delay or jitter else 0.0
                heapq.heappush(heap, (time.monotonic() + hold, seq, other[r], frame))
