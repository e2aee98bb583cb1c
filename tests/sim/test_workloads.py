"""Workloads are deterministic, have their documented shape, and the oracle's arithmetic is the sim's."""

from __future__ import annotations

import pytest

from prefix_router.loadgen.workloads import (
    TENANT_HEADER,
    WORKLOADS,
    Workload,
    distinct_blocks,
    families,
    hot_prefix,
    largest_prompt_blocks,
    long_context,
    median_prompt_blocks,
    multi_turn,
    oracle_from_blocks,
    oracle_hit_rate,
    prompt_blocks,
    shared_prefix,
    shared_system,
    tenants,
)
from prefix_router.sim.cache import hash_prompt_blocks
from prefix_router.sim.tokens import render_chat, tokenize_text


def text_of(body: dict[str, object]) -> str:
    return "".join(m["content"] for m in body["messages"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    make = WORKLOADS[name]
    assert make() == make()
    assert make(seed=99).requests != make().requests


def test_shared_prefix_shape() -> None:
    w = shared_prefix(groups=3, prompts_per_group=5, system_tokens=100, question_tokens=10)
    assert len(w) == 15
    by_group: dict[str, list[str]] = {}
    for r in w.requests:
        system, user = r.body["messages"]
        assert len(system["content"]) == 400 and len(user["content"]) == 40  # exact: 4 chars a token
        by_group.setdefault(r.group, []).append(system["content"])
    assert sorted(by_group) == ["g0", "g1", "g2"]
    assert all(len(set(systems)) == 1 and len(systems) == 5 for systems in by_group.values())
    assert len({systems[0] for systems in by_group.values()}) == 3
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)  # shuffled


def test_long_context_prefixes_are_8000_tokens() -> None:
    w = long_context(documents=2, questions_per_document=3)
    assert len(w) == 6
    assert all(len(r.body["messages"][0]["content"]) >= 8000 * 4 for r in w.requests)


def test_multi_turn_each_turn_extends_the_previous_one() -> None:
    w = multi_turn(conversations=10)
    for i, r in enumerate(w.requests):
        if r.after is None:
            assert len(r.body["messages"]) == 2  # system + first user message
            continue
        assert r.after < i
        prev = w.requests[r.after]
        assert prev.group == r.group
        n = len(prev.body["messages"])
        assert r.body["messages"][:n] == prev.body["messages"]
        assert [m["role"] for m in r.body["messages"][n:]] == ["assistant", "user"]
    # Some requests stay under the router's default 4096-character key, some go far past it.
    lengths = [len(text_of(r.body)) for r in w.requests]
    assert min(lengths) < 4096 < max(lengths)


def test_hot_prefix_share_is_about_half() -> None:
    w = hot_prefix(requests=400)
    share = sum(r.group == "hot" for r in w.requests) / len(w)
    assert 0.4 < share < 0.6


def test_tenants_send_identical_prompts_under_distinct_keys() -> None:
    w = tenants(tenant_count=4, requests_per_tenant=6, shared_prompts=2)
    assert len(w) == 24
    assert {r.tenant for r in w.requests} == {f"tenant-{t:03d}" for t in range(4)}
    for r in w.requests:
        assert r.headers() == {TENANT_HEADER: r.tenant}
        assert r.body["cache_salt"] == r.tenant
        assert r.group.startswith(f"{r.tenant}/p")  # a group is one (tenant, system prompt) pair
    prompts = {
        t: sorted(text_of(r.body) for r in w.requests if r.tenant == t)
        for t in {r.tenant for r in w.requests}
    }
    assert len({tuple(p) for p in prompts.values()}) == 1  # every tenant sends the same prompts
    systems = {r.body["messages"][0]["content"] for r in w.requests}
    assert len(systems) == 2
    # Each pair: one system prompt, 3 requests; 4 tenants x 2 prompts = 8 pairs.
    by_group: dict[str, set[str]] = {}
    for r in w.requests:
        by_group.setdefault(r.group, set()).add(r.body["messages"][0]["content"])
    assert len(by_group) == 8 and all(len(v) == 1 for v in by_group.values())
    assert sum(r.group == "tenant-000/p0" for r in w.requests) == 3


def test_tenants_oracle_counts_hits_within_a_tenant_only() -> None:
    one = tenants(tenant_count=1, requests_per_tenant=6, shared_prompts=2, system_tokens=256)
    many = tenants(tenant_count=8, requests_per_tenant=6, shared_prompts=2, system_tokens=256)
    a = oracle_hit_rate(one, block_size=16, capacity_blocks=None).hit_rate
    b = oracle_hit_rate(many, block_size=16, capacity_blocks=None).hit_rate
    assert 0.5 < a < 1.0 and b == pytest.approx(a, abs=0.02)  # cache_salt: no tenant hits another's


def test_prompt_blocks_match_the_sims_rendering() -> None:
    body = {"messages": [{"role": "system", "content": "a" * 100}, {"role": "user", "content": "b" * 30}]}
    n, hashes = prompt_blocks(body, 4)
    rendered = render_chat([_msg("system", "a" * 100), _msg("user", "b" * 30)])
    assert n == tokenize_text(rendered).num_tokens
    assert hashes == hash_prompt_blocks(tokenize_text(rendered), 4)


def _msg(role: str, content: str):
    from prefix_router.sim.tokens import ChatMessage

    return ChatMessage(role, content)


def test_oracle_on_a_hand_computed_example() -> None:
    # Block size 4. A: 10 tokens, blocks [1, 2] (2 full blocks); B: 13 tokens, blocks [1, 2, 3]:
    # shares A's 2 blocks -> 8 hit tokens (limit floor(12/4) = 3). C: 9 tokens, blocks [1, 9]: 1 block
    # shared -> 4. D = A again: floor(9/4) = 2 blocks -> 8 (the last token is never a hit).
    # E: 8 tokens, blocks [7, 8]: nothing shared -> 0. Total 8 + 4 + 8 = 20 of 10 + 13 + 9 + 10 + 8 = 50.
    prompts = [(10, [1, 2]), (13, [1, 2, 3]), (9, [1, 9]), (10, [1, 2]), (8, [7, 8])]
    result = oracle_from_blocks(prompts, block_size=4, capacity_blocks=None)
    assert (result.hit_tokens, result.prompt_tokens) == (20, 50)
    assert result.hit_rate == pytest.approx(0.4)


def test_oracle_forgets_what_the_cache_cannot_hold() -> None:
    # Capacity 2 blocks: after [1, 2] then [5, 6], block 1 and 2 are gone; a repeat of A misses.
    prompts = [(9, [1, 2]), (9, [5, 6]), (9, [1, 2])]
    assert oracle_from_blocks(prompts, block_size=4, capacity_blocks=2).hit_tokens == 0
    assert oracle_from_blocks(prompts, block_size=4, capacity_blocks=4).hit_tokens == 8
    # The prefix is kept over the tail: [1, 2, 3] in a pool of 2 keeps 1 and 2.
    assert oracle_from_blocks([(13, [1, 2, 3]), (9, [1, 2])], block_size=4, capacity_blocks=2).hit_tokens == 8


def test_oracle_of_a_shared_prefix_workload() -> None:
    w: Workload = shared_prefix(groups=2, prompts_per_group=4, system_tokens=64, question_tokens=16)
    result = oracle_hit_rate(w, block_size=16, capacity_blocks=None)
    # Each group's first request misses; the other 3 hit the system prompt's full blocks at least.
    assert result.hit_tokens >= 2 * 3 * 64
    assert 0.5 < result.hit_rate < 1.0


def _assert_turns_extend(w: Workload) -> None:
    for i, r in enumerate(w.requests):
        if r.after is None:
            assert len(r.body["messages"]) == 2  # system + first user message
            continue
        prev = w.requests[r.after]
        assert r.after < i and prev.group == r.group
        assert r.body["messages"][: len(prev.body["messages"])] == prev.body["messages"]


def test_families_share_one_system_prompt_per_family() -> None:
    w = families(conversations=24, family_count=3, system_tokens=1500)
    _assert_turns_extend(w)
    by_family: dict[str, set[str]] = {}
    chats: dict[str, set[str]] = {}
    for r in w.requests:
        family, chat = r.group.split("/")
        by_family.setdefault(family, set()).add(r.body["messages"][0]["content"])
        chats.setdefault(family, set()).add(chat)
    assert sorted(by_family) == ["f0", "f1", "f2"]
    assert all(len(systems) == 1 for systems in by_family.values())  # one system prompt per family
    assert len({next(iter(v)) for v in by_family.values()}) == 3  # and a different one per family
    assert all(len(next(iter(v))) == 1500 * 4 for v in by_family.values())
    assert {f: len(c) for f, c in chats.items()} == {"f0": 8, "f1": 8, "f2": 8}
    # First turns of one family differ after the system prompt: the chats are distinct.
    firsts = {
        r.body["messages"][1]["content"] for r in w.requests if r.after is None and r.group.startswith("f0/")
    }
    assert len(firsts) == 8


def test_shared_system_puts_one_prompt_before_every_conversation() -> None:
    w = shared_system(conversations=10, system_tokens=512)
    _assert_turns_extend(w)
    assert {r.body["messages"][0]["content"] for r in w.requests} == {
        w.requests[0].body["messages"][0]["content"]
    }
    assert len(w.requests[0].body["messages"][0]["content"]) == 512 * 4
    assert len({r.group for r in w.requests}) == 10
    # Shorter than the router's 4096-character key: the key also covers the conversation's start.
    assert len(w.requests[0].body["messages"][0]["content"]) < 4096


def test_the_oracle_sees_what_families_and_a_shared_system_prompt_share() -> None:
    shared = shared_system(conversations=12, system_tokens=512, min_turns=1, max_turns=1)
    # One turn each: only the system prompt is shared; every conversation but the first hits its
    # full blocks (the first 2 tokens are "<|system|>"'s last bytes: (3 + 512) // 16 blocks).
    result = oracle_hit_rate(shared, block_size=16, capacity_blocks=None)
    assert result.hit_tokens == 11 * ((10 + 512 * 4) // 64) * 16
    fam = families(conversations=6, family_count=2, system_tokens=256, min_turns=1, max_turns=1)
    assert (
        oracle_hit_rate(fam, block_size=16, capacity_blocks=None).hit_tokens
        == 4 * ((10 + 256 * 4) // 64) * 16
    )


def test_working_set_and_prompt_sizes_in_blocks() -> None:
    w = shared_prefix(groups=2, prompts_per_group=3, system_tokens=64, question_tokens=16)
    counts = [prompt_blocks(r.body, 16)[0] for r in w.requests]
    assert largest_prompt_blocks(w, block_size=16) == -(-max(counts) // 16)
    assert median_prompt_blocks(w, block_size=16) == sorted(-(-c // 16) for c in counts)[3]
    hashes = [h for r in w.requests for h in prompt_blocks(r.body, 16)[1]]
    assert distinct_blocks(w, block_size=16) == len(set(hashes)) < len(hashes)
