"""Golden vectors for THE hash, the routing key built on it, and the ring placement built on both.

DO NOT "FIX" THESE NUMBERS. They were computed once from the code and hard-coded on purpose: every router
replica of every version must place a key on the same backend, so any change to the hash function, its
seed, its input encoding, the key material or the vnode layout must show up here as a failing test and
go through review as a deliberate, announced break (a rolling upgrade would split the fleet's caches).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.routing.config import KeyConfig
from prefix_router.routing.hashing import (
    HASH_SEED,
    chain_hash,
    encode_parts,
    hash_bytes,
    hash_parts,
    mix,
    vnode_hash,
)
from prefix_router.routing.keys import KeySource, extract_key
from prefix_router.routing.ring import HashRing, Member

U64 = st.integers(min_value=0, max_value=2**64 - 1)


def test_seed_is_pinned() -> None:
    assert HASH_SEED == 0x5052_4546_4958


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"", 0xC35C7AD0E15FBD0C, id="empty"),
        pytest.param(b"a", 0xDC9E11FC28635613, id="a"),
        pytest.param(b"hello world", 0x0CE432445088B052, id="hello-world"),
        pytest.param(bytes(range(256)), 0x5D0739B41E2F2C12, id="all-bytes"),
        pytest.param("é".encode(), 0x389068D2CC2FE710, id="utf8-e-acute"),
    ],
)
def test_hash_bytes_golden(data: bytes, expected: int) -> None:
    assert hash_bytes(data) == expected


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        pytest.param((), 0xC35C7AD0E15FBD0C, id="no-parts"),
        pytest.param((b"",), 0x9DF491E7594888FF, id="one-empty"),
        pytest.param((b"", b""), 0x455B6DF316542630, id="two-empty"),
        pytest.param((b"ab", b"c"), 0xB15738AD11B676B5, id="ab|c"),
        pytest.param((b"a", b"bc"), 0xA30768E1B9E4AFC5, id="a|bc"),
        pytest.param((b"tenant", b"model", b"text"), 0x705E7CA2AF322AA3, id="tenant-model-text"),
    ],
)
def test_hash_parts_golden(parts: tuple[bytes, ...], expected: int) -> None:
    assert hash_parts(*parts) == expected


# Block hashes key this replica's prefix index only (never another process's state), so unlike the
# values above they may change without splitting a fleet; pinned all the same, so that they change
# only on purpose. Last changed when the chain went from a running state to a parent-seeded hash.
@pytest.mark.parametrize(
    ("parent", "block", "expected"),
    [
        pytest.param(0, b"", 0x2D06800538D394C2, id="zero-empty"),
        pytest.param(0, b"block", 0xE7ED2FEFD19454A3, id="zero-block"),
        pytest.param(2**64 - 1, b"x" * 256, 0x468FA2BAEA99CBC1, id="max-parent-256"),
        pytest.param(12345, b"abc", 0x717E64EAFD9A85D0, id="small-parent"),
    ],
)
def test_chain_hash_golden(parent: int, block: bytes, expected: int) -> None:
    assert chain_hash(parent, block) == expected


@pytest.mark.parametrize(
    ("backend_id", "index", "expected"),
    [
        pytest.param("http://10.0.0.1:8000", 0, 0xB14694CB4879BBD8, id="b1-0"),
        pytest.param("http://10.0.0.1:8000", 1, 0xB58A72A9945296AE, id="b1-1"),
        pytest.param("http://10.0.0.2:8000", 159, 0x919B3C0B7616BAD0, id="b2-159"),
        pytest.param("", 0, 0xBC918CB8F24CE454, id="empty-id"),
    ],
)
def test_vnode_hash_golden(backend_id: str, index: int, expected: int) -> None:
    assert vnode_hash(backend_id, index) == expected


def test_vnode_hash_is_the_documented_encoding() -> None:
    # DESIGN.md §3: vnode input f"{backend_id}\x00{i}", UTF-8.
    assert vnode_hash("http://b:1", 7) == hash_bytes(b"http://b:1\x007")


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param(0, 0, 0x455B6DF316542630, id="zeros"),
        pytest.param(1, 2, 0x4B879A92DF6A4EE2, id="1-2"),
        pytest.param(2, 1, 0x676117262B9C6298, id="2-1"),
        pytest.param(2**64 - 1, 2**63, 0x10745F5CF63EA478, id="max-half"),
        pytest.param(-1, 5, 0x0CD6ABD74419F993, id="negative-masked"),
    ],
)
def test_mix_golden(a: int, b: int, expected: int) -> None:
    assert mix(a, b) == expected


def test_mix_masks_to_64_bits() -> None:
    assert mix(-1, 5) == mix(2**64 - 1, 5)


def test_hash_parts_is_unambiguous() -> None:
    assert hash_parts(b"ab", b"c") != hash_parts(b"a", b"bc")
    assert hash_parts(b"", b"x") != hash_parts(b"x", b"")
    assert hash_parts(b"x") != hash_parts(b"x", b"")
    assert hash_parts(b"abc") != hash_bytes(b"abc")


@given(st.lists(st.binary(max_size=12), max_size=4), st.lists(st.binary(max_size=12), max_size=4))
def test_hash_parts_distinct_part_lists_hash_distinctly(a: list[bytes], b: list[bytes]) -> None:
    # Length-prefixing makes the encoding injective, so equal hashes mean equal part lists (short of a
    # 2^-64 collision, which hypothesis will not find).
    assert (hash_parts(*a) == hash_parts(*b)) == (a == b)


@given(U64, U64)
def test_hashes_are_64_bit(a: int, b: int) -> None:
    for value in (mix(a, b), chain_hash(a, b"x"), hash_bytes(a.to_bytes(8, "little"))):
        assert 0 <= value < 2**64


def test_mix_is_order_sensitive() -> None:
    assert mix(1, 2) != mix(2, 1)


# -- the routing key built on the hash -------------------------------------------------------------

CHAT_BODY = (
    b'{"model":"llama-3-8b","messages":[{"role":"system","content":"You are terse."},'
    b'{"role":"user","content":"Hello"}],"temperature":0.2}'
)
LONG_CHAT_BODY = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 600 + b'"}]}'
NATIVE_BODY = b'{"prompt":"Once upon a time","max_tokens":16}'


@pytest.mark.parametrize(
    ("path", "body", "tenant", "source", "expected"),
    [
        pytest.param(
            "/v1/chat/completions", CHAT_BODY, None, KeySource.OPENAI, 0x4528183D0C5538CD, id="chat"
        ),
        pytest.param(
            "/v1/chat/completions", CHAT_BODY, "acme", KeySource.OPENAI, 0x23FD32C484306CE4, id="chat-tenant"
        ),
        pytest.param("/generate", NATIVE_BODY, None, KeySource.NATIVE, 0x165168521613117A, id="native"),
        pytest.param("/generate", b"\xff\xfe not json", None, KeySource.RAW, 0x800763C36D49C735, id="raw"),
    ],
)
def test_extract_key_ring_hash_golden(
    path: str, body: bytes, tenant: str | None, source: KeySource, expected: int
) -> None:
    key = extract_key(path, body, tenant, KeyConfig())
    assert key.source is source
    assert key.ring_hash == expected


def test_extract_key_blocks_golden() -> None:
    key = extract_key("/v1/chat/completions", LONG_CHAT_BODY, None, KeyConfig())
    assert key.ring_hash == 0xA09DE42E7B48399C
    # Block hashes: a chain seeded by hash(tenant, model), one link per block of the key text.
    assert key.blocks == (0xC330DD6F61FBFFAB, 0x1E0507CE7970A1E3)
    text = b"\x1euser\x1f" + b"x" * 600
    first = chain_hash(hash_bytes(encode_parts(b"", b"m")), text[:256])
    assert key.blocks == (first, chain_hash(first, text[256:512]))


# -- ring placement built on the hash --------------------------------------------------------------

FOUR = [Member(f"http://10.0.0.{i}:8000") for i in range(1, 5)]


def _b(i: int) -> str:
    return f"http://10.0.0.{i}:8000"


@pytest.mark.parametrize(
    ("key_hash", "expected"),
    [
        pytest.param(0x0123456789ABCDEF, _b(1), id="0x0"),
        pytest.param(0x1123456789ABCDEF, _b(4), id="0x1"),
        pytest.param(0x2123456789ABCDEF, _b(2), id="0x2"),
        pytest.param(0x8123456789ABCDEF, _b(3), id="0x8"),
        pytest.param(0x9123456789ABCDEF, _b(3), id="0x9"),
        pytest.param(0xB123456789ABCDEF, _b(1), id="0xb"),
        pytest.param(0xF123456789ABCDEF, _b(4), id="0xf"),
        pytest.param(0, _b(1), id="zero"),
        pytest.param(2**64 - 1, _b(1), id="max-wraps"),
        pytest.param(0xDEADBEEFCAFEBABE, _b(4), id="deadbeef"),
    ],
)
def test_ring_primary_golden(key_hash: int, expected: str) -> None:
    ring = HashRing(FOUR, vnodes=160)
    assert ring.primary(key_hash) == expected
    assert next(ring.walk(key_hash)) == expected


def test_ring_walk_golden() -> None:
    ring = HashRing(FOUR, vnodes=160)
    assert list(ring.walk(0x8123456789ABCDEF)) == [_b(3), _b(2), _b(4), _b(1)]
