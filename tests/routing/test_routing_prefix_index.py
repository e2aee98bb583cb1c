"""The bounded longest-prefix index: longest match, LRU bound, owner cap, prefix-closed eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.hashing import chain_hash
from prefix_router.routing.prefix_index import MAX_OWNERS, PrefixIndex


def chain(*labels: str) -> list[int]:
    """Chained block hashes, as keys.py builds them: each one implies its parents."""
    out, parent = [], 0
    for label in labels:
        parent = chain_hash(parent, label.encode())
        out.append(parent)
    return out


A = chain("s", "a1", "a2", "a3")
B = chain("s", "a1", "b2")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param(A, (4, ("x",)), id="whole-chain"),
        pytest.param([*A, *chain("more")], (4, ("x",)), id="longer-than-known"),
        pytest.param(A[:3], (3, ("x",)), id="shorter"),
        pytest.param(A[:2], (2, ("x", "y")), id="shared-part"),
        pytest.param(B, (3, ("y",)), id="branch"),
        pytest.param(chain("s", "a1", "zz"), (2, ("x", "y")), id="diverges-after-shared"),
        pytest.param(chain("other"), (0, ()), id="unknown"),
        pytest.param([], (0, ()), id="empty"),
    ],
)
def test_longest_match(query: list[int], expected: tuple[int, tuple[str, ...]]) -> None:
    index = PrefixIndex(100)
    index.record(A, "x")
    index.record(B, "y")
    assert index.longest_match(query) == expected


@settings(max_examples=100)
@given(st.integers(1, 40), st.integers(0, 40))
def test_longest_match_equals_linear_scan(known: int, extra: int) -> None:
    blocks = chain(*(str(i) for i in range(known + extra)))
    index = PrefixIndex(1000)
    index.record(blocks[:known], "x")
    assert index.longest_match(blocks) == (known, ("x",))


def test_lru_bound_respected() -> None:
    index = PrefixIndex(10)
    for i in range(50):
        index.record(chain(f"c{i}", "b"), "x")
        assert len(index) <= 10
    assert len(index) == 10
    assert index.longest_match(chain("c49", "b")) == (2, ("x",))
    assert index.longest_match(chain("c0", "b")) == (0, ())


def test_invalid_size() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_hot_prefix_records_up_to_max_owners() -> None:
    index = PrefixIndex(100)
    backends = [f"b{i}" for i in range(MAX_OWNERS + 2)]
    for b in backends:
        index.record(A, b)
    # The first holder stays first; the last place goes to the newest one.
    assert index.longest_match(A) == (4, (*backends[: MAX_OWNERS - 1], backends[-1]))
    assert MAX_OWNERS == 4


def test_rerecording_an_owner_keeps_the_order_without_duplicating() -> None:
    index = PrefixIndex(100)
    for b in ("b1", "b2", "b3"):
        index.record(A, b)
    index.record(A, "b1")
    assert index.longest_match(A) == (4, ("b1", "b2", "b3"))
    index.record(A, "b3")
    assert index.longest_match(A) == (4, ("b1", "b2", "b3"))


def test_eviction_trims_from_the_tail() -> None:
    index = PrefixIndex(3)
    blocks = chain("1", "2", "3", "4", "5", "6")
    index.record(blocks, "x")
    assert len(index) == 3
    assert index.longest_match(blocks) == (3, ("x",))  # the shallow three stayed


def test_reuse_of_a_shared_prefix_protects_it() -> None:
    index = PrefixIndex(5)
    index.record(A, "x")  # 4 entries
    index.record(B, "y")  # b2 added: 5 entries; s, a1 refreshed
    index.record(chain("new"), "z")  # one must go: the least recent, a deep block of A
    assert index.longest_match(A)[0] == 3
    assert index.longest_match(B)[0] == 3


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 8), st.sampled_from("xyz")),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 12),
)
def test_known_blocks_always_imply_their_parents(records: list[tuple[int, int, str]], size: int) -> None:
    # Four base conversations sharing their first block, recorded at various depths in any order.
    bases = [chain("shared", *(f"{root}-{i}" for i in range(8))) for root in range(4)]
    index = PrefixIndex(size)
    for root, depth, backend in records:
        index.record(bases[root][:depth], backend)
        assert len(index) <= size
        for base in bases:
            known = [b in index._entries for b in base]  # white-box: the index keeps no other view
            depth_known = known.index(False) if False in known else len(known)
            assert not any(known[depth_known:]), "a deep block outlived its parent"
            assert index.longest_match(base)[0] == depth_known


def test_forget_backend() -> None:
    index = PrefixIndex(100)
    index.record(A, "x")
    index.record(A[:2], "y")
    index.forget_backend("x")
    assert index.longest_match(A) == (2, ("y",))
    index.forget_backend("y")
    assert index.longest_match(A) == (0, ())
    # Nobody holds the blocks now, but a request that carries them still continues a known prompt.
    assert index.seen_depth(A, 0) == len(A)


def test_aged_out_blocks_stay_seen_until_the_index_bound_evicts_them() -> None:
    index = PrefixIndex(len(A) + 2)
    index.record(A, "x")
    index.record(A[:2], "y")
    for block in A[1:]:
        index.forget_owner(block, "x")
    index.forget_owner(A[1], "y")
    # Held: only the first block (x and y); seen: all of A.
    assert index.longest_match(A) == (1, ("x", "y"))
    assert index.seen_depth(A, 1) == len(A)
    assert index.seen_depth([*A[:3], 12345], 1) == 3  # a new block past the seen ones
    assert index.seen_depth([12345], 0) == 0
    # Learning other prompts evicts the least recently recorded: the deep, aged-out blocks of A.
    index.record([777, 778, 779], "z")
    assert index.seen_depth(A, 1) == len(A) - 1
    index.record(A, "y")  # placed again: held again
    assert index.longest_match(A) == (len(A), ("y",))


def test_a_prompts_end_names_the_backend_that_took_it_last() -> None:
    index = PrefixIndex(2)
    assert index.prompt_taker(11) is None
    index.record_prompt_end(11, "x")
    index.record_prompt_end(11, "y")  # the same prompt again, elsewhere: the last taker counts
    assert index.prompt_taker(11) == "y"
    index.record_prompt_end(12, "x")
    index.record_prompt_end(11, "y")  # used again: the most recent
    index.record_prompt_end(13, "z")  # over the bound: the least recently recorded goes
    assert (index.prompt_taker(11), index.prompt_taker(12), index.prompt_taker(13)) == ("y", None, "z")
    index.forget_backend("y")
    assert index.prompt_taker(11) is None and index.prompt_taker(13) == "z"


def test_a_block_counts_the_new_ways_prompts_went_on_from_it() -> None:
    index = PrefixIndex(100)
    system = chain("s1", "s2")
    index.record(chain("s1", "s2", "c1", "c1b"), "x")
    assert index.branches(system[-1]) == 0  # one prompt so far: nothing branched
    index.record(chain("s1", "s2", "c1", "c1b", "c1c"), "x")  # the same prompt continued
    assert index.branches(system[-1]) == 0
    assert index.branches(chain("s1", "s2", "c1", "c1b")[-1]) == 1
    index.record(chain("s1", "s2", "c2"), "y")  # another conversation after the system prompt
    index.record(chain("s1", "s2", "c3"), "x")
    assert index.branches(system[-1]) == 2
    index.record(chain("s1", "s2", "c3"), "y")  # the same prompt again: no new way
    assert index.branches(system[-1]) == 2
