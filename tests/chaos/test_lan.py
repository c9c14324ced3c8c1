"""The chaos run's hosts: two switched networks, faults on the KV fabric only, all torn down."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from kvproto_tools.chaos.lan import Lan
from kvproto_tools.netns import socket_in, unavailable_reason

REASON = unavailable_reason()


@pytest.fixture
def lan() -> Iterator[Lan]:
    if REASON is not None:
        if os.environ.get("KVPROTO_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVPROTO_REQUIRE_NETNS=1 but network namespaces: {REASON}")
        pytest.skip(f"network namespaces: {REASON}")
    made = Lan(["p0", "p1", "d0"])
    try:
        yield made
    finally:
        made.close()


def _arrived(lan: Lan, src: str, dst: str, count: int, *, fabric: bool = True) -> int:
    """UDP datagrams sent from host ``src`` to host ``dst`` that arrived (fabric or front)."""
    to = lan.back_of(dst) if fabric else lan.hosts[dst].front
    rx = socket_in(lan.hosts[dst].netns, socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket_in(lan.hosts[src].netns, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind((to, 0))
        rx.settimeout(0.05)
        got = 0
        for i in range(count):
            try:
                tx.sendto(i.to_bytes(4, "big"), rx.getsockname())
                rx.recvfrom(64)
                got += 1
            except OSError:  # lost (timeout), or the link is down (unreachable)
                continue
        return got
    finally:
        rx.close()
        tx.close()


def test_faults_hit_the_fabric_pair_only_and_heal(lan: Lan) -> None:
    assert _arrived(lan, "p0", "d0", 50) == 50
    lan.partition("p0", "d0")
    assert _arrived(lan, "p0", "d0", 5) == 0 and _arrived(lan, "d0", "p0", 5) == 0
    assert _arrived(lan, "p1", "d0", 20) == 20  # the other prefill host still reaches D
    assert _arrived(lan, "hub", "d0", 20, fabric=False) == 20  # and the front network works
    assert lan.faulty
    lan.heal()
    assert not lan.faulty and _arrived(lan, "p0", "d0", 50) == 50
    lan.loss("p1", "d0", 0.3)
    got = _arrived(lan, "p1", "d0", 400)
    # Binomial(400, 0.7): mean 280, sd 9.2; six sd either side.
    assert 225 <= got <= 335, got
    lan.heal()
    lan.link_down("d0")
    assert _arrived(lan, "p0", "d0", 5) == 0
    assert _arrived(lan, "hub", "d0", 20, fabric=False) == 20
    lan.heal()
    assert _arrived(lan, "p0", "d0", 50) == 50


def test_close_deletes_every_namespace() -> None:
    if REASON is not None:
        pytest.skip(f"network namespaces: {REASON}")
    made = Lan(["p0", "d0"])
    names = [h.netns for h in made.hosts.values()] + [made.switch]
    made.close()
    made.close()  # idempotent
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not any(n in listed.stdout for n in names)
