"""Session keys with zero configuration: every control frame proves the ticket.

The only secret a reader and a holder share without an operator is a lease
token: the holder minted it, and the reader received it with the request
through the router (``kv_transfer_params``), never over the notification
channel. A session is keyed by one such token, the *anchor*:

* The reader's Hello names a lease it tracks for this holder and carries
  :func:`hello_proof`, a keyed hash of the Hello's fields under that lease's
  token. A holder opens or re-keys a session only for a Hello whose anchor
  it holds (live, not owned by another engine) and whose proof is right.
* Both sides derive the session's two directional keys with
  :func:`session_keys` from the anchor token, both engines' names, ranks and
  incarnations and both nonces (the Hello's and the Welcome's). Every frame
  after the Hello carries a 16-byte keyed BLAKE2b MAC under the key of its
  direction: Welcome, heartbeat (claims, aborts), done, ack, revoke, reject.
* The key outlives its anchor lease: it is a value both sides hold, not a
  reference to the lease, so the anchor's end changes nothing. A new Hello
  (a retry, a restart of either side) derives a new key from fresh nonces.
* With ``auth_secret`` set the keys are also keyed by the secret (an
  operator-supplied second layer): a forger then needs a token *and* the
  secret.

Cost: a heartbeat covering any number of leases is one MAC over a few dozen
bytes on each side; the per-lease proofs (claims, dones) are unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable

KEY_BYTES = 16
PROOF_BYTES = 16


def _u64(value: int) -> bytes:
    return (value & (2**64 - 1)).to_bytes(8, "big")


def hello_proof(
    token: bytes,
    *,
    reader_engine: str,
    reader_rank: int,
    reader_tp: int,
    reader_incarnation: int,
    holder_rank: int,
    lease: int,
    attempt: int,
    nonce: bytes,
) -> bytes:
    """Proof that the sender of this Hello knows ``lease``'s token.

    Bound to every field a holder acts on, and to the holder rank it is
    addressed to, so a Hello seen on the wire is useless under another name,
    rank, incarnation or attempt number.
    """
    data = b"".join(
        (
            b"kvproto-hello\x00",
            reader_engine.encode(),
            b"\x00",
            _u64(reader_rank),
            _u64(reader_tp),
            _u64(reader_incarnation),
            _u64(holder_rank),
            _u64(lease),
            _u64(attempt),
            nonce,
        )
    )
    return hashlib.blake2b(data, key=token, digest_size=PROOF_BYTES).digest()


def session_keys(
    token: bytes,
    *,
    reader_engine: str,
    reader_rank: int,
    reader_incarnation: int,
    holder_engine: str,
    holder_rank: int,
    holder_incarnation: int,
    nonce: bytes,
    server_nonce: bytes,
    secret: bytes | None,
) -> tuple[bytes, bytes]:
    """(reader→holder key, holder→reader key) of one session.

    Two keys, so a frame can never be reflected back to its sender as if the
    peer had sent it.
    """
    data = b"".join(
        (
            b"kvproto-session\x00",
            reader_engine.encode(),
            b"\x00",
            holder_engine.encode(),
            b"\x00",
            _u64(reader_rank),
            _u64(reader_incarnation),
            _u64(holder_rank),
            _u64(holder_incarnation),
            nonce,
            server_nonce,
        )
    )
    master = hashlib.blake2b(data, key=token, digest_size=32).digest()
    if secret is not None:
        master = hashlib.blake2b(master, key=secret[:64], digest_size=32).digest()
    up = hashlib.blake2b(b"up", key=master, digest_size=KEY_BYTES).digest()
    down = hashlib.blake2b(b"down", key=master, digest_size=KEY_BYTES).digest()
    return up, down


def refusal_key(token: bytes, nonce: bytes, secret: bytes | None) -> bytes:
    """Key of a holder's Reject answering a Hello (before any session key exists).

    The holder checked the Hello's anchor, so it can prove the refusal to the
    reader with the same token: a forged refusal would otherwise break a
    reader's session and fail its requests. The first 16 bytes of a 32-byte
    BLAKE2b (not a 16-byte BLAKE2b: the output size is a parameter of the hash),
    keyed by ``secret`` too when set, as the session keys are
    (spec/wire-format.md §3, spec/test-vectors.json).
    """
    key = hashlib.blake2b(b"kvproto-refusal\x00" + nonce, key=token, digest_size=32).digest()
    if secret is not None:
        key = hashlib.blake2b(key, key=secret[:64], digest_size=32).digest()
    return key[:KEY_BYTES]


_VERDICT_DOMAIN = b"kvproto-verdict\x00"


def verdict_prover(
    reader_engine: str, reader_rank: int
) -> Callable[[bytes | bytearray, int, int], bytes]:
    """The verdict proof for one reader rank: ``prove(token, lease, verdict)``.

    The per-lease proof on a DoneAck: only the lease's token can vouch for a
    read. The session MAC already authenticates the ack; this binds the verdict
    to the lease itself, so a session key learnt from one stolen anchor ticket
    still cannot make a reader trust a read of any other lease.

    The message is ``"kvproto-verdict\\0" || reader_engine || "\\0" ||
    u64(reader_rank) || u64(lease) || u64(verdict)`` (big-endian), hashed with
    BLAKE2b-128 keyed by the token. The holder proves and the reader checks with
    the prover of the reader's engine and rank, made once: its engine and rank
    part is packed once, and each message is one C call (a struct pack of that
    part, the lease and the verdict).
    """
    head = _VERDICT_DOMAIN + reader_engine.encode() + b"\x00" + _u64(reader_rank)
    message = functools.partial(struct.Struct(f">{len(head)}sQQ").pack, head)
    blake2b = hashlib.blake2b

    def prove(token: bytes | bytearray, lease: int, verdict: int) -> bytes:
        return blake2b(message(lease, verdict), key=token, digest_size=PROOF_BYTES).digest()

    return prove


def verdict_proof(
    token: bytes, *, lease: int, verdict: int, reader_engine: str, reader_rank: int
) -> bytes:
    """One verdict proof (:func:`verdict_prover`'s), for a caller proving just one."""
    return verdict_prover(reader_engine, reader_rank)(token, lease, verdict)
