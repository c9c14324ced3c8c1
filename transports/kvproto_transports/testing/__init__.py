"""Helpers for testing a transport across processes, beside the conformance kit.

Peer failure can only be observed across processes (``kill -9`` of a peer), so
a transport's own tests (ours, and third-party authors' next to
``kvproto conformance``) host endpoints in child processes and drive them over
a pipe: :class:`ChildProcess` in the parent, :func:`serve` in the child, and
a *node* class of the author's that names the commands. See
``spec/transport-authors.md``.
"""

from __future__ import annotations

from .child import DEFAULT_TICK_S, ChildProcess, CommandNode, NodeError, serve, take_matching

__all__ = [
    "DEFAULT_TICK_S",
    "ChildProcess",
    "CommandNode",
    "NodeError",
    "serve",
    "take_matching",
]
