"""kvproto_transports.testing: the child-process harness, on its own (no transport library)."""

from __future__ import annotations

import time

import pytest

from kvproto_transports.testing import ChildProcess, NodeError, take_matching

NODE = "tests.transports.test_testing_kit:CountingNode"


class CountingNode:
    """Counts its pumps; one command that answers, one that raises."""

    tick_s = 0.001

    def __init__(self) -> None:
        self.pumps = 0
        self.closed = False

    def pump(self) -> None:
        self.pumps += 1

    def shutdown(self) -> None:
        self.closed = True

    def add(self, *, a: int, b: int) -> int:
        return a + b

    def pumped(self) -> int:
        """How many times the child pumped this node so far."""
        return self.pumps

    def fail(self) -> None:
        raise KeyError("no such thing")


def test_take_matching_takes_the_first_matches_and_keeps_the_rest_in_order() -> None:
    taken, kept = take_matching([1, 2, 3, 4, 5, 6], 2, lambda x: x % 2 == 0)
    assert (taken, kept) == ([2, 4], [1, 3, 5, 6])
    assert take_matching([1, 3], 5, lambda x: x > 1) == ([3], [1])


def test_commands_answer_errors_travel_and_the_child_pumps_between_commands() -> None:
    node = ChildProcess(NODE, name="kit-test")
    try:
        pid = node.wait_started()
        assert node.pid == pid == node.process.pid
        assert node.call("add", a=2, b=3) == 5
        with pytest.raises(NodeError) as err:
            node.call("fail")
        assert err.value.kind == "KeyError"
        first = node.call("pumped")
        time.sleep(0.05)
        assert node.call("pumped") > first  # idle ticks pumped the node
        node.submit("add", a=1, b=1)
        with pytest.raises(RuntimeError):
            node.submit("add", a=1, b=1)  # one command at a time
        assert node.result() == 2
    finally:
        node.close()
    assert not node.process.is_alive()
    assert node.process.exitcode == 0  # asked to exit, it shut down and returned


def test_kill_is_a_sigkill_and_returns_the_time_before_it() -> None:
    node = ChildProcess(NODE, name="kit-kill")
    try:
        node.wait_started()
        before = time.monotonic()
        at = node.kill()
        assert before <= at <= time.monotonic()
        assert node.process.exitcode == -9
    finally:
        node.close()
