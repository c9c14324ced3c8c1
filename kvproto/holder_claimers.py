"""The first claimers of the holder's leases, each kept once and named by a small code.

A lease remembers who claimed it first: the engine that may claim it again
(the owner), and that session's TP size and expected consumer count, which
decide whose dones count. Every lease one reader session claims shares
those three values, so the lease table keeps a 4-byte code per lease instead
of a string reference (which the cyclic GC would visit, once per lease)
and two ints. Codes are reference-counted: one that no lease names is reused.
"""

from __future__ import annotations

UNCLAIMED = 0
"""The code of a lease nobody has claimed: no owner, no TP size, no expected consumers."""


class Claimers:
    """Code -> (owner engine, reader TP size, expected consumers), for the codes in use."""

    __slots__ = ("_codes", "_free", "_refs", "engines", "expected", "tps")

    def __init__(self) -> None:
        self.engines: list[str | None] = [None]
        """The owner by code (``legacy:<peer>`` for stock peers); None for :data:`UNCLAIMED`."""
        self.tps: list[int] = [0]
        """The first claimer's TP size by code: whose ranks' dones count (0: unclaimed)."""
        self.expected: list[int] = [0]
        """Consumers expected to report done, by code."""
        self._refs = [0]
        self._codes: dict[tuple[str, int, int], int] = {}
        self._free: list[int] = []

    def acquire(self, engine: str, tp: int, expected: int) -> int:
        """The code of this claimer, counted once more."""
        key = (engine, tp, expected)
        code = self._codes.get(key)
        if code is None:
            if self._free:
                code = self._free.pop()
                self.engines[code], self.tps[code], self.expected[code] = key
            else:
                code = len(self.engines)
                self.engines.append(engine)
                self.tps.append(tp)
                self.expected.append(expected)
                self._refs.append(0)
            self._codes[key] = code
        self._refs[code] += 1
        return code

    def retain(self, code: int, times: int) -> None:
        """``times`` more leases name ``code`` (which :meth:`acquire` gave and is in use)."""
        self._refs[code] += times

    def release(self, code: int) -> None:
        """One lease no longer names ``code`` (:data:`UNCLAIMED` is not counted)."""
        if code == UNCLAIMED:
            return
        self._refs[code] -= 1
        if self._refs[code] == 0:
            engine = self.engines[code]
            assert engine is not None  # only UNCLAIMED has no engine
            del self._codes[(engine, self.tps[code], self.expected[code])]
            self.engines[code] = None
            self._free.append(code)

    def __len__(self) -> int:
        """Codes in use (UNCLAIMED not counted)."""
        return len(self._codes)
