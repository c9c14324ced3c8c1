"""The holder's leases as columns: one array per field, indexed by slot.

Why columns: a holder keeps every live lease (10^5 and more) and each of its
fields for the lease's whole life. An object per lease costs ~150 B plus a
float object per deadline, and every such object is tracked by the cyclic GC,
so a full collection walks them all (the pause grows with the lease count).
Here a lease is a slot: its fields are machine values in ``array``/``bytearray``
columns, which the collector never walks, and the request ids are referenced
from tuples the collector untracks (:class:`~kvproto.holder_requests.RequestIndex`):
the strings are the engine's own, so referencing them costs no copy.
What only some leases need (consumers counted, legacy dones) lives in sparse
dicts keyed by slot; who claimed a lease is a code into
:class:`~kvproto.holder_claimers.Claimers`, which sessions renew it is
:class:`~kvproto.holder_members.Memberships`.

The claim proof is not kept: a later claim (another rank of the same reader)
or a done derives it again from the token, one keyed hash, which is cheaper
than 16 B for every lease's whole life.

Slots of forgotten leases are reused; a lease id resolves to its slot only
through :meth:`LeaseTable.slot`, so a stale id never reaches a reused slot.
"""

from __future__ import annotations

import math
from array import array

from kvproto.holder_claimers import UNCLAIMED, Claimers
from kvproto.holder_members import NOBODY, Memberships
from kvproto.holder_requests import RequestIndex
from kvproto.states import LEASE_TRANSITIONS, LeaseInput, LeaseState
from kvproto.ticket import TOKEN_BYTES, LeaseTicket

STATES = tuple(LeaseState)
"""The state column holds an index into this tuple."""
STATE_INDEX = {state: i for i, state in enumerate(STATES)}
TERMINAL = bytes(state.terminal for state in STATES)
"""``TERMINAL[index]``: the state at ``index`` is terminal."""
NO_ROW = 255
"""In :data:`NEXT_STATE`: the lease table has no row for the pair."""
NEXT_STATE = {
    event._value_: bytes(
        STATE_INDEX[LEASE_TRANSITIONS[(state, event)]]
        if (state, event) in LEASE_TRANSITIONS
        else NO_ROW
        for state in STATES
    )
    for event in LeaseInput
}
""":data:`~kvproto.states.LEASE_TRANSITIONS` over state indices: ``NEXT_STATE[input
value][state index]``, the next state's index. Derived from the table at import, so
the table stays the one authority; keyed by the input's value because an Enum member
hashes through a Python-level ``__hash__``, twice a lookup of a (state, input) pair."""
GRANTED = STATE_INDEX[LeaseState.GRANTED]
HELD = STATE_INDEX[LeaseState.HELD]
UNSCHEDULED = math.nan
"""``due`` of a lease with no canonical timer entry (every comparison with it is False)."""
FREE = 0
"""``ids`` of a free slot (lease ids are 1..2**64-1: no lookup matches it)."""

_FIRST_INDEX_SIZE = 1024


