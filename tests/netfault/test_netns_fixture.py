"""The fault fixture itself: each fault is real (measured on the link), teardown leaves nothing."""

from __future__ import annotations

import itertools
import socket
import subprocess
import time

import pytest

from kvproto_tools import netns
from kvproto_tools.netns import socket_in

from .netns import Link

pytestmark = pytest.mark.usefixtures("netns_ok")


def _datagrams(link: Link, count: int, wait_s: float = 0.3) -> tuple[int, float]:
    """Send ``count`` UDP datagrams D -> P; (how many arrived, median one-way seconds)."""
    rx = socket_in(link.p, socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket_in(link.d, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind((link.addr[link.p], 0))
        tx.bind((link.addr[link.d], 0))
        rx.settimeout(wait_s)
        got, delays = 0, []
        for i in range(count):
            sent = time.monotonic()
            try:
                tx.sendto(i.to_bytes(4, "big"), rx.getsockname())
            except OSError:  # the link is down: nothing leaves
                continue
            try:
                rx.recvfrom(64)
            except TimeoutError:
                continue
            got += 1
            delays.append(time.monotonic() - sent)
        return got, sorted(delays)[len(delays) // 2] if delays else float("nan")
    finally:
        rx.close()
        tx.close()


def test_partition_loss_and_link_down_are_real(link: Link) -> None:
    assert _datagrams(link, 200)[0] == 200
    link.faults.partition()
    assert _datagrams(link, 5, wait_s=0.1)[0] == 0
    link.faults.heal()
    assert _datagrams(link, 50)[0] == 50
    link.faults.loss(0.2)
    got, _ = _datagrams(link, 1000, wait_s=0.05)
    # Binomial(1000, 0.8): mean 800, sd 12.6; six sd either side.
    assert 724 <= got <= 876, got
    link.faults.heal()
    link.faults.link_down()
    assert _datagrams(link, 5, wait_s=0.1)[0] == 0
    link.faults.link_up()
    assert _datagrams(link, 50)[0] == 50
    print(f"\nnetns fixture: 20 % loss asked, {100 - got / 10:.1f} % measured over 1000 datagrams")


def test_the_bridge_delays_and_reorders(delay_link: Link) -> None:
    got, fast = _datagrams(delay_link, 50)
    assert got == 50
    delay_link.faults.delay(40.0, 0.0)
    got, slow = _datagrams(delay_link, 30)
    assert got == 30 and 0.039 <= slow <= 0.2, slow
    delay_link.faults.delay(30.0, 20.0)
    before = delay_link.bridge_stats()["reordered"]
    rx = socket_in(delay_link.p, socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket_in(delay_link.d, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind((delay_link.addr[delay_link.p], 0))
        rx.settimeout(1.0)
        for i in range(100):  # 1 ms apart, delays spread over 40 ms: many swap
            tx.sendto(i.to_bytes(4, "big"), rx.getsockname())
            time.sleep(0.001)
        order = [int.from_bytes(rx.recvfrom(64)[0], "big") for _ in range(100)]
    finally:
        rx.close()
        tx.close()
    assert sorted(order) == list(range(100)) and order != list(range(100))
    assert delay_link.bridge_stats()["reordered"] > before
    print(
        f"\ndelaying bridge: one-way {fast * 1e3:.2f} ms idle, {slow * 1e3:.1f} ms at 40 ms asked; "
        f"30 +- 20 ms reordered {sum(a > b for a, b in itertools.pairwise(order))} of 99 neighbours"
    )


def test_teardown_and_stale_cleanup() -> None:
    made = Link()
    names = (made.p, made.d)
    made.close()
    listed = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True
    ).stdout
    assert not any(n in listed for n in names)
    # A namespace named as by a run whose process is gone is removed.
    dead_pid = 2**22 + 1  # above pid_max's default: no such process
    stale = f"{netns.PREFIX}-{dead_pid}-1-p"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netns.remove_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)
