"""Pending prefills: who is computing which prefix now, and the picker's wait decision."""

from __future__ import annotations

from keykit import chat_key
from prefix_router.routing.config import BalanceConfig
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import Branch, Candidates, Picker
from prefix_router.routing.prefill import PendingPrefills
from prefix_router.routing.ring import HashRing, Member

IDS = [f"http://10.0.3.{i}:8000" for i in range(4)]
RING = HashRing([Member(b) for b in IDS], 64)
ALL = Candidates.of(IDS)


def test_start_claims_only_unclaimed_blocks_and_done_releases_them() -> None:
    pending = PendingPrefills()
    first = pending.start([1, 2, 3], "a")
    assert first is not None
    assert pending.start([1, 2], "b") is None, "nothing new to claim"
    second = pending.start([1, 2, 3, 4], "b")
    assert second is not None
    assert pending.deepest([1, 2, 3, 4], 0) == (4, "b", second)
    assert pending.deepest([1, 2, 3], 0) == (3, "a", first)
    assert pending.deepest([1, 2, 3], 3) is None, "only blocks past what the index already knows"
    pending.done(first)
    assert pending.deepest([1, 2, 3], 0) is None
    assert pending.deepest([1, 2, 3, 4], 0) == (4, "b", second)
    pending.done(second)
    pending.done(second)  # idempotent
    assert len(pending) == 0


def test_second_request_for_a_prefix_in_prefill_waits_on_it() -> None:
    picker = Picker(BalanceConfig())
    load = LoadTracker()
    system = "a long shared system prompt " * 40
    first = chat_key(system, "question one")
    decision = picker.pick(first, RING, ALL, load, wait=True)
    assert decision is not None and decision.wait_for is None
    ticket = picker.prefill_started(first, decision.backend_id)
    assert ticket is not None
    picker.placed(first, decision.backend_id)  # its response head arrived: the index knows it already

    second = chat_key(system, "question two")
    held = picker.pick(second, RING, ALL, load, wait=True)
    assert held is not None
    assert (held.backend_id, held.branch, held.wait_for) == (decision.backend_id, Branch.PREFIX_MATCH, ticket)
    assert picker.pick(second, RING, ALL, load, wait=False).wait_for is None  # type: ignore[union-attr]

    picker.prefill_done(ticket)
    after = picker.pick(second, RING, ALL, load, wait=True)
    assert after is not None and after.wait_for is None
    assert after.backend_id == decision.backend_id, "then it goes where the prefix is now cached"


def test_non_streaming_requests_open_no_prefill() -> None:
    picker = Picker(BalanceConfig())
    key = chat_key("system " * 100, "q", stream=False)
    assert picker.prefill_started(key, IDS[0]) is None


def test_no_wait_when_the_prefilling_backend_is_full() -> None:
    picker = Picker(BalanceConfig(max_inflight=2))
    load = LoadTracker()
    system = "shared " * 200
    first = chat_key(system, "1")
    decision = picker.pick(first, RING, ALL, load, wait=True)
    assert decision is not None
    assert picker.prefill_started(first, decision.backend_id) is not None
    for _ in range(2):
        load.acquire(decision.backend_id)
    held = picker.pick(chat_key(system, "2"), RING, ALL, load, wait=True)
    assert held is not None and held.wait_for is None and held.backend_id != decision.backend_id


def test_a_prefix_already_cached_is_not_claimed_by_a_new_question() -> None:
    picker = Picker(BalanceConfig())
    load = LoadTracker()
    system = "a cached system prompt " * 40
    warm = chat_key(system, "an earlier question")
    picker.placed(warm, IDS[0])  # done long ago: the system prompt's blocks are cached on IDS[0]
    first = chat_key(system, "a new question that is long enough to fill blocks of its own " * 8)
    ticket = picker.prefill_started(first, IDS[0])
    assert ticket is not None, "its own new blocks are pending"
    other = chat_key(system, "another question")
    decision = picker.pick(other, RING, ALL, load, wait=True)
    assert decision is not None and decision.wait_for is None, "sharing only the cached part: no wait"
