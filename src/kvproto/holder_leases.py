"""The holder's leases as columns: one array (or list) per field, indexed by slot.

Why columns: a holder keeps every live lease (10^5 and more) and each of its
fields for the lease's whole life. An object per lease costs ~150 B plus a
float object per deadline, and every such object is tracked by the cyclic GC,
so a full collection walks them all (the pause grows with the lease count).
Here a lease is a slot: its fields are machine values in ``array``/``bytearray``
columns, or references to strings the engine holds anyway; nothing per lease is
GC-tracked. What only some leases need (consumers counted, legacy dones, a
second renewing session) lives in sparse dicts keyed by slot.

Sessions renewing a lease are kept as their serials (plain ints), not as
object references: the holder resolves a serial through its own index.

Slots of forgotten leases are reused; a lease id resolves to its slot only
through :meth:`LeaseTable.slot`, so a stale id never reaches a reused slot.
"""

from __future__ import annotations

import math
from array import array

from kvproto.states import LeaseState
from kvproto.ticket import PROOF_BYTES, TOKEN_BYTES, LeaseTicket, claim_proof

STATES = tuple(LeaseState)
"""The state column holds an index into this tuple."""
STATE_INDEX = {state: i for i, state in enumerate(STATES)}
TERMINAL = bytes(state.terminal for state in STATES)
"""``TERMINAL[index]``: the state at ``index`` is terminal."""
UNSCHEDULED = math.nan
"""``due`` of a lease with no canonical timer entry (every comparison with it is False)."""
SEVERAL = -1
"""``holder`` of a lease renewed by two or more sessions (their serials: ``several``)."""

