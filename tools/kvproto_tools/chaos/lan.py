"""Engine hosts in network namespaces on two switched networks, and their faults.

Each host is a namespace with two interfaces, as in a deployment whose KV
fabric is a network of its own: ``front`` (HTTP: the router, clients and
/metrics reach every engine there) and ``back`` (the KV fabric: NIXL over
UCX's TCP transport and the lease side channel). A switch namespace holds one
Linux bridge per network and a veth port per host on each. The router and the
clients live on a host without a ``back`` interface (the hub).

Faults touch the KV fabric only, so what they break is what kvproto handles
(leases, reads, the side channel), while clients and the metrics scraper keep
seeing every engine:

* ``partition(a, b)``: iptables DROP, in both hosts, of every packet arriving
  on ``back`` from the other (TCP retransmits, nobody is told);
* ``loss(a, b, p)``: the same with ``-m statistic --probability p`` (per direction);
* ``link_down(h)`` / ``link_up(h)``: ``ip link set down`` of ``h``'s ``back``
  interface (its peers' packets to it are lost, its own sends fail);
* ``heal()``: removes every rule and brings every link up.

Every namespace is named ``<PREFIX>-<pid>-c<n>-<host>``
(:func:`kvproto_tools.netns.remove_stale` deletes those of a dead run);
:meth:`Lan.close` deletes them all (interfaces, bridges and rules go with them).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvproto_tools.netns import PREFIX, NetnsUnavailable, answers, netns_names, run_tool

FRONT, BACK = "front", "back"
"""Interface names in every host (and the bridges' names in the switch)."""
CHAIN = "KVCHAOS"
"""The iptables chain in every host that holds the fault rules (jumped to from INPUT)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """One host of the network."""

    name: str
    """Short name ("p0", "d0", "hub")."""
    netns: str
    """Its namespace."""
    front: str
    """Address on the front network (HTTP)."""
    back: str | None
    """Address on the KV fabric (None: the hub has none)."""

    @property
    def wrap(self) -> list[str]:
        """The command prefix that runs a program in this host (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns]


class Lan:
    """Hosts on a front network and a KV fabric; see the module doc. Always :meth:`close`."""

    _count = 0

    def __init__(self, fabric_hosts: Sequence[str], hub: str = "hub") -> None:
        Lan._count += 1
        n = Lan._count
        tag = f"{PREFIX}-{os.getpid()}-c{n}"
        subnet = n % 250 + 1
        self.switch = f"{tag}-sw"
        """Namespace of the two bridges."""
        self.hosts: dict[str, Host] = {}
        """Every host by name."""
        for k, name in enumerate([hub, *fabric_hosts]):
            self.hosts[name] = Host(
                name=name,
                netns=f"{tag}-{name}",
                front=f"10.214.{subnet}.{k + 1}",
                back=None if name == hub else f"10.215.{subnet}.{k + 1}",
            )
        self.hub = self.hosts[hub]
        """The host of the router and the clients."""
        self._rules: dict[str, list[list[str]]] = {name: [] for name in self.hosts}
        self._down: set[str] = set()
        try:
            self._build()
            self.wait_reachable(timeout_s=10.0)
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        for ns in [sw, *(h.netns for h in self.hosts.values())]:
            run_tool("ip", "netns", "add", ns)
            run_tool("ip", "-n", ns, "link", "set", "lo", "up")
        for bridge in (FRONT, BACK):
            run_tool("ip", "-n", sw, "link", "add", bridge, "type", "bridge", "forward_delay", "0")
            run_tool("ip", "-n", sw, "link", "set", bridge, "up")
        for h in self.hosts.values():
            for net, addr in ((FRONT, h.front), (BACK, h.back)):
                if addr is None:
                    continue
                port = f"{h.name}-{net[0]}"
                run_tool(
                    "ip", "link", "add", net, "netns", h.netns,
                    "type", "veth", "peer", "name", port, "netns", sw,
                )  # fmt: skip
                run_tool("ip", "-n", sw, "link", "set", port, "master", net, "up")
                run_tool("ip", "-n", h.netns, "addr", "add", f"{addr}/24", "dev", net)
                run_tool("ip", "-n", h.netns, "link", "set", net, "up")
            self._ipt(h.name, "-N", CHAIN)
            self._ipt(h.name, "-I", "INPUT", "-j", CHAIN)

    def _ipt(self, host: str, *args: str) -> None:
        run_tool("ip", "netns", "exec", self.hosts[host].netns, "iptables", "-w", *args)

    def back_of(self, host: str) -> str:
        """``host``'s KV fabric address."""
        addr = self.hosts[host].back
        if addr is None:
            raise ValueError(f"{host} is not on the KV fabric")
        return addr

    # ------------------------------------------------------------------ faults

    def _drop_between(self, a: str, b: str, match: list[str]) -> None:
        for here, there in ((a, b), (b, a)):
            rule = ["-i", BACK, "-s", self.back_of(there), *match, "-j", "DROP"]
            self._ipt(here, "-A", CHAIN, *rule)
            self._rules[here].append(rule)

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b`` on the KV fabric, both ways."""
        self._drop_between(a, b, [])

    def loss(self, a: str, b: str, fraction: float) -> None:
        """Drop each packet between ``a`` and ``b`` with probability ``fraction``, each way."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"loss fraction {fraction} not in (0, 1)")
        statistic = ["-m", "statistic", "--mode", "random", "--probability", f"{fraction:.4f}"]
        self._drop_between(a, b, statistic)

    def link_down(self, host: str) -> None:
        """``ip link set down`` of ``host``'s KV fabric interface."""
        self.back_of(host)
        run_tool("ip", "-n", self.hosts[host].netns, "link", "set", BACK, "down")
        self._down.add(host)

    def link_up(self, host: str) -> None:
        """Bring ``host``'s KV fabric interface back up."""
        run_tool("ip", "-n", self.hosts[host].netns, "link", "set", BACK, "up")
        self._down.discard(host)

    def heal(self) -> None:
        """Remove every fault rule and bring every KV fabric interface up."""
        for host, rules in self._rules.items():
            for rule in rules:
                self._ipt(host, "-D", CHAIN, *rule)
            rules.clear()
        for host in sorted(self._down):
            self.link_up(host)

    @property
    def faulty(self) -> bool:
        """Whether any fault is applied now."""
        return bool(self._down) or any(self._rules.values())

    # ------------------------------------------------------------------ checks, end

    def wait_reachable(self, timeout_s: float) -> float:
        """Bounded wait until every host answers a TCP connect from the hub (front) and
        every fabric host from the first one (back); seconds it took."""
        start = time.monotonic()
        fabric = [h for h in self.hosts.values() if h.back is not None]
        pairs = [(self.hub.netns, h.front) for h in self.hosts.values() if h is not self.hub]
        pairs += [(fabric[0].netns, h.back) for h in fabric[1:] if h.back is not None]
        for netns, addr in pairs:
            while not answers(netns, addr):
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"{addr} not reachable from {netns}")
                time.sleep(0.05)
        return time.monotonic() - start

    def close(self) -> None:
        """Delete every namespace of this network (idempotent, never raises)."""
        existing: set[str] = set()
        with contextlib.suppress(NetnsUnavailable):
            existing = set(netns_names())
        for ns in [*(h.netns for h in self.hosts.values()), self.switch]:
            if ns in existing:
                with contextlib.suppress(NetnsUnavailable):
                    run_tool("ip", "netns", "del", ns)

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
