"""spec/test-vectors.json: the code and the spec's formulas give every vector's output.

Each vector is checked twice: against kvproto's own functions, and against the
formula spec/wire-format.md writes (§1 the frame MAC, §2 the lease-set digest,
§3 the proofs and keys), computed here with hashlib alone. A peer written from
the spec and kvproto then agree byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvproto import auth, wire
from kvproto.ticket import claim_message, claim_proof, claim_prover

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[2] / "spec" / "test-vectors.json").read_text("utf-8")
)


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _b2b(data: bytes, key: bytes, size: int) -> bytes:
    """BLAKE2b with ``size`` bytes of output, keyed by ``key``'s first 64 bytes (its longest)."""
    return hashlib.blake2b(data, key=key[:64], digest_size=size).digest()


def _secret(v: dict[str, Any]) -> bytes | None:
    return None if v["auth_secret"] is None else bytes.fromhex(v["auth_secret"])


def _cases(name: str) -> list[Any]:
    return [pytest.param(v, id=f"{name}-{i}") for i, v in enumerate(VECTORS[name])]


def test_every_derivation_has_vectors() -> None:
    wanted = {
        "frame_mac",
        "hello_proof",
        "session_keys",
        "refusal_key",
        "claim_proof",
        "verdict_proof",
        "lease_set_digest",
    }
    assert wanted <= set(VECTORS)
    assert all(len(VECTORS[name]) >= 2 for name in wanted)


@pytest.mark.parametrize("v", _cases("frame_mac"))
def test_frame_mac(v: dict[str, Any]) -> None:
    key, signed = bytes.fromhex(v["key"]), bytes.fromhex(v["signed_bytes"])
    mac, frame = bytes.fromhex(v["mac"]), bytes.fromhex(v["frame"])
    assert _b2b(signed, key, 16) == mac and frame == signed + mac  # §1
    assert wire.mac(key, signed) == mac
    assert wire.verify(key, frame)
    assert wire.encode(wire.decode(frame, key), key) == frame


@pytest.mark.parametrize("v", _cases("hello_proof"))
def test_hello_proof(v: dict[str, Any]) -> None:
    token, nonce = bytes.fromhex(v["token"]), bytes.fromhex(v["nonce"])
    message = b"".join(
        (
            b"kvproto-hello\x00",
            v["reader_engine"].encode(),
            b"\x00",
            *(
                _u64(v[k])
                for k in (
                    "reader_rank",
                    "reader_tp",
                    "reader_incarnation",
                    "holder_rank",
                    "lease",
                    "attempt",
                )
            ),
            nonce,
        )
    )
    proof = bytes.fromhex(v["proof"])
    assert _b2b(message, token, 16) == proof  # §3
    got = auth.hello_proof(
        token,
        reader_engine=v["reader_engine"],
        reader_rank=v["reader_rank"],
        reader_tp=v["reader_tp"],
        reader_incarnation=v["reader_incarnation"],
        holder_rank=v["holder_rank"],
        lease=v["lease"],
        attempt=v["attempt"],
        nonce=nonce,
    )
    assert got == proof


@pytest.mark.parametrize("v", _cases("session_keys"))
def test_session_keys(v: dict[str, Any]) -> None:
    token, secret = bytes.fromhex(v["token"]), _secret(v)
    nonce, server_nonce = bytes.fromhex(v["nonce"]), bytes.fromhex(v["server_nonce"])
    message = b"".join(
        (
            b"kvproto-session\x00",
            v["reader_engine"].encode(),
            b"\x00",
            v["holder_engine"].encode(),
            b"\x00",
            _u64(v["reader_rank"]),
            _u64(v["reader_incarnation"]),
            _u64(v["holder_rank"]),
            _u64(v["holder_incarnation"]),
            nonce,
            server_nonce,
        )
    )
    master = _b2b(message, token, 32)  # §3
    if secret is not None:
        master = _b2b(master, secret, 32)
    up, down = bytes.fromhex(v["up"]), bytes.fromhex(v["down"])
    assert (_b2b(b"up", master, 16), _b2b(b"down", master, 16)) == (up, down)
    got = auth.session_keys(
        token,
        reader_engine=v["reader_engine"],
        reader_rank=v["reader_rank"],
        reader_incarnation=v["reader_incarnation"],
        holder_engine=v["holder_engine"],
        holder_rank=v["holder_rank"],
        holder_incarnation=v["holder_incarnation"],
        nonce=nonce,
        server_nonce=server_nonce,
        secret=secret,
    )
    assert got == (up, down)


@pytest.mark.parametrize("v", _cases("refusal_key"))
def test_refusal_key(v: dict[str, Any]) -> None:
    token, nonce, secret = bytes.fromhex(v["token"]), bytes.fromhex(v["nonce"]), _secret(v)
    key = _b2b(b"kvproto-refusal\x00" + nonce, token, 32)  # §3: 32 bytes, then the first 16
    if secret is not None:
        key = _b2b(key, secret, 32)
    assert key[:16] == bytes.fromhex(v["key"])
    assert auth.refusal_key(token, nonce, secret) == bytes.fromhex(v["key"])


def test_the_refusal_key_is_not_a_128_bit_blake2b() -> None:
    """BLAKE2b's output size is one of its parameters: a 16-byte digest is not the first 16
    bytes of a 32-byte one, so the spec must say which (it says the latter)."""
    v = VECTORS["refusal_key"][0]
    token, nonce = bytes.fromhex(v["token"]), bytes.fromhex(v["nonce"])
    assert _b2b(b"kvproto-refusal\x00" + nonce, token, 16) != bytes.fromhex(v["key"])


@pytest.mark.parametrize("v", _cases("claim_proof"))
def test_claim_proof(v: dict[str, Any]) -> None:
    token, engine, lease = bytes.fromhex(v["token"]), v["reader_engine"], v["lease"]
    message = b"kvproto-claim\x00" + engine.encode() + b"\x00" + _u64(lease)
    proof = bytes.fromhex(v["proof"])
    assert message == bytes.fromhex(v["message"]) and _b2b(message, token, 16) == proof  # §2
    assert claim_message(engine)(lease) == message
    assert claim_prover(engine)(token, lease) == claim_proof(token, engine, lease) == proof


@pytest.mark.parametrize("v", _cases("verdict_proof"))
def test_verdict_proof(v: dict[str, Any]) -> None:
    token, engine = bytes.fromhex(v["token"]), v["reader_engine"]
    rank, lease, verdict = v["reader_rank"], v["lease"], v["verdict"]
    message = b"".join(
        (b"kvproto-verdict\x00", engine.encode(), b"\x00", _u64(rank), _u64(lease), _u64(verdict))
    )
    proof = bytes.fromhex(v["proof"])
    assert _b2b(message, token, 16) == proof  # §3
    assert auth.verdict_prover(engine, rank)(token, lease, verdict) == proof
    one = auth.verdict_proof(
        token, lease=lease, verdict=verdict, reader_engine=engine, reader_rank=rank
    )
    assert one == proof


@pytest.mark.parametrize("v", _cases("lease_set_digest"))
def test_lease_set_digest(v: dict[str, Any]) -> None:
    spec = sum(lease * 0x9E3779B97F4A7C15 % 2**64 for lease in v["leases"]) % 2**64  # §2
    assert spec == wire.digest(v["leases"]) == v["digest"]
