"""The prefix-cache model against the vLLM behaviours it claims to follow."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.sim.cache import BlockAllocation, PrefixCache, hash_prompt_blocks
from prefix_router.sim.tokens import BYTES_PER_TOKEN, Prompt


def prompt_of(tag: str, num_tokens: int) -> Prompt:
    """A prompt of exactly num_tokens tokens whose content depends on tag."""
    text = (tag * (num_tokens * BYTES_PER_TOKEN))[: num_tokens * BYTES_PER_TOKEN]
    return Prompt(text.encode())


def run_to_end(cache: PrefixCache, prompt: Prompt, salt: str | None = None) -> int:
    """Admit, prefill and finish one request; returns its cached tokens."""
    allocation = admit(cache, prompt, salt)
    cache.commit(allocation)
    cache.release(allocation)
    return allocation.hit_blocks * cache.block_size


def admit(cache: PrefixCache, prompt: Prompt, salt: str | None = None) -> BlockAllocation:
    allocation = cache.allocate(hash_prompt_blocks(prompt, cache.block_size, salt), prompt.num_tokens)
    assert allocation is not None
    return allocation


@given(num_tokens=st.integers(min_value=1, max_value=300), block_size=st.sampled_from([1, 2, 4, 16]))
def test_repeated_prompt_hits_all_full_blocks_before_the_last_token(num_tokens: int, block_size: int) -> None:
    cache = PrefixCache(block_size=block_size, capacity_blocks=1000)
    prompt = prompt_of("ab", num_tokens)
    assert run_to_end(cache, prompt) == 0
    assert run_to_end(cache, prompt) == (num_tokens - 1) // block_size * block_size


@pytest.mark.parametrize(
    ("first_salt", "second_salt"),
    [
        pytest.param("tenant-a", "tenant-b", id="different-salts"),
        pytest.param(None, "tenant-a", id="unsalted-then-salted"),
        pytest.param("tenant-a", None, id="salted-then-unsalted"),
    ],
)
def test_cache_salt_isolates_identical_prompts(first_salt: str | None, second_salt: str | None) -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    prompt = prompt_of("x", 40)
    run_to_end(cache, prompt, first_salt)
    assert run_to_end(cache, prompt, second_salt) == 0
    assert run_to_end(cache, prompt, second_salt) == 36


def test_salt_is_mixed_into_the_first_block_only() -> None:
    prompt = prompt_of("x", 12)
    plain = hash_prompt_blocks(prompt, 4)
    salted = hash_prompt_blocks(prompt, 4, "s")
    assert plain[0] != salted[0]
    # Later blocks differ only through the chain, because their parent differs.
    assert plain[1:] != salted[1:]
    assert hash_prompt_blocks(prompt, 4, "s") == salted


def test_prompts_sharing_a_prefix_share_its_full_blocks() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    shared = "s" * (12 * BYTES_PER_TOKEN)  # 3 full blocks
    run_to_end(cache, Prompt((shared + "first question, long enough").encode()))
    assert run_to_end(cache, Prompt((shared + "second one, different tail").encode())) == 12


def test_block_hashes_chain_so_a_changed_block_misses_everything_after_it() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    run_to_end(cache, Prompt(b"A" * 16 + b"B" * 16 + b"C" * 16 + b"D"))
    assert run_to_end(cache, Prompt(b"A" * 16 + b"X" * 16 + b"C" * 16 + b"D")) == 4


def test_partial_blocks_are_not_cached() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    run_to_end(cache, prompt_of("p", 10))  # two full blocks and half of a third
    assert cache.num_cached_blocks == 2
    assert len(hash_prompt_blocks(prompt_of("p", 10), 4)) == 2


def test_lru_evicts_the_least_recently_used_prompt() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=4)
    oldest, newer, newest = prompt_of("a", 8), prompt_of("b", 8), prompt_of("c", 8)
    run_to_end(cache, oldest)
    run_to_end(cache, newer)
    run_to_end(cache, newest)  # the pool holds 4 blocks: the oldest prompt's go
    assert not any(cache.is_cached(h) for h in hash_prompt_blocks(oldest, 4))
    assert all(cache.is_cached(h) for h in hash_prompt_blocks(newer, 4))
    assert all(cache.is_cached(h) for h in hash_prompt_blocks(newest, 4))


def test_a_hit_refreshes_recency() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=4)
    first, second = prompt_of("a", 8), prompt_of("b", 8)
    run_to_end(cache, first)
    run_to_end(cache, second)
    assert run_to_end(cache, first) == 4  # touched: now the most recent
    run_to_end(cache, prompt_of("c", 8))
    assert cache.is_cached(hash_prompt_blocks(first, 4)[0])
    assert not cache.is_cached(hash_prompt_blocks(second, 4)[0])


def test_a_finished_prompt_is_evicted_tail_first() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=2)
    prompt = prompt_of("a", 8)
    head, tail = hash_prompt_blocks(prompt, 4)
    run_to_end(cache, prompt)
    run_to_end(cache, prompt_of("z", 3))  # needs one block: the tail goes, the head stays
    assert cache.is_cached(head)
    assert not cache.is_cached(tail)


def test_blocks_of_running_requests_are_never_evicted() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=2)
    running = admit(cache, prompt_of("a", 8))
    cache.commit(running)
    hashes = hash_prompt_blocks(prompt_of("b", 8), 4)
    assert cache.allocate(hashes, 8) is None
    assert cache.usage == 1.0
    cache.release(running)
    assert cache.usage == 0.0
    assert cache.allocate(hashes, 8) is not None


def test_identical_prompts_prefilling_together_both_miss_then_share() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=10)
    prompt = prompt_of("a", 9)
    first, second = admit(cache, prompt), admit(cache, prompt)
    assert first.hit_blocks == second.hit_blocks == 0
    assert cache.num_used_blocks == 6
    cache.commit(first)
    cache.commit(second)
    assert cache.num_used_blocks == 4  # two shared full blocks + two private partial blocks
    cache.release(first)
    cache.release(second)
    assert cache.num_used_blocks == 0
    assert cache.num_cached_blocks == 2


def test_abort_before_prefill_caches_nothing() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=10)
    allocation = admit(cache, prompt_of("a", 16))
    cache.release(allocation)
    cache.release(allocation)  # idempotent
    assert cache.num_cached_blocks == 0
    assert cache.num_used_blocks == 0


def test_clear_drops_unreferenced_blocks_only() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=10)
    run_to_end(cache, prompt_of("a", 8))
    running = admit(cache, prompt_of("b", 8))
    cache.commit(running)
    assert cache.clear() == 2
    assert cache.num_cached_blocks == 2
    cache.release(running)
    assert cache.num_used_blocks == 0


@given(
    operations=st.lists(
        st.tuples(st.sampled_from(["admit", "commit", "release"]), st.integers(0, 5), st.integers(1, 40)),
        max_size=60,
    )
)
def test_capacity_holds_under_any_interleaving(operations: list[tuple[str, int, int]]) -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=12)
    held: list[BlockAllocation] = []
    for operation, tag, num_tokens in operations:
        if operation == "admit":
            prompt = prompt_of("abcdef"[tag], num_tokens)
            allocation = cache.allocate(hash_prompt_blocks(prompt, 4), prompt.num_tokens)
            if allocation is not None:
                held.append(allocation)
        elif held:
            allocation = held[tag % len(held)]
            if operation == "commit":
                cache.commit(allocation)
            else:
                cache.release(allocation)
                held.remove(allocation)
        assert cache.num_used_blocks <= cache.capacity_blocks
        assert cache.num_cached_blocks + cache._private_blocks <= cache.capacity_blocks
    for allocation in held:
        cache.release(allocation)
    assert cache.num_used_blocks == 0