_NO_PROOF = bytes(PROOF_BYTES)
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
        "_by_request",
        "_count",
        "_free",
        "_home",
        "_mask",
        "_overflow",
        "consumers",
        "due",
        "expected",
        "hard",
        "holder",
        "ids",
        "legacy_done",
        "own",
        "owners",
        "proofs",
        "reader_tp",
        "request_ids",
        "several",
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
        self._by_request: dict[str, int] = {}
        """Request id → lease id (the int of ``ids``: an entry costs no int of its own)."""
        self._free = array("q")
        """Slots of forgotten leases, reused before the columns grow."""
        self.ids: list[int] = []
        """The lease id in each slot: the ticket's own int, which the index, the
        session sets and the outputs then share (an array would box a new one each read)."""
        self.request_ids: list[str] = []
        """The holder's request id (``""`` when none)."""
        self.tokens = bytearray()
        """The 128-bit token, TOKEN_BYTES per slot."""
        self.proofs = bytearray()
        """The first claimer's proof, PROOF_BYTES per slot (zeros until claimed)."""
        self.states = bytearray()
        """Index into :data:`STATES`."""
        self.own = array("d")
        """The lease's own deadline (grant, legacy renewals, sessions it fell back from)."""
        self.hard = array("d")
        """max_hold deadline."""
        self.due = array("d")
        """Time of the canonical timer entry, :data:`UNSCHEDULED` if none."""
        self.owners: list[str | None] = []
        """The engine that first claimed the lease (``legacy:<peer>`` for stock peers)."""
        self.expected = array("q")
        """Consumers expected to report done (the first claimer's session's figure)."""
        self.reader_tp = array("q")
        """The first claimer's TP size: whose ranks' dones count (0: unclaimed)."""
        self.holder = array("q")
        """Serial of the one session renewing the lease; 0: none; :data:`SEVERAL`."""
        self.several: dict[int, set[int]] = {}
        """Slot → serials of the sessions renewing it, when there are two or more."""
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

    def held_slot(self, lease_id: int) -> int:
        """The slot of a lease the caller knows is held (a session's, a tombstone's)."""
        slot = self.slot(lease_id)
        if slot is None:
            raise LookupError(f"lease {lease_id} is not in the table")
        return slot

    def slot_of_request(self, request_id: str) -> int | None:
        """The slot of the lease of ``request_id``, or None."""
        lease_id = self._by_request.get(request_id)
        return None if lease_id is None else self.slot(lease_id)

    def has_request(self, request_id: str) -> bool:
        """A held lease has ``request_id``."""
        return request_id in self._by_request

    def __contains__(self, lease_id: int) -> bool:
        return self.slot(lease_id) is not None

    def __len__(self) -> int:
        return self._count

    def add(self, ticket: LeaseTicket, now: float, max_hold: float) -> int:
        """Hold ``ticket``'s lease, GRANTED; its slot."""
        request_id = ticket.request_id
        lease_id = ticket.lease
        held = self.slot(lease_id)
        if held is not None:
            # Held already (a holder granting and adopting from one id space): the
            # newer lease takes the id, as a dict assignment would have it.
            self._drop(lease_id, held)
        if self._free:
            slot = self._free.pop()
            self.ids[slot] = ticket.lease
            self.request_ids[slot] = request_id
            start = slot * TOKEN_BYTES
            self.tokens[start : start + TOKEN_BYTES] = ticket.token
            start = slot * PROOF_BYTES
            self.proofs[start : start + PROOF_BYTES] = _NO_PROOF
            self.states[slot] = 0
            self.own[slot] = now + ticket.expires_in
            self.hard[slot] = now + max_hold
            self.due[slot] = UNSCHEDULED
            self.owners[slot] = None
            self.expected[slot] = 0
            self.reader_tp[slot] = 0
            self.holder[slot] = 0
        else:
            slot = len(self.ids)
            self.ids.append(ticket.lease)
            self.request_ids.append(request_id)
            self.tokens += ticket.token
            self.proofs += _NO_PROOF
            self.states.append(0)
            self.own.append(now + ticket.expires_in)
            self.hard.append(now + max_hold)
            self.due.append(UNSCHEDULED)
            self.owners.append(None)
            self.expected.append(0)
            self.reader_tp.append(0)
            self.holder.append(0)
        self._count += 1
        if 2 * self._count > len(self._home):
            self._grow_index()
        home = lease_id & self._mask
        if self._home[home] < 0:
            self._home[home] = slot
        else:
            self._overflow[lease_id] = slot
        if request_id:
            self._by_request[request_id] = lease_id
        return slot

    def forget(self, lease_id: int) -> None:
        """Drop the lease (if held); its slot is reused."""
        slot = self.slot(lease_id)
        if slot is None:
            return
        request_id = self.request_ids[slot]
        if request_id and self._by_request.get(request_id) == lease_id:
            del self._by_request[request_id]
        self._drop(lease_id, slot)

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

    def _drop(self, lease_id: int, slot: int) -> None:
        self._count -= 1
        home = lease_id & self._mask
        if self._home[home] == slot:
            self._home[home] = -1
        else:
            del self._overflow[lease_id]
        self.ids[slot] = -1  # ids are uint64 (wire): no lookup matches a free slot
        self.request_ids[slot] = ""
        self.owners[slot] = None
        self.consumers.pop(slot, None)
        self.legacy_done.pop(slot, None)
        self.several.pop(slot, None)
        self.holder[slot] = 0
        self.due[slot] = UNSCHEDULED
        self._free.append(slot)

    # ------------------------------------------------------------ fields

    def state(self, slot: int) -> LeaseState:
        """The lease's state."""
        return STATES[self.states[slot]]

    def terminal(self, slot: int) -> bool:
        """The lease ended (its blocks were freed)."""
        return bool(TERMINAL[self.states[slot]])

    def set_state(self, slot: int, state: LeaseState) -> None:
        """Record a transition the lease table decided."""
        self.states[slot] = STATE_INDEX[state]

    def token(self, slot: int) -> bytes:
        """The lease's token."""
        start = slot * TOKEN_BYTES
        return bytes(self.tokens[start : start + TOKEN_BYTES])

    def proof_for(self, slot: int, engine: str) -> bytes:
        """The proof a claim of ``engine`` must carry: the first claimer's, kept, or
        computed from the token (the caller has checked that ``engine`` may claim)."""
        start = slot * PROOF_BYTES
        proof = bytes(self.proofs[start : start + PROOF_BYTES])
        if proof != _NO_PROOF:
            return proof
        start = slot * TOKEN_BYTES
        return claim_proof(bytes(self.tokens[start : start + TOKEN_BYTES]), engine, self.ids[slot])

    def set_claimer(self, slot: int, engine: str, proof: bytes, expected: int, tp: int) -> None:
        """Record the first claimer: its engine, proof (kept for later claims), the
        consumers it expects and its TP size."""
        self.owners[slot] = engine
        start = slot * PROOF_BYTES
        self.proofs[start : start + PROOF_BYTES] = proof
        self.expected[slot] = expected
        self.reader_tp[slot] = tp

    # ------------------------------------------------------------ renewing sessions

    def holders(self, slot: int) -> tuple[int, ...]:
        """Serials of the sessions renewing the lease (a copy: detach while iterating)."""
        held = self.holder[slot]
        if held == 0:
            return ()
        if held == SEVERAL:
            return tuple(self.several[slot])
        return (held,)

    def attach(self, slot: int, serial: int) -> None:
        """Session ``serial`` renews the lease."""
        held = self.holder[slot]
        if held == 0:
            self.holder[slot] = serial
        elif held == SEVERAL:
            self.several[slot].add(serial)
        elif held != serial:
            self.several[slot] = {held, serial}
            self.holder[slot] = SEVERAL

    def detach(self, slot: int, serial: int) -> None:
        """Session ``serial`` no longer renews the lease."""
        held = self.holder[slot]
        if held == serial:
            self.holder[slot] = 0
        elif held == SEVERAL:
            serials = self.several[slot]
            serials.discard(serial)
            if len(serials) == 1:
                self.holder[slot] = serials.pop()
                del self.several[slot]