class LeaseTable:
    """Every lease a holder still knows (live ones and tombstoned ended ones).

    Lease id → slot without an int object per entry: ids are minted in sequence
    (by this holder, or by the scheduler whose tickets it adopts), so the ids
    alive at once mostly differ below the index size, and an array indexed by
    ``id & mask`` finds them in one probe. An id whose home is taken goes to a
    small dict. The index doubles once half full; a lookup is one probe plus,
    if anything overflowed, a dict lookup, so a peer sending ids that collide
    costs the holder no more than any other id.
    """

    __slots__ = (
        "_count",
        "_free",
        "_home",
        "_mask",
        "_overflow",
        "claimer",
        "claimers",
        "consumers",
        "due",
        "hard",
        "ids",
        "legacy_done",
        "members",
        "own",
        "requests",
        "states",
        "tokens",
    )

    def __init__(self) -> None:
        self._home = array("i", [-1]) * _FIRST_INDEX_SIZE
        """Slot of the lease whose id is ``i`` modulo the size, at ``i & _mask``; -1: none."""
        self._mask = _FIRST_INDEX_SIZE - 1
        self._overflow: dict[int, int] = {}
        """Lease id → slot, for ids whose home was taken."""
        self._count = 0
        self._free = array("i")
        """Slots of forgotten leases, reused before the columns grow."""
        self.ids = array("Q")
        """The lease id in each slot (:data:`FREE` when free)."""
        self.requests = RequestIndex()
        """The holder's request id of each slot, and the slot of each request id."""
        self.tokens = bytearray()
        """The 128-bit token, TOKEN_BYTES per slot."""
        self.states = bytearray()
        """Index into :data:`STATES`."""
        self.own = array("d")
        """The lease's own deadline (grant, legacy renewals, sessions it fell back from)."""
        self.hard = array("d")
        """max_hold deadline."""
        self.due = array("d")
        """Time of the canonical timer entry, :data:`UNSCHEDULED` if none."""
        self.claimers = Claimers()
        self.claimer = array("I")
        """Code of the lease's first claimer in :attr:`claimers` (:data:`UNCLAIMED`)."""
        self.members = Memberships()
        """The sessions renewing each lease, and each session's leases."""
        self.consumers: dict[int, dict[int, int]] = {}
        """Slot → {reader rank: serial of the session whose done counted}; absent if none."""
        self.legacy_done: dict[int, int] = {}
        """Slot → raw stock-vLLM done notifications counted; absent if none."""

    # ------------------------------------------------------------ slots

    def slot(self, lease_id: int) -> int | None:
        """The slot of ``lease_id``, or None if the table does not hold it."""
        slot = self._home[lease_id & self._mask]
        if slot >= 0 and self.ids[slot] == lease_id:
            return slot
        overflow = self._overflow
        return overflow.get(lease_id) if overflow else None

    def index(self) -> tuple[array[int], int, array[int], dict[int, int]]:
        """(home, mask, ids, overflow): what :meth:`slot` reads, for a caller that looks
        up many ids in one loop (a frame's claims) in which no lease is added or
        forgotten (adding one may replace the index)."""
        return self._home, self._mask, self.ids, self._overflow

    def slot_of_request(self, request_id: str) -> int | None:
        """The slot of the lease of ``request_id``, or None."""
        return self.requests.find(request_id)

    def has_request(self, request_id: str) -> bool:
        """A held lease has ``request_id``."""
        return self.requests.find(request_id) is not None

    def __contains__(self, lease_id: int) -> bool:
        return self.slot(lease_id) is not None

    def __len__(self) -> int:
        return self._count

    def add(self, ticket: LeaseTicket, now: float, max_hold: float) -> int:
        """Hold ``ticket``'s lease, GRANTED; its slot."""
        lease_id = ticket.lease
        home = lease_id & self._mask
        slot = self._home[home]
        if slot < 0 or self.ids[slot] != lease_id:
            held = self._overflow.get(lease_id) if self._overflow else None
            if held is None:
                slot = self._new_slot(lease_id, home if slot < 0 else -1)
                if slot == len(self.ids):
                    self.ids.append(lease_id)
                    self.requests.set(slot, ticket.request_id)
                    self.tokens += ticket.token
                    self.states.append(0)
                    self.own.append(now + ticket.expires_in)
                    self.hard.append(now + max_hold)
                    self.due.append(UNSCHEDULED)
                    self.claimer.append(UNCLAIMED)
                    self.members.new_slot()
                    return slot
            else:
                slot = held
                self._let_go(slot)
        else:
            self._let_go(slot)
        self.ids[slot] = lease_id
        self.requests.set(slot, ticket.request_id)
        start = slot * TOKEN_BYTES
        self.tokens[start : start + TOKEN_BYTES] = ticket.token
        self.states[slot] = 0
        self.own[slot] = now + ticket.expires_in
        self.hard[slot] = now + max_hold
        self.due[slot] = UNSCHEDULED
        self.claimer[slot] = UNCLAIMED
        return slot

    def _new_slot(self, lease_id: int, home: int) -> int:
        """A slot for a lease id not held, indexed (``home``: its free home, or -1);
        ``len(ids)`` when the columns must grow by one."""
        slot = self._free.pop() if self._free else len(self.ids)
        self._count += 1
        if 2 * self._count > len(self._home):
            self._grow_index()
            home = lease_id & self._mask
            if self._home[home] >= 0:
                home = -1
        if home >= 0:
            self._home[home] = slot
        else:
            self._overflow[lease_id] = slot
        return slot

    def _let_go(self, slot: int) -> None:
        """A held lease's id goes to a newer lease (a holder granting and adopting from
        one id space): the newer one takes the slot and the sessions that renew the
        id, as a dict keyed by id would have it; the rest of the older one goes."""
        self.requests.clear(slot)
        if self.claimer[slot] != UNCLAIMED:
            self.claimers.release(self.claimer[slot])
        if self.consumers:
            self.consumers.pop(slot, None)
        if self.legacy_done:
            self.legacy_done.pop(slot, None)

    def forget(self, lease_id: int) -> None:
        """Drop the lease (if held); its slot is reused."""
        slot = self.slot(lease_id)
        if slot is None:
            return
        self._count -= 1
        home = lease_id & self._mask
        if self._home[home] == slot:
            self._home[home] = -1
        else:
            del self._overflow[lease_id]
        if self.members.holder[slot] != NOBODY:
            self.members.clear(slot, lease_id)
        self._let_go(slot)
        self.claimer[slot] = UNCLAIMED
        self.ids[slot] = FREE
        self.due[slot] = UNSCHEDULED
        self._free.append(slot)

    def _grow_index(self) -> None:
        held = [slot for slot in self._home if slot >= 0]
        held += self._overflow.values()
        size = 2 * len(self._home)
        self._home = array("i", [-1]) * size
        self._mask = size - 1
        self._overflow = {}
        for slot in held:
            home = self.ids[slot] & self._mask
            if self._home[home] < 0:
                self._home[home] = slot
            else:
                self._overflow[self.ids[slot]] = slot

    # ------------------------------------------------------------ fields

    def state(self, slot: int) -> LeaseState:
        """The lease's state."""
        return STATES[self.states[slot]]

    def terminal(self, slot: int) -> bool:
        """The lease ended (its blocks were freed)."""
        return bool(TERMINAL[self.states[slot]])

    def request_id(self, slot: int) -> str:
        """The holder's request id (``""`` when none)."""
        return self.requests.name(slot)

    def token(self, slot: int) -> bytes:
        """The lease's token."""
        start = slot * TOKEN_BYTES
        return bytes(self.tokens[start : start + TOKEN_BYTES])

    def owner(self, slot: int) -> str | None:
        """The engine that first claimed the lease (``legacy:<peer>`` for stock peers)."""
        return self.claimers.engines[self.claimer[slot]]

    def set_claimer(self, slot: int, engine: str, *, tp: int = 0, expected: int = 0) -> None:
        """Record the first claimer (unclaimed until now): its engine, TP size and the
        consumers it expects (none for a stock peer)."""
        self.claimer[slot] = self.claimers.acquire(engine, tp, expected)
