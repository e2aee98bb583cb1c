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
    assert pending.start([1, 2], "a") is None, "nothing new to claim there"
    second = pending.start([1, 2, 3, 4], "a")
    assert second is not None
    assert pending.deepest([1, 2, 3, 4], 0) == (4, (("a", second),))
    assert pending.deepest([1, 2, 3], 0) == (3, (("a", first),))
    assert pending.deepest([1, 2, 3], 3) is None, "only blocks past what the index already knows"
    pending.done(first)
    assert pending.deepest([1, 2, 3], 0) is None
    assert pending.deepest([1, 2, 3, 4], 0) == (4, (("a", second),))
    pending.done(second)
    pending.done(second)  # idempotent
    assert len(pending) == 0


def test_one_prefix_in_prefill_on_two_backends_is_pending_on_both() -> None:
    pending = PendingPrefills()
    first = pending.start([1, 2], "a")
    second = pending.start([1, 2], "b")  # a copy computed on a second backend
    assert first is not None and second is not None
    assert pending.deepest([1, 2], 0) == (2, (("a", first), ("b", second)))
    pending.done(first)
    assert pending.deepest([1, 2], 0) == (2, (("b", second),))
    pending.done(second)
    assert pending.deepest([1, 2], 0) is None


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


def test_a_hot_prefix_spilled_to_a_second_backend_is_computed_there_once() -> None:
    """The owner is at max_inflight: the first spilled request computes the prefix on another
    backend, and the next ones wait for that copy instead of computing it there again each; once the
    owner has room, it takes the next one at once (it has the prefix cached, nothing to wait for)."""
    picker = Picker(BalanceConfig(max_inflight=2))
    load = LoadTracker()
    system = "a hot system prompt shared by half the traffic " * 30
    first = chat_key(system, "q0")
    owner = picker.pick(first, RING, ALL, load, wait=True)
    assert owner is not None
    first_ticket = picker.prefill_started(first, owner.backend_id)
    picker.placed(first, owner.backend_id)
    assert first_ticket is not None
    picker.prefill_done(first_ticket)  # the owner has it cached now
    leases = [load.acquire(owner.backend_id) for _ in range(2)]  # ...and is full

    spilled = chat_key(system, "q1")
    second = picker.pick(spilled, RING, ALL, load, wait=True)
    assert second is not None and second.wait_for is None
    assert second.backend_id != owner.backend_id
    copy_ticket = picker.prefill_started(spilled, second.backend_id)
    assert copy_ticket is not None, "the copy is computed on the second backend"
    picker.placed(spilled, second.backend_id)
    load.acquire(second.backend_id)

    third = picker.pick(chat_key(system, "q2"), RING, ALL, load, wait=True)
    assert third is not None
    assert (third.backend_id, third.wait_for) == (second.backend_id, copy_ticket)

    leases[0].release()  # the owner has room again
    fourth = picker.pick(chat_key(system, "q3"), RING, ALL, load, wait=True)
    assert fourth is not None
    assert (fourth.backend_id, fourth.wait_for) == (owner.backend_id, None)
