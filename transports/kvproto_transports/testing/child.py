"""A node of transport endpoints in a child process, driven over a pipe.

The child runs one loop: it executes one command at a time from the parent
and, between commands, calls its node's ``pump()`` every ``tick_s`` (poll the
transports, send heartbeats: without a progress thread some transports serve
READs and deliver notifications only while their owner polls). One thread
does everything, so a transport that must stay on one thread (NIXL) can.

Commands are ``(name, kwargs)`` tuples answered with ``(True, value)`` or
``(False, (exception class name, message))``; :class:`ChildProcess` turns
them into method calls with timeouts. The child is started with ``spawn``
(never ``fork`` with a transport's threads around), so the node class is
named as ``"module:Class"`` and imported in the child.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

DEFAULT_TICK_S = 0.002
"""How long the child waits for a command before it pumps its node again."""

T = TypeVar("T")


class NodeError(Exception):
    """A command failed in the child; ``kind`` names the child's exception class."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        """Class name of the exception raised in the child."""


class CommandNode(Protocol):
    """What :func:`serve` needs of a node; every other public method is a command.

    A node class may also set ``tick_s`` (default :data:`DEFAULT_TICK_S`).
    """

    def pump(self) -> None:
        """Background duties between commands (poll, heartbeats); never blocks."""
        ...

    def shutdown(self) -> None:
        """Close every endpoint and server the node holds (the parent left)."""
        ...


def take_matching(
    pending: list[T], want: int, matches: Callable[[T], bool]
) -> tuple[list[T], list[T]]:
    """``(the first want items that match, every other item)``, both in order.

    How a ``wait_events`` command takes the events it waits for and leaves the
    rest for the next one.
    """
    taken: list[T] = []
    kept: list[T] = []
    for item in pending:
        if len(taken) < want and matches(item):
            taken.append(item)
        else:
            kept.append(item)
    return taken, kept


def serve(conn: Connection, preload: tuple[str, ...], node_cls: str) -> None:
    """Child main loop: commands from ``conn``, the node's ``pump()`` in between.

    ``preload`` names modules to import before reporting ready (torch takes
    seconds; children started together then import it in parallel).
    ``node_cls`` (``module:Class``) is the node, built with no arguments.
    """
    for module in preload:
        importlib.import_module(module)
    module, _, cls = node_cls.partition(":")
    node: CommandNode = getattr(importlib.import_module(module), cls)()
    tick_s = float(getattr(node, "tick_s", DEFAULT_TICK_S))
    conn.send((True, os.getpid()))
    while True:
        if not conn.poll(tick_s):
            node.pump()
            continue
        try:
            name, kwargs = conn.recv()
        except EOFError:
            node.shutdown()
            return
        if name == "exit":
            node.shutdown()
            conn.send((True, None))
            return
        try:
            fn: Callable[..., Any] = getattr(node, name)
            conn.send((True, fn(**kwargs)))
        except Exception as exc:
            conn.send((False, (type(exc).__name__, str(exc))))


class ChildProcess:
    """Parent-side handle of a child process running :func:`serve` with ``node_cls``."""

    call_timeout_s = 60.0
    """How long :meth:`call` waits for an answer unless told otherwise."""

    def __init__(self, node_cls: str, *, name: str = "node", preload: tuple[str, ...] = ()) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, preload, node_cls), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self._pending = False
        self._started = False
        self.pid: int | None = None
        """The child's pid, once :meth:`wait_started` returned."""

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """Block until the child is ready; returns its pid."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError("child process did not start")
        _ok, pid = self._conn.recv()
        self._started = True
        self.pid = int(pid)
        return self.pid

    def call(self, command: str, /, *, call_timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run a command in the child and return its value (raises :class:`NodeError`)."""
        self.submit(command, **kwargs)
        return self.result(self.call_timeout_s if call_timeout_s is None else call_timeout_s)

    def submit(self, command: str, /, **kwargs: Any) -> None:
        """Start a command without waiting (then call :meth:`result`)."""
        if not self._started:
            self.wait_started()
        if self._pending:
            raise RuntimeError("one command at a time: the last one has not answered")
        self._conn.send((command, kwargs))
        self._pending = True
        self._command = command

    def ready(self) -> bool:
        """The command started by :meth:`submit` has answered."""
        return self._conn.poll(0)

    def result(self, timeout_s: float = 60.0) -> Any:
        """The value of the command started by :meth:`submit`."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"command {self._command!r} took over {timeout_s} s")
        ok, value = self._conn.recv()
        self._pending = False
        if not ok:
            raise NodeError(*value)
        return value

    def kill(self) -> float:
        """``kill -9`` the child; returns the monotonic time just before the signal."""
        at = time.monotonic()
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        return at

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to shut its node down and exit; kill it if it does not."""
        if self.process.is_alive():
            try:
                if self._pending:
                    self.result(timeout_s)
                self._conn.send(("exit", {}))
                if self._conn.poll(timeout_s):
                    self._conn.recv()
            except (OSError, EOFError, TimeoutError, NodeError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.kill()
        self._conn.close()
