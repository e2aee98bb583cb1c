"""Trunks of conversations: a shared prefix whose branches come back is spread by cache room once its
holder is full; one whose branches are one-shot keeps following its holder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from keykit import bare_key
from prefix_router.routing.config import BalanceConfig
from prefix_router.routing.decision import Branch, Candidates
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import Picker
from prefix_router.routing.ring import HashRing, Member
from prefix_router.routing.trunks import MIN_BRANCHES, TrunkStats

TRUNK = (1, 2, 3)  # a shared system prompt's blocks


def conversation(i: int, turns: int) -> list[tuple[int, ...]]:
    """The block chains of conversation i's turns: the trunk, then its own blocks, growing."""
    own = tuple(1000 * (i + 1) + t for t in range(turns))
    return [TRUNK + own[: t + 1] for t in range(turns)]


def test_branches_that_come_back_make_a_conversations_trunk() -> None:
    stats = TrunkStats()
    for i in range(MIN_BRANCHES):
        first, *later = conversation(i, 3)
        stats.observe(first, len(TRUNK))  # branches off the trunk
        for turn in later:
            stats.observe(turn, len(turn) - 1)  # its own previous turn is known: it runs past the trunk
    assert stats.is_conversational(TRUNK[-1])


def test_one_shot_branches_do_not() -> None:
    stats = TrunkStats()
    for i in range(50):
        stats.observe((*TRUNK, 5000 + i), len(TRUNK))  # a question after a shared document, once
    assert not stats.is_conversational(TRUNK[-1])
    assert len(stats) == 1


def test_a_trunk_is_judged_only_after_enough_branches() -> None:
    stats = TrunkStats()
    for i in range(MIN_BRANCHES - 1):
        for t, chain in enumerate(conversation(i, 4)):
            stats.observe(chain, len(TRUNK) if t == 0 else len(chain) - 1)
    assert not stats.is_conversational(TRUNK[-1])


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.integers(0, 9)),
        max_size=60,
    ),
    st.integers(1, 8),
)
def test_bounded_and_never_fails(observations: list[tuple[list[int], int]], bound: int) -> None:
    stats = TrunkStats(bound)
    for blocks, known in observations:
        stats.observe(blocks, min(known, len(blocks)))
        assert len(stats) <= bound
    for block in range(31):
        stats.is_conversational(block)  # any block may be asked about


IDS = [f"http://10.0.3.{i}:8000" for i in range(4)]
RING = HashRing([Member(i) for i in IDS], 160)
ALL = Candidates.of(IDS)


def fill(picker: Picker, backend: str) -> None:
    """The backend's capacity set to what its ledger holds: full, with nothing evicted."""
    assert picker.ledgers is not None
    picker.set_capacity(backend, float(picker.ledgers.ledger(backend).used_bytes))


def make_trunk_conversational(picker: Picker, owner: str) -> None:
    # The first conversation teaches the index the trunk; the ones after it branch off it.
    for i in range(MIN_BRANCHES + 1):
        for chain in conversation(i, 2):
            key = bare_key(i, blocks=chain)
            picker.chosen(key, owner)
            picker.placed(key, owner)


def test_a_new_conversation_leaves_a_full_trunk_holder_for_a_roomier_cache() -> None:
    picker = Picker(BalanceConfig())
    owner = IDS[0]
    for backend in IDS:
        picker.set_capacity(backend, 10_000.0)
    make_trunk_conversational(picker, owner)
    new = bare_key(77, blocks=(*TRUNK, 9001))
    # The holder still has room: the conversation follows the trunk.
    decision = picker.pick(new, RING, ALL, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (owner, Branch.PREFIX_MATCH)
    # Full (nothing evicted yet): it goes where the cache keeps things longest, and says so.
    fill(picker, owner)
    decision = picker.pick(new, RING, ALL, LoadTracker())
    assert decision is not None
    assert decision.backend_id != owner
    assert decision.branch is Branch.SPREAD
    # The conversation's next turn follows it there, not the trunk's first holder.
    picker.chosen(new, decision.backend_id)
    picker.placed(new, decision.backend_id)
    later = bare_key(77, blocks=(*TRUNK, 9001, 9002))
    follow = picker.pick(later, RING, ALL, LoadTracker())
    assert follow is not None
    assert (follow.backend_id, follow.branch) == (decision.backend_id, Branch.PREFIX_MATCH)


def test_one_shot_questions_keep_following_a_full_holder() -> None:
    picker = Picker(BalanceConfig())
    owner = IDS[0]
    for backend in IDS:
        picker.set_capacity(backend, 10_000.0)
    for i in range(20):
        key = bare_key(i, blocks=(*TRUNK, 5000 + i))
        picker.chosen(key, owner)
        picker.placed(key, owner)
    fill(picker, owner)
    decision = picker.pick(bare_key(99, blocks=(*TRUNK, 6000)), RING, ALL, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (owner, Branch.PREFIX_MATCH)
