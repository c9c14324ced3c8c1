"""The lease-id set one session holds, with the count and digest its heartbeats state.

Holder and reader each keep, per session, the set of lease ids the session
renews; a heartbeat carries its size and an order-independent digest
(:func:`kvproto.wire.digest`) so the two sides notice a divergence without
listing the ids. Both sides, and the benchmark's frame builder, keep it up to
date one id at a time, and this module is the one place that says how, so the
wire value cannot drift between them: the holder and the frame builder move a
digest with :func:`digest_add` / :func:`digest_remove`; the holder's sessions
and a :class:`LeaseSet`, as the digest is linear in the ids (:data:`SCATTER`),
keep their plain sum, which :func:`digest_of_sum` turns into the digest once a
heartbeat.

On the per-lease hot path (every track, claim, release): slotted, no
per-operation allocation beyond the dict entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from kvproto.wire import MAX_U64, id_hash

V = TypeVar("V")

SCATTER = id_hash(1)
""":func:`kvproto.wire.id_hash` is multiplication by this constant modulo 2**64, so the
digest of a set is ``(sum of its ids * SCATTER) & MAX_U64`` and a digest moves by
``lease * SCATTER`` (tests/core/test_leaseset.py holds both equal to the wire's)."""


def digest_of_sum(id_sum: int) -> int:
    """:func:`kvproto.wire.digest` of a set whose ids sum to ``id_sum`` (unreduced)."""
    return (id_sum * SCATTER) & MAX_U64


def digest_add(digest: int, lease: int) -> int:
    """``digest`` of a set, updated for ``lease`` joining it."""
    return (digest + lease * SCATTER) & MAX_U64


def digest_remove(digest: int, lease: int) -> int:
    """``digest`` of a set, updated for ``lease`` leaving it."""
    return (digest - lease * SCATTER) & MAX_U64


class LeaseSet(Generic[V]):
    """Lease ids, each with an owner value, plus their count and digest.

    The reader's sessions keep the request id as the owner (lease ids repeat
    across holder incarnations, so the owner tells whose lease an id is).
    Adding an id already present replaces its owner and leaves count and digest
    alone: they describe the set of ids.
    """

    __slots__ = ("_owners", "count", "id_sum")

    def __init__(self) -> None:
        self._owners: dict[int, V] = {}
        self.count = 0
        """How many ids the set holds (the heartbeat's ``count``); a plain attribute,
        read on every heartbeat sent and compared."""
        self.id_sum = 0
        """The sum of the ids, kept up to date: a small-int addition per id where the
        digest would take three big-int operations (:attr:`digest` derives it)."""

    def add(self, lease: int, owner: V) -> None:
        """``lease`` joins the set, owned by ``owner``."""
        owners = self._owners
        if lease not in owners:
            self.count += 1
            self.id_sum += lease
        owners[lease] = owner

    def discard(self, lease: int) -> bool:
        """``lease`` leaves the set; False if it was not in it."""
        owners = self._owners
        if lease not in owners:
            return False
        del owners[lease]
        self.count -= 1
        self.id_sum -= lease
        return True

    @property
    def digest(self) -> int:
        """:func:`kvproto.wire.digest` of the ids."""
        return digest_of_sum(self.id_sum)

    def owner(self, lease: int) -> V | None:
        """The owner ``lease`` was added with; None if absent."""
        return self._owners.get(lease)

    def owners(self, *, newest_first: bool = False) -> Iterator[V]:
        """Every owner, in the order the ids joined (or the reverse)."""
        values = self._owners.values()
        return reversed(values) if newest_first else iter(values)

    def items(self) -> Iterator[tuple[int, V]]:
        """(id, owner) pairs, in the order the ids joined."""
        return iter(self._owners.items())

    def clear(self) -> None:
        """Empty the set."""
        self._owners.clear()
        self.count = 0
        self.id_sum = 0

    def __contains__(self, lease: object) -> bool:
        return lease in self._owners

    def __iter__(self) -> Iterator[int]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)

    def __bool__(self) -> bool:
        return bool(self._owners)

    def __repr__(self) -> str:
        return f"LeaseSet(count={self.count}, digest={self.digest:#x})"
