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
from kvproto.ticket import PROOF_BYTES, TOKEN_BYTES, LeaseTicket

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


class LeaseTable:
    """Every lease a holder still knows (live ones and tombstoned ended ones)."""

    __slots__ = (
        "_by_request",
        "_free",
        "_slot",
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
        self._slot: dict[int, int] = {}
        """Lease id → slot (an untracked dict: ints only)."""
        self._by_request: dict[str, int] = {}
        """Request id → slot, for leases that have one; shares the slot ints of ``_slot``."""
        self._free = array("q")
        """Slots of forgotten leases, reused before the columns grow."""
        self.ids = array("Q")
        """The lease id in each slot."""
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
        return self._slot.get(lease_id)

    def slot_of_request(self, request_id: str) -> int | None:
        """The slot of the lease of ``request_id``, or None."""
        return self._by_request.get(request_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, ticket: LeaseTicket, now: float, max_hold: float) -> int:
        """Hold ``ticket``'s lease, GRANTED; its slot."""
        request_id = ticket.request_id
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
        self._slot[ticket.lease] = slot
        if request_id:
            self._by_request[request_id] = slot
        return slot

    def forget(self, lease_id: int) -> None:
        """Drop the lease (if held); its slot is reused."""
        slot = self._slot.pop(lease_id, None)
        if slot is None:
            return
        request_id = self.request_ids[slot]
        if request_id and self._by_request.get(request_id) == slot:
            del self._by_request[request_id]
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

    def proof(self, slot: int) -> bytes:
        """The first claimer's proof, or b"" before the first claim."""
        start = slot * PROOF_BYTES
        proof = bytes(self.proofs[start : start + PROOF_BYTES])
        return b"" if proof == _NO_PROOF else proof

    def set_proof(self, slot: int, proof: bytes) -> None:
        """Record the first claimer's proof (PROOF_BYTES long)."""
        start = slot * PROOF_BYTES
        self.proofs[start : start + PROOF_BYTES] = proof

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
