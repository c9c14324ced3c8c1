"""The holder's request ids by slot, and slot by request id, with each id string kept once.

A dict ``request id -> slot`` costs ~38 B an entry at 10^5 entries plus a
boxed slot int (32 B), and slot -> request id needs the string again. Here
the strings (which the engine holds anyway) are referenced by slot from
tuples of 32 (a chunk), and the other direction is an open-addressing table
of slots: an ``array`` probed from ``hash(request id) & mask`` (a str caches
its hash), each candidate confirmed by comparing the string in its slot.
Doubling at half full keeps probe runs short; a deletion shifts the rest of
its run back, so no tombstones accumulate.

Why tuples and not one list: a list is a GC container, and a full
collection visits each of its items, ~16 ns a lease (1.6 ms at 10^5, the
whole of what a holder's leases added to the pause). A tuple holding only
strings is untracked by the collector at the first collection it sees, so
it is never visited again. The price is that naming a slot builds its
chunk again: ~0.2 µs, once at a grant and once at a forget.
"""

from __future__ import annotations

from array import array

_FIRST_SIZE = 1024
_EMPTY = -1
_CHUNK_BITS = 5
_IN_CHUNK = (1 << _CHUNK_BITS) - 1
_UNNAMED = ("",) * (1 << _CHUNK_BITS)


class RequestIndex:
    """Request id <-> slot. ``""`` (a lease without request id) is never indexed."""

    __slots__ = ("_chunks", "_count", "_mask", "_table")

    def __init__(self) -> None:
        self._chunks: list[tuple[str, ...]] = []
        """The request id in each slot (``""`` when none): slot ``s`` is item
        ``s & _IN_CHUNK`` of chunk ``s >> _CHUNK_BITS``."""
        self._table = array("i", [_EMPTY]) * _FIRST_SIZE
        self._mask = _FIRST_SIZE - 1
        self._count = 0

    def name(self, slot: int) -> str:
        """The request id in slot ``slot`` (``""`` when none)."""
        return self._chunks[slot >> _CHUNK_BITS][slot & _IN_CHUNK]

    def find(self, request_id: str) -> int | None:
        """The slot indexed under ``request_id``, or None."""
        if not request_id:
            return None
        table, mask, chunks = self._table, self._mask, self._chunks
        i = hash(request_id) & mask
        while True:
            slot = table[i]
            if slot == _EMPTY:
                return None
            if chunks[slot >> _CHUNK_BITS][slot & _IN_CHUNK] == request_id:
                return slot
            i = (i + 1) & mask

    def set(self, slot: int, request_id: str) -> None:
        """Slot ``slot`` (holding no request id, or the next new slot) now holds
        ``request_id``, which its lookups find from now on (over an older slot with
        the same id, as a dict assignment would)."""
        chunks = self._chunks
        if slot >> _CHUNK_BITS == len(chunks):
            chunks.append(_UNNAMED)
        if not request_id:
            return
        self._rename(slot, request_id)
        table, mask = self._table, self._mask
        i = hash(request_id) & mask
        while True:
            held = table[i]
            if held == _EMPTY:
                break
            if held != slot and chunks[held >> _CHUNK_BITS][held & _IN_CHUNK] == request_id:
                table[i] = slot  # newest wins; the older slot keeps its name, unindexed
                return
            i = (i + 1) & mask
        table[i] = slot
        self._count += 1
        if 2 * self._count > len(table):
            self._grow()

    def clear(self, slot: int) -> None:
        """Slot ``slot`` holds no request id any more."""
        request_id = self.name(slot)
        if not request_id:
            return
        self._rename(slot, "")
        table, mask, chunks = self._table, self._mask, self._chunks
        i = hash(request_id) & mask
        while True:
            held = table[i]
            if held == _EMPTY:
                return  # another slot took the id over (see set)
            if held == slot:
                break
            i = (i + 1) & mask
        self._count -= 1
        # Close the gap: move back each later entry of its run that may sit there.
        gap = i
        while True:
            i = (i + 1) & mask
            slot = table[i]
            if slot == _EMPTY:
                break
            home = hash(chunks[slot >> _CHUNK_BITS][slot & _IN_CHUNK]) & mask
            if (i - home) & mask >= (i - gap) & mask:
                table[gap] = slot
                gap = i
        table[gap] = _EMPTY

    def _rename(self, slot: int, request_id: str) -> None:
        chunk = slot >> _CHUNK_BITS
        names = list(self._chunks[chunk])
        names[slot & _IN_CHUNK] = request_id
        self._chunks[chunk] = tuple(names)

    def _grow(self) -> None:
        held = [slot for slot in self._table if slot != _EMPTY]
        size = 2 * len(self._table)
        self._table = table = array("i", [_EMPTY]) * size
        self._mask = mask = size - 1
        for slot in held:
            i = hash(self.name(slot)) & mask
            while table[i] != _EMPTY:
                i = (i + 1) & mask
            table[i] = slot
