"""Which sessions renew each lease: links inside slot-indexed columns, no set per session.

The holder needs, per session, the count and digest of the lease ids it
renews (a heartbeat states them), a membership test (every claim) and a walk
over its leases in the order they joined (a lost session ends them in that
order); per lease, the sessions renewing it. A set per session costs ~52 B a
lease at 10^5 (a dict entry and its share of the table). Here each session's
leases are a doubly linked list through the lease slots: the first session to
renew a lease uses the *node* that is the lease's own slot (two ``array``
columns of links, 8 B a lease), and the ``holder`` column names that session.
A lease renewed by several sessions at once (a reader with more TP ranks
than the holder) gives the others nodes from a small pool of extra nodes,
numbered from -2 down, and lists them in a sparse dict; so does a lease whose
one remaining session holds an extra node.

Count and digest are kept per session as two numbers: the count, and the
plain sum of the ids, from which :func:`kvproto.leaseset.digest_of_sum` (the
helper the reader's sets use, so the wire value cannot drift) gives the
digest when a heartbeat asks for it. The digest is linear in the ids, so the
sum carries the same information, and a join or leave is one small addition
instead of a multiplication of big ints (~2k instructions, every claim).
"""

from __future__ import annotations

from array import array

from kvproto.leaseset import digest_of_sum

NO_NODE = -1
"""End of a list (or a list with no nodes)."""
NOBODY = 0
"""``holder`` of a lease no session renews (session serials start at 1)."""
SEVERAL = 2**64 - 1
"""``holder`` of a lease renewed by two or more sessions (no serial reaches it; the column
is unsigned because writing an unsigned array item is ~40 % cheaper, once a claim)."""


class SessionLeases:
    """One session's leases: what its heartbeats state (count, digest) and its list's ends."""

    __slots__ = ("count", "head", "id_sum", "serial", "tail")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        """The session's serial (what ``holder`` and the node dicts name it by)."""
        self.count = 0
        """How many leases the session renews (the heartbeat's ``count``)."""
        self.id_sum = 0
        """The sum of their ids (unreduced)."""
        self.head = NO_NODE
        self.tail = NO_NODE

    @property
    def digest(self) -> int:
        """:func:`kvproto.wire.digest` of their ids (the heartbeat's ``digest``)."""
        return digest_of_sum(self.id_sum)


