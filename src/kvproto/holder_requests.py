"""The holder's request ids by slot, and slot by request id, with each id string kept once.

A dict ``request id -> slot`` costs ~38 B an entry at 10^5 entries plus a
boxed slot int (32 B), and slot -> request id needs the string again. Here
the strings (which the engine holds anyway) are referenced from one list by
slot, the one per-lease list the collector walks (a visit per lease, no
object), and the other direction is an open-addressing table of slots: an
``array`` probed from ``hash(request id) & mask`` (a str caches its hash),
each candidate confirmed by comparing the string in its slot. Doubling at
half full keeps probe runs short; a deletion shifts the rest of its run
back, so no tombstones accumulate.
"""

from __future__ import annotations

from array import array

_FIRST_SIZE = 1024
_EMPTY = -1


class RequestIndex:
    """Request id <-> slot. ``""`` (a lease without request id) is never indexed."""

    __slots__ = ("_count", "_mask", "_table", "names")

    def __init__(self) -> None:
        self.names: list[str] = []
        """The request id in each slot (``""`` when none)."""
        self._table = array("i", [_EMPTY]) * _FIRST_SIZE
        self._mask = _FIRST_SIZE - 1
        self._count = 0

    def find(self, request_id: str) -> int | None:
        """The slot indexed under ``request_id``, or None."""
        if not request_id:
            return None
        table, mask, names = self._table, self._mask, self.names
        i = hash(request_id) & mask
        while True:
            slot = table[i]
            if slot == _EMPTY:
                return None
            if names[slot] == request_id:
                return slot
            i = (i + 1) & mask

    def set(self, slot: int, request_id: str) -> None:
        """Slot ``slot`` (holding no request id, or the next new slot) now holds
        ``request_id``, which its lookups find from now on (over an older slot with
        the same id, as a dict assignment would)."""
        if slot == len(self.names):
            self.names.append(request_id)
        else:
            self.names[slot] = request_id
        if not request_id:
            return
        table, mask, names = self._table, self._mask, self.names
        i = hash(request_id) & mask
        while True:
            held = table[i]
            if held == _EMPTY:
                break
            if held != slot and names[held] == request_id:
                table[i] = slot  # newest wins; the older slot keeps its name, unindexed
                return
            i = (i + 1) & mask
        table[i] = slot
        self._count += 1
        if 2 * self._count > len(table):
            self._grow()

    def clear(self, slot: int) -> None:
        """Slot ``slot`` holds no request id any more."""
        request_id = self.names[slot]
        if not request_id:
            return
        self.names[slot] = ""
        table, mask = self._table, self._mask
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
        names = self.names
        gap = i
        while True:
            i = (i + 1) & mask
            slot = table[i]
            if slot == _EMPTY:
                break
            home = hash(names[slot]) & mask
            if (i - home) & mask >= (i - gap) & mask:
                table[gap] = slot
                gap = i
        table[gap] = _EMPTY

    def _grow(self) -> None:
        held = [slot for slot in self._table if slot != _EMPTY]
        size = 2 * len(self._table)
        self._table = table = array("i", [_EMPTY]) * size
        self._mask = mask = size - 1
        names = self.names
        for slot in held:
            i = hash(names[slot]) & mask
            while table[i] != _EMPTY:
                i = (i + 1) & mask
            table[i] = slot
