"""The consistent-hash ring: determinism, minimal movement on membership change, balance, weights."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.hashing import hash_bytes, vnode_hash
from prefix_router.routing.ring import HashRing, Member

KEYS = [hash_bytes(i.to_bytes(8, "little")) for i in range(20_000)]
IDS = [f"http://10.0.1.{i}:8000" for i in range(12)]
U64 = st.integers(min_value=0, max_value=2**64 - 1)


def ring_of(ids: list[str], vnodes: int = 160, weights: dict[str, float] | None = None) -> HashRing:
    weights = weights or {}
    return HashRing([Member(i, weights.get(i, 1.0)) for i in ids], vnodes)


def primaries(ring: HashRing) -> list[str | None]:
    return [ring.primary(k) for k in KEYS]


def _reference_primary(ids: list[str], vnodes: int, key_hash: int) -> str:
    """The ring's definition, spelled out: the owner of the first vnode point at or after the key,
    wrapping round; a point two backends share goes to the smaller id."""
    owner: dict[int, str] = {}
    for backend in sorted(ids, reverse=True):
        for i in range(vnodes):
            owner[vnode_hash(backend, i)] = backend
    after = [p for p in owner if p >= key_hash]
    return owner[min(after) if after else min(owner)]


@settings(max_examples=200)
@given(
    st.integers(1, 40),
    st.integers(1, 12),
    # Any 64-bit hash, and the ends of the range, where the lookup's ranges of top bits begin and end.
    U64 | st.sampled_from([0, 1, 2**52, 2**63, 2**64 - 1]),
)
def test_primary_is_the_first_point_clockwise(vnodes: int, n: int, key_hash: int) -> None:
    ring = ring_of(IDS[:n], vnodes=vnodes)
    assert ring.primary(key_hash) == _reference_primary(IDS[:n], vnodes, key_hash)
    assert next(ring.walk(key_hash)) == ring.primary(key_hash)


def test_same_key_same_backend() -> None:
    a, b = ring_of(IDS[:5]), ring_of(IDS[:5])
    assert primaries(a) == primaries(b)
    assert all(a.primary(k) == a.primary(k) for k in KEYS[:100])


@settings(max_examples=30)
@given(st.permutations(IDS[:8]), st.lists(U64, min_size=1, max_size=20))
def test_member_order_does_not_matter(shuffled: list[str], hashes: list[int]) -> None:
    a, b = ring_of(IDS[:8], vnodes=20), ring_of(shuffled, vnodes=20)
    assert a.members == b.members == tuple(sorted(IDS[:8]))
    for h in hashes:
        assert a.primary(h) == b.primary(h)
        assert list(a.walk(h)) == list(b.walk(h))


@settings(max_examples=100)
@given(
    st.integers(1, 12),
    st.integers(1, 40),
    st.lists(st.sampled_from([0.01, 0.5, 1.0, 2.0, 3.5]), min_size=12, max_size=12),
    U64,
)
def test_walk_yields_each_member_exactly_once(n: int, vnodes: int, weights: list[float], h: int) -> None:
    ids = IDS[:n]
    ring = ring_of(ids, vnodes, dict(zip(ids, weights, strict=False)))
    walked = list(ring.walk(h))
    assert sorted(walked) == sorted(ids)
    assert walked[0] == ring.primary(h)
    assert len(ring) == n


def test_empty_ring() -> None:
    ring = HashRing([], 160)
    assert ring.primary(123) is None
    assert list(ring.walk(123)) == []
    assert len(ring) == 0
    assert ring.members == ()


@pytest.mark.parametrize("n", [pytest.param(n, id=f"n={n}") for n in (2, 5, 10)])
def test_removing_one_backend_moves_only_its_keys(n: int) -> None:
    before = primaries(ring_of(IDS[:n]))
    gone = IDS[n // 2]
    after = primaries(ring_of([i for i in IDS[:n] if i != gone]))
    moved = 0
    for old, new in zip(before, after, strict=True):
        if old == gone:
            assert new != gone
            moved += 1
        else:
            assert new == old
    assert 0.6 / n <= moved / len(KEYS) <= 1.5 / n


@pytest.mark.parametrize("n", [pytest.param(n, id=f"n={n}") for n in (1, 4, 9)])
def test_adding_one_backend_moves_keys_only_onto_it(n: int) -> None:
    before = primaries(ring_of(IDS[:n]))
    new_id = IDS[n]
    after = primaries(ring_of(IDS[: n + 1]))
    moved = sum(1 for old, new in zip(before, after, strict=True) if old != new)
    assert all(new in (old, new_id) for old, new in zip(before, after, strict=True))
    assert 0.6 / (n + 1) <= moved / len(KEYS) <= 1.5 / (n + 1)


def test_walk_after_removal_is_the_old_walk_without_it() -> None:
    full, less = ring_of(IDS[:6]), ring_of(IDS[:5])
    for h in KEYS[:500]:
        assert list(less.walk(h)) == [b for b in full.walk(h) if b != IDS[5]]


def test_balance_with_160_vnodes() -> None:
    counts = Counter(primaries(ring_of(IDS[:10])))
    mean = len(KEYS) / 10
    assert len(counts) == 10
    assert max(counts.values()) / mean <= 1.25
    assert min(counts.values()) / mean >= 0.75


def test_more_vnodes_balance_better() -> None:
    def spread(vnodes: int) -> float:
        counts = Counter(primaries(ring_of(IDS[:10], vnodes)))
        return max(counts.values()) / min(counts.values())

    assert spread(160) < spread(4)


@pytest.mark.parametrize("weight", [pytest.param(w, id=f"w={w}") for w in (2.0, 3.0)])
def test_weight_scales_share(weight: float) -> None:
    heavy = IDS[0]
    counts = Counter(primaries(ring_of(IDS[:8], weights={heavy: weight})))
    others = sum(v for k, v in counts.items() if k != heavy) / 7
    assert 0.75 * weight <= counts[heavy] / others <= 1.25 * weight


def test_tiny_weight_still_on_ring() -> None:
    ring = ring_of(IDS[:3], vnodes=10, weights={IDS[0]: 0.001})
    assert IDS[0] in ring.members
    assert sorted(ring.walk(0)) == sorted(IDS[:3])


@pytest.mark.parametrize(
    ("members", "vnodes"),
    [
        pytest.param([Member("a"), Member("a")], 10, id="duplicate"),
        pytest.param([Member("a"), Member("b", 2.0), Member("a", 3.0)], 10, id="duplicate-other-weight"),
        pytest.param([Member("a", 0.0)], 10, id="weight-zero"),
        pytest.param([Member("a", -1.0)], 10, id="weight-negative"),
        pytest.param([Member("a")], 0, id="vnodes-zero"),
        pytest.param([Member("a")], -5, id="vnodes-negative"),
        pytest.param([], 0, id="empty-vnodes-zero"),
    ],
)
def test_invalid_ring_raises(members: list[Member], vnodes: int) -> None:
    with pytest.raises(ValueError):
        HashRing(members, vnodes)
