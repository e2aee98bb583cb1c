"""THE hash every router replica must agree on.

xxh3_64 with a fixed seed. Changing anything here moves every key in every deployment at once, so
the golden vectors in tests/routing/test_routing_hashing.py pin it: a change must be a visible,
reviewed break.
"""

from __future__ import annotations

import xxhash

HASH_SEED = 0x5052_4546_4958  # "PREFIX"; fixed forever: replicas of every version must agree
_MASK64 = (1 << 64) - 1


def hash_bytes(data: bytes) -> int:
    """64-bit hash of raw bytes."""
    return xxhash.xxh3_64_intdigest(data, HASH_SEED)


def hash_parts(*parts: bytes) -> int:
    """Hash a sequence of byte strings unambiguously: each part is length-prefixed (8 bytes, LE)."""
    buf = bytearray()
    for part in parts:
        buf += len(part).to_bytes(8, "little")
        buf += part
    return xxhash.xxh3_64_intdigest(bytes(buf), HASH_SEED)


def chain_hash(parent: int, block: bytes) -> int:
    """Hash of a block given its parent's hash: a prefix chain, as vLLM's block hashes are."""
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + block, HASH_SEED)


def vnode_hash(backend_id: str, index: int) -> int:
    """Ring position of a backend's `index`-th virtual node; the id is the backend's URL."""
    return hash_bytes(f"{backend_id}\x00{index}".encode())


def mix(a: int, b: int) -> int:
    """Combine two 64-bit hashes (order matters)."""
    return hash_bytes((a & _MASK64).to_bytes(8, "little") + (b & _MASK64).to_bytes(8, "little"))