class Memberships:
    """Lease slot <-> the sessions renewing it. The lease table grows it a slot at a time."""

    __slots__ = (
        "_free_extra",
        "_next",
        "_nodes",
        "_prev",
        "_sessions",
        "_x_next",
        "_x_prev",
        "_x_slot",
        "holder",
    )

    def __init__(self) -> None:
        self.holder = array("Q")
        """Serial of the one session renewing the lease; :data:`NOBODY`; :data:`SEVERAL`."""
        self._next = array("i")
        """Links of the node that is the slot itself (its first session's membership)."""
        self._prev = array("i")
        self._nodes: dict[int, dict[int, int]] = {}
        """Slot -> {serial: node}, for slots with an extra node in use (several sessions,
        or one holding an extra node); in the order the sessions joined."""
        self._x_next = array("i")
        """Links of extra node ``-2 - i`` at ``i``."""
        self._x_prev = array("i")
        self._x_slot = array("i")
        """The slot extra node ``-2 - i`` belongs to."""
        self._free_extra: list[int] = []
        self._sessions: dict[int, SessionLeases] = {}
        """Every open session's list, by serial (a slot forgotten while live is taken
        out of them)."""

    # ------------------------------------------------------------ slots and sessions

    def new_slot(self) -> None:
        """The lease table has grown by one slot."""
        self.holder.append(NOBODY)
        self._next.append(NO_NODE)
        self._prev.append(NO_NODE)

    def open(self, serial: int) -> SessionLeases:
        """A new session's (empty) list."""
        leases = SessionLeases(serial)
        self._sessions[serial] = leases
        return leases

    def close(self, leases: SessionLeases) -> None:
        """The session is gone; it renews nothing any more (its caller detached all)."""
        if leases.count:
            raise ValueError(f"session {leases.serial} still renews {leases.count} leases")
        self._sessions.pop(leases.serial, None)

    def clear(self, slot: int, lease_id: int) -> None:
        """The slot is freed: take it out of every session that still renews it."""
        if self.holder[slot] != NOBODY:
            for serial in self.holders(slot):
                self.detach(slot, self._sessions[serial], lease_id)

    # ------------------------------------------------------------ queries

    def holds(self, slot: int, serial: int) -> bool:
        """Session ``serial`` renews the lease."""
        held = self.holder[slot]
        return held == serial or (held == SEVERAL and serial in self._nodes[slot])

    def holders(self, slot: int) -> tuple[int, ...]:
        """Serials of the sessions renewing the lease, in join order (a copy: detach
        while iterating)."""
        held = self.holder[slot]
        if held == NOBODY:
            return ()
        if held == SEVERAL:
            return tuple(self._nodes[slot])
        return (held,)

    def slots(self, leases: SessionLeases) -> list[int]:
        """The slots of the session's leases, in the order they joined (a copy)."""
        out = []
        node = leases.head
        nexts, x_next, x_slot = self._next, self._x_next, self._x_slot
        while node != NO_NODE:
            if node >= 0:
                out.append(node)
                node = nexts[node]
            else:
                out.append(x_slot[-2 - node])
                node = x_next[-2 - node]
        return out

    # ------------------------------------------------------------ changes

    def attach(self, slot: int, leases: SessionLeases, lease_id: int) -> bool:
        """The session renews the lease (``lease_id`` is in ``slot``); False if it did already."""
        held = self.holder[slot]
        serial = leases.serial
        if held == NOBODY:
            self.holder[slot] = serial
            node = slot
        else:
            nodes = self._nodes.get(slot)
            if nodes is None:
                if held == serial:
                    return False
                nodes = self._nodes[slot] = {held: slot}
            elif serial in nodes:
                return False
            node = self._new_extra(slot)
            nodes[serial] = node
            if len(nodes) > 1:
                self.holder[slot] = SEVERAL
        # Linked at the list's tail, written out here (every claim comes this way).
        tail = leases.tail
        if node >= 0:
            self._prev[node] = tail
            self._next[node] = NO_NODE
        else:
            self._x_prev[-2 - node] = tail
            self._x_next[-2 - node] = NO_NODE
        if tail == NO_NODE:
            leases.head = node
        elif tail >= 0:
            self._next[tail] = node
        else:
            self._x_next[-2 - tail] = node
        leases.tail = node
        leases.count += 1
        leases.id_sum += lease_id
        return True

    def detach(self, slot: int, leases: SessionLeases, lease_id: int) -> bool:
        """The session no longer renews the lease; False if it did not."""
        serial = leases.serial
        nodes = self._nodes.get(slot) if self._nodes else None
        if nodes is None:
            if self.holder[slot] != serial:
                return False
            self.holder[slot] = NOBODY
            node = slot
        else:
            node = nodes.pop(serial, NO_NODE)
            if node == NO_NODE:
                return False
            if not nodes:
                del self._nodes[slot]
                self.holder[slot] = NOBODY
            elif len(nodes) == 1:
                ((other, other_node),) = nodes.items()
                self.holder[slot] = other
                if other_node == slot:
                    del self._nodes[slot]  # back to the plain case: its own node
        self._unlink(leases, node)
        if node != slot:
            self._free_extra.append(-2 - node)
        leases.count -= 1
        leases.id_sum -= lease_id
        return True

    def _new_extra(self, slot: int) -> int:
        if self._free_extra:
            i = self._free_extra.pop()
            self._x_slot[i] = slot
        else:
            i = len(self._x_slot)
            self._x_slot.append(slot)
            self._x_next.append(NO_NODE)
            self._x_prev.append(NO_NODE)
        return -2 - i

    def _unlink(self, leases: SessionLeases, node: int) -> None:
        if node >= 0:
            before, after = self._prev[node], self._next[node]
        else:
            before, after = self._x_prev[-2 - node], self._x_next[-2 - node]
        if before == NO_NODE:
            leases.head = after
        elif before >= 0:
            self._next[before] = after
        else:
            self._x_next[-2 - before] = after
        if after == NO_NODE:
            leases.tail = before
        elif after >= 0:
            self._prev[after] = before
        else:
            self._x_prev[-2 - after] = before
