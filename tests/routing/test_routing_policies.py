"""Each policy behind the one protocol, used on its own: the prefix policy reads an index it is handed
(whoever fed it), the baselines ignore the prefix."""

from __future__ import annotations

import random

import orjson
import pytest

from keykit import bare_key
from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig
from prefix_router.routing.decision import Branch, Candidates
from prefix_router.routing.keys import RoutingKey, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.policies import Policy as RoutingPolicy
from prefix_router.routing.policies.baseline import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from prefix_router.routing.policies.prefix import PrefixPolicy
from prefix_router.routing.prefill import PendingPrefills
from prefix_router.routing.prefix_index import PrefixIndex
from prefix_router.routing.ring import HashRing, Member

IDS = [f"http://10.0.4.{i}:8000" for i in range(6)]
RING = HashRing([Member(b) for b in IDS], 64)
ALL = Candidates.of(IDS)


def test_the_prefix_policy_follows_an_index_fed_from_outside() -> None:
    index = PrefixIndex(1000)
    far = list(RING.walk(7))[-1]  # the last backend the ring walk would reach
    index.record((1, 2, 3), far)
    policy = PrefixPolicy(BalanceConfig(first_placement=FirstPlacement.RING), index, None, PendingPrefills())
    decision = policy.pick(bare_key(7, (1, 2, 3)), RING, ALL, LoadTracker(), wait=False)
    assert (decision.backend_id, decision.branch) == (far, Branch.PREFIX_MATCH)
    index.forget_backend(far)
    decision = policy.pick(bare_key(7, (1, 2, 3)), RING, ALL, LoadTracker(), wait=False)
    assert (decision.backend_id, decision.branch) == (RING.primary(7), Branch.AFFINITY)


SYSTEM = "You answer questions about our product. " * 50  # 2,000 characters, before every conversation
RING_KEYS = KeyConfig(preamble_share=None)  # as settings build it for first placements by the ring


def _turn(conversation: int, turns: int) -> RoutingKey:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"answer {t} of {conversation} " * 60})
        messages.append({"role": "user", "content": f"question {t} of conversation {conversation}"})
    body = orjson.dumps({"model": "m", "messages": messages})
    return extract_key("/v1/chat/completions", body, None, RING_KEYS)


@pytest.mark.parametrize(
    ("first_placement", "follows"),
    [
        pytest.param(FirstPlacement.RING, False, id="ring-places-it"),
        pytest.param(FirstPlacement.CACHE_ROOM, True, id="cache-room-follows"),
    ],
)
def test_a_known_system_prompt_inside_the_ring_key_is_left_to_the_ring(
    first_placement: FirstPlacement, follows: bool
) -> None:
    """With first placements by the ring, a replica that placed other conversations knows the system
    prompt that is most of a new one's first turn; the ring, which every replica shares, places it."""
    new = _turn(1, 1)
    far = list(RING.walk(new.ring_hash))[-1]
    index = PrefixIndex(1000)
    index.record(_turn(0, 1).blocks, far)
    policy = PrefixPolicy(BalanceConfig(first_placement=first_placement), index, None, PendingPrefills())
    decision = policy.pick(new, RING, ALL, LoadTracker(), wait=False)
    expected = (far, Branch.PREFIX_MATCH) if follows else (RING.primary(new.ring_hash), Branch.AFFINITY)
    assert (decision.backend_id, decision.branch) == expected


def test_with_ring_placements_a_conversation_is_followed_past_its_ring_key() -> None:
    """The replica that placed a conversation's turn knows blocks past the ring key: it follows them
    there, as where the turn really went (a spill) is the cache that holds them."""
    turn = _turn(1, 3)
    far = list(RING.walk(turn.ring_hash))[-1]
    index = PrefixIndex(1000)
    index.record(_turn(1, 2).blocks, far)
    policy = PrefixPolicy(BalanceConfig(first_placement=FirstPlacement.RING), index, None, PendingPrefills())
    decision = policy.pick(turn, RING, ALL, LoadTracker(), wait=False)
    assert (decision.backend_id, decision.branch) == (far, Branch.PREFIX_MATCH)


@pytest.mark.parametrize("first_placement", [FirstPlacement.CACHE_ROOM, FirstPlacement.RING])
def test_a_next_turn_goes_where_the_previous_turn_went_though_others_share_its_blocks(
    first_placement: FirstPlacement,
) -> None:
    """A first turn shorter than the block after the system prompt leaves no block of its own: the
    deepest block the next turn shares is the system prompt, which another backend took first. The
    backend that took the previous turn holds it and its reply."""
    first, second = _turn(1, 1), _turn(1, 2)
    walk = list(RING.walk(second.ring_hash))
    elsewhere, taker = walk[-1], walk[-2]  # neither is the ring's choice
    index = PrefixIndex(1000)
    index.record(_turn(0, 1).blocks, elsewhere)  # another conversation: the system prompt's first owner
    index.record(first.blocks, taker)
    index.record_prompt_end(first.prompt_end, taker)
    assert index.longest_match(second.blocks) == (len(first.blocks), (elsewhere, taker))
    policy = PrefixPolicy(BalanceConfig(first_placement=first_placement), index, None, PendingPrefills())
    decision = policy.pick(second, RING, ALL, LoadTracker(), wait=False)
    assert (decision.backend_id, decision.branch, decision.previous_turn) == (
        taker,
        Branch.PREFIX_MATCH,
        True,
    )
    # At max_inflight it takes no more: the others' rules decide, as for any owner.
    load = LoadTracker()
    for _ in range(BalanceConfig().max_inflight):
        load.acquire(taker)
    assert policy.pick(second, RING, ALL, load, wait=False).backend_id != taker


def test_the_prefix_policy_answers_a_pending_prefill_with_its_ticket_only_when_asked_to_wait() -> None:
    pending = PendingPrefills()
    owner = IDS[2]
    ticket = pending.start((1, 2, 3), owner)
    policy = PrefixPolicy(BalanceConfig(), PrefixIndex(1000), None, pending)
    held = policy.pick(bare_key(9, (1, 2, 3)), RING, ALL, LoadTracker(), wait=True)
    assert (held.backend_id, held.branch, held.wait_for) == (owner, Branch.PREFIX_MATCH, ticket)
    assert policy.pick(bare_key(9, (1, 2, 3)), RING, ALL, LoadTracker(), wait=False).wait_for is None


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(RandomPolicy(random.Random(3)), id="random"),
        pytest.param(RoundRobinPolicy(), id="round_robin"),
        pytest.param(LeastLoadedPolicy(), id="least_loaded"),
    ],
)
def test_baselines_ignore_the_prefix_and_never_wait(policy: RoutingPolicy) -> None:
    pending = PendingPrefills()
    pending.start((1, 2, 3), IDS[0])
    for i in range(30):
        decision = policy.pick(bare_key(i, (1, 2, 3)), RING, ALL, LoadTracker(), wait=True)
        assert decision.branch is Branch.BALANCED and decision.wait_for is None
        assert decision.backend_id in ALL.members
