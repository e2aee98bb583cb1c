"""The prefill hold: one claim on the blocks an attempt prefills, released once however often it is
released; whatever the order of claims and releases, the bookkeeping ends empty."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from keykit import chat_key
from prefix_router.placement import PrefillHold, PrefillHolds
from prefix_router.routing.config import BalanceConfig
from prefix_router.routing.decision import Candidates
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import Picker
from prefix_router.routing.ring import HashRing, Member

IDS = [f"http://10.0.5.{i}:8000" for i in range(3)]
RING = HashRing([Member(b) for b in IDS], 64)
ALL = Candidates.of(IDS)
SYSTEMS = ["one shared system prompt " * 40, "another system prompt entirely " * 40]


# Keys that share prefixes (two system prompts, three questions each): claims overlap.
KEYS = [chat_key(s, q) for s in SYSTEMS for q in ("what is it", "why", "tell me more")]


def test_a_hold_released_twice_ends_its_claim_once() -> None:
    picker = Picker(BalanceConfig())
    holds = PrefillHolds(picker)
    first = holds.claim(KEYS[0], IDS[0])
    assert first is not None and len(holds) == 1 and picker.prefilling == 1
    first.release()
    assert first.released and len(holds) == 0 and picker.prefilling == 0
    # The same blocks claimed again by another attempt: the first hold's second release leaves it be.
    second = holds.claim(KEYS[0], IDS[1])
    assert second is not None
    first.release()
    assert not second.released and len(holds) == 1 and picker.prefilling == 1
    second.release()
    assert len(holds) == 0 and picker.prefilling == 0


def test_nothing_new_to_prefill_claims_nothing() -> None:
    picker = Picker(BalanceConfig())
    holds = PrefillHolds(picker)
    assert holds.claim(chat_key(SYSTEMS[0], "q", stream=False), IDS[0]) is None, "its first byte is its last"
    held = holds.claim(KEYS[0], IDS[0])
    assert held is not None
    assert holds.claim(KEYS[0], IDS[0]) is None, "every block of it is being prefilled there already"
    elsewhere = holds.claim(KEYS[0], IDS[1])
    assert elsewhere is not None, "another backend computes its own copy"
    held.release()
    elsewhere.release()
    assert len(holds) == 0


async def test_a_waiter_wakes_when_the_hold_is_released_and_not_before() -> None:
    picker = Picker(BalanceConfig())
    holds = PrefillHolds(picker)
    held = holds.claim(KEYS[0], IDS[0])
    assert held is not None
    waiter = asyncio.create_task(holds.wait(held.ticket, 30.0))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiter.done()
    held.release()
    assert await waiter == "ready"
    assert await holds.wait(held.ticket, 30.0) is None, "a released hold has nothing to wait for"


async def test_a_waiter_gives_up_at_its_timeout_and_the_hold_stays() -> None:
    picker = Picker(BalanceConfig())
    holds = PrefillHolds(picker)
    held = holds.claim(KEYS[0], IDS[0])
    assert held is not None
    assert await holds.wait(held.ticket, 0.01) == "timeout"
    assert len(holds) == 1
    held.release()
    assert len(holds) == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(0, len(KEYS) - 1), st.sampled_from(IDS)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=200)
@given(OPS)
def test_any_claims_and_releases_leave_the_bookkeeping_empty(ops: list[tuple[str, int, str]]) -> None:
    picker = Picker(BalanceConfig())
    holds = PrefillHolds(picker)
    made: list[PrefillHold] = []
    for op, n, backend in ops:
        if op == "claim":
            hold = holds.claim(KEYS[n], backend)
            if hold is not None:
                made.append(hold)
        elif made:
            made[n % len(made)].release()  # may well be a second release
        open_ = sum(1 for h in made if not h.released)
        assert len(holds) == open_ == picker.prefilling
    for hold in made:
        hold.release()
        hold.release()
    assert len(holds) == 0 and picker.prefilling == 0
    # And no block is left pending: no request is held for a prefill that ended.
    for key in KEYS:
        decision = picker.pick(key, RING, ALL, LoadTracker(), wait=True)
        assert decision is not None and decision.wait_for is None
