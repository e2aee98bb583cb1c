"""THE hash every router replica must agree on.

xxh3_64 with a fixed seed. Changing anything here moves every key in every deployment at once, so
the golden vectors in tests/routing/test_routing_hashing.py pin it: a change must be a visible,
reviewed break.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

HASH_SEED = 0x5052_4546_4958  # "PREFIX"; fixed forever: replicas of every version must agree
_MASK64 = (1 << 64) - 1


def hash_bytes(data: bytes) -> int:
    """64-bit hash of raw bytes."""
    return xxhash.xxh3_64_intdigest(data, HASH_SEED)


def encode_parts(*parts: bytes) -> bytes:
    """Byte strings joined unambiguously: each part length-prefixed (8 bytes, little-endian)."""
    buf = bytearray()
    for part in parts:
        buf += len(part).to_bytes(8, "little")
        buf += part
    return bytes(buf)


def hash_parts(*parts: bytes) -> int:
    """Hash of a sequence of byte strings, unambiguously encoded."""
    return xxhash.xxh3_64_intdigest(encode_parts(*parts), HASH_SEED)


def prefix_hashes(root: bytes, data: bytes, ends: Sequence[int]) -> list[int]:
    """hash(root + data[:end]) for each end within data, in one streaming pass.

    A hash of the whole prefix is a chain by construction (equal hashes imply equal prefixes), and
    the running state costs one update per block with no copies: 32 blocks of a 32 KB body in a few µs.
    """
    state = xxhash.xxh3_64(seed=HASH_SEED)
    update, digest = state.update, state.intdigest
    update(root)
    view = memoryview(data)
    out: list[int] = []
    append = out.append
    start = 0
    size = len(data)
    for end in ends:
        if end > size:
            break
        update(view[start:end])
        append(digest())
        start = end
    return out


def chain_hash(parent: int, block: bytes) -> int:
    """Hash of a block given its parent's hash: a prefix chain, as vLLM's block hashes are."""
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + block, HASH_SEED)


def vnode_hash(backend_id: str, index: int) -> int:
    """Ring position of a backend's `index`-th virtual node; the id is the backend's URL."""
    return hash_bytes(f"{backend_id}\x00{index}".encode())


def mix(a: int, b: int) -> int:
    """Combine two 64-bit hashes (order matters)."""
    return hash_bytes((a & _MASK64).to_bytes(8, "little") + (b & _MASK64).to_bytes(8, "little"))
