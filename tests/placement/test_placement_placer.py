"""Placement without HTTP: choose → capacity wait → prefill hold → a Placement whose release() gives
back the lease and ends the hold exactly once, however often it is called."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keykit import chat_key
from prefix_router.errors import NoBackend, Overloaded
from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy
from prefix_router.placement import Placement, PlacementConfig, Placer
from prefix_router.routing.config import BalanceConfig
from prefix_router.routing.decision import Branch
from prefix_router.routing.picker import Picker

URLS = [f"http://10.0.6.{i}:8000" for i in range(4)]


class Recorded:
    """The waits placement reports, in order."""

    def __init__(self) -> None:
        self.waits: list[tuple[str, float]] = []
        self.prefills: list[str] = []

    def waited(self, reason: str, seconds: float) -> None:
        self.waits.append((reason, seconds))

    def prefill_waited(self, outcome: str, seconds: float) -> None:
        self.prefills.append(outcome)
        self.waited("prefill", seconds)


class Fleet:
    def __init__(
        self,
        n: int = 3,
        max_inflight: int = 32,
        queue_max: int = 64,
        queue_timeout_s: float = 0.5,
        prefill_wait_s: float = 5.0,
    ) -> None:
        self.urls = URLS[:n]
        self.backends = BackendSet([BackendSpec(u) for u in self.urls], vnodes=64, health=HealthPolicy())
        self.picker = Picker(BalanceConfig(max_inflight=max_inflight), random.Random(0))
        self.waits = Recorded()
        config = PlacementConfig(max_inflight, queue_max, queue_timeout_s, prefill_wait_s)
        self.placer = Placer(config, self.backends, self.picker, self.waits, random.Random(0))

    @property
    def inflight(self) -> int:
        return self.backends.load.total_inflight()


SYSTEM = "a long shared system prompt " * 40


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_placement_holds_its_lease_and_prefill_until_released_once() -> None:
    f = Fleet()
    first = await f.placer.place(chat_key(SYSTEM, "q1"))
    assert first.backend_id in f.urls and first.branch is first.decision.branch
    assert f.backends.load.inflight(first.backend_id) == 1
    assert first.prefill is not None and f.picker.prefilling == 1
    for _ in range(3):
        first.release()
    assert first.released and f.inflight == 0 and f.picker.prefilling == 0
    # Another placement on the same backend: the first one's late releases do not touch its lease.
    second = await f.placer.place(chat_key(SYSTEM, "q1"), pin=first.backend_id)
    first.release()
    assert f.backends.load.inflight(second.backend_id) == 1 and f.picker.prefilling == 1
    second.release()
    assert f.inflight == 0 and f.picker.prefilling == 0


async def test_the_first_byte_ends_the_prefill_hold_and_keeps_the_lease() -> None:
    f = Fleet()
    placed = await f.placer.place(chat_key(SYSTEM, "q"))
    placed.first_byte()
    assert f.picker.prefilling == 0 and f.inflight == 1
    placed.release()
    assert f.inflight == 0


async def test_a_release_wakes_one_capacity_waiter_however_often_it_is_called() -> None:
    f = Fleet(1, max_inflight=1, queue_max=8, queue_timeout_s=30.0)
    holder = await f.placer.place(chat_key(SYSTEM, "held"))
    queued = [asyncio.create_task(f.placer.place(chat_key(SYSTEM, f"q{i}"))) for i in range(2)]
    await settle()
    assert f.placer.waiting == 2
    holder.release()
    holder.release()
    assert f.placer.waiting == 1, "one lease given back wakes one waiter, once"
    done, pending = await asyncio.wait(queued, return_when=asyncio.FIRST_COMPLETED)
    (woken,) = done
    await settle()
    assert all(not t.done() for t in pending) and f.placer.waiting == 1
    woken.result().release()
    last = await pending.pop()
    last.release()
    assert f.inflight == 0 and f.placer.waiting == 0
    assert [reason for reason, _ in f.waits.waits] == ["capacity", "capacity"]


async def test_a_full_fleet_is_overloaded_after_the_queue_timeout_and_the_wait_is_reported() -> None:
    f = Fleet(1, max_inflight=1, queue_max=8, queue_timeout_s=0.02)
    holder = await f.placer.place(chat_key(SYSTEM, "held"))
    with pytest.raises(Overloaded):
        await f.placer.place(chat_key(SYSTEM, "late"))
    assert [reason for reason, _ in f.waits.waits] == ["capacity"] and f.waits.waits[0][1] > 0
    assert f.inflight == 1 and f.placer.waiting == 0
    holder.release()


async def test_a_full_queue_is_overloaded_at_once() -> None:
    f = Fleet(1, max_inflight=1, queue_max=0, queue_timeout_s=30.0)
    holder = await f.placer.place(chat_key(SYSTEM, "held"))
    with pytest.raises(Overloaded):
        await f.placer.place(chat_key(SYSTEM, "late"))
    holder.release()


@pytest.mark.parametrize(
    ("wait_s", "first_byte", "outcome"),
    [
        pytest.param(30.0, True, "ready", id="until-the-first-byte"),
        pytest.param(0.02, False, "timeout", id="until-its-bound"),
    ],
)
async def test_a_second_request_for_a_prefix_in_prefill_waits_for_it(
    wait_s: float, first_byte: bool, outcome: str
) -> None:
    f = Fleet(prefill_wait_s=wait_s)
    first = await f.placer.place(chat_key(SYSTEM, "question one"))
    first.answered()  # its response head came: the index knows where the prefix goes
    second = asyncio.create_task(f.placer.place(chat_key(SYSTEM, "question two")))
    await settle()
    assert not second.done(), "held while the first prefills the prefix"
    load = f.backends.load
    assert load.held_for_prefill(first.backend_id) == 1, "bound to go there"
    if first_byte:
        first.first_byte()
    placed = await second
    assert placed.backend_id == first.backend_id and placed.branch is Branch.PREFIX_MATCH
    assert f.waits.prefills == [outcome]
    first.release()
    placed.release()
    assert f.inflight == 0 and f.picker.prefilling == 0
    assert load.held_for_prefill(first.backend_id) == 0, "a hold that ended counts no more"


async def test_without_prefill_waits_nothing_is_held() -> None:
    f = Fleet(prefill_wait_s=0.0)
    placed = await f.placer.place(chat_key(SYSTEM, "q"))
    assert placed.prefill is None and f.placer.holds is None
    placed.release()


async def test_a_retry_goes_to_another_backend_and_is_recorded_as_retry() -> None:
    f = Fleet()
    key = chat_key(SYSTEM, "q")
    first = await f.placer.place(key)
    first.release()
    again = await f.placer.place(key, [first.backend_id])
    assert again.backend_id != first.backend_id
    assert again.branch is Branch.RETRY and again.decision.branch is not Branch.RETRY
    again.release()
    with pytest.raises(NoBackend):
        await f.placer.place(key, f.urls)
    assert f.inflight == 0


async def test_a_pinned_request_goes_to_its_pin_or_nowhere() -> None:
    f = Fleet()
    pin = f.urls[2]
    placed = await f.placer.place(chat_key(SYSTEM, "q"), pin=pin)
    assert (placed.backend_id, placed.branch) == (pin, Branch.AFFINITY)
    placed.release()
    assert not f.placer.has_other(chat_key(SYSTEM, "q"), [pin], pin)
    with pytest.raises(NoBackend):
        await f.placer.place(chat_key(SYSTEM, "q"), [pin], pin)
    with pytest.raises(NoBackend):
        await f.placer.place(chat_key(SYSTEM, "q"), pin="http://10.9.9.9:8000")


def test_another_backend_is_one_of_the_candidates_not_yet_tried() -> None:
    f = Fleet(2)
    key = chat_key(SYSTEM, "q")
    assert f.placer.has_other(key, [f.urls[0]])
    assert not f.placer.has_other(key, f.urls)
    f.backends.drain(f.urls[1])
    assert not f.placer.has_other(key, [f.urls[0]]), "a draining backend takes no new requests"


async def test_a_released_placement_lets_its_drained_backend_leave() -> None:
    f = Fleet(2)
    placed = await f.placer.place(chat_key(SYSTEM, "q"))
    f.backends.drain(placed.backend_id)
    assert f.backends.get(placed.backend_id) is not None, "it stays while the request runs"
    placed.release()
    assert f.backends.get(placed.backend_id) is None


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 5), st.booleans()),
        st.tuples(st.just("first_byte"), st.integers(0, 50), st.just(False)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(False)),
    ),
    max_size=30,
)
KEYS = [chat_key(system, q) for system in ("one system " * 60, "two system " * 60) for q in ("a", "b", "c")]


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_any_places_first_bytes_and_releases_give_everything_back(ops: list[tuple[str, int, bool]]) -> None:
    async def run() -> None:
        # A prefill wait of 1 ms: a request for a prefix in prefill is held, briefly, then placed.
        f = Fleet(3, prefill_wait_s=0.001)
        holds = f.placer.holds
        assert holds is not None
        made: list[Placement] = []
        for op, n, retry in ops:
            if op == "place":
                exclude = [f.urls[n % 3]] if retry else []
                made.append(await f.placer.place(KEYS[n], exclude))
            elif made and op == "first_byte":
                made[n % len(made)].first_byte()
            elif made:
                made[n % len(made)].release()  # may well be a second release
            open_ = [p for p in made if not p.released]
            assert f.inflight == len(open_)
            held = sum(1 for p in made if p.prefill is not None and not p.prefill.released)
            assert len(holds) == held == f.picker.prefilling
            assert all(p.prefill is None or p.prefill.released for p in made if p.released)
        for p in made:
            p.release()
        assert f.inflight == 0 and f.picker.prefilling == 0 and len(holds) == 0

    asyncio.run(run())


OTHER_SYSTEM = "another team's system prompt " * 40


async def _fill(f: Fleet, backend: str, system: str, n: int) -> list[Placement]:
    """`n` requests in flight on `backend` (pinned there) behind `system`, answering already: the
    index knows the backend holds it, and a running request there holds it."""
    placed = [await f.placer.place(chat_key(system, f"filler {i}"), pin=backend) for i in range(n)]
    for p in placed:
        p.answered()
        p.first_byte()  # prefilled: nothing to wait for but capacity
    return placed


async def _two_busy(
    max_inflight: int, queue_timeout_s: float, on_owner: int, on_other: int
) -> tuple[Fleet, list[Placement], list[Placement]]:
    """Two backends: the first running `on_owner` requests behind SYSTEM, the other `on_other`
    behind another prompt."""
    f = Fleet(2, max_inflight=max_inflight, queue_timeout_s=queue_timeout_s)
    owner, other = f.urls
    return f, await _fill(f, owner, SYSTEM, on_owner), await _fill(f, other, OTHER_SYSTEM, on_other)


def _release_all(f: Fleet, *placements: Placement) -> None:
    for p in placements:
        p.release()
    assert f.inflight == 0 and f.placer.waiting == 0


async def test_a_request_waits_for_its_full_owner_while_the_other_backend_is_as_busy() -> None:
    # max_inflight 8, load factor 1.25: the other backend takes the request from its full owner only
    # when it carries 5 or fewer (6.4 with the request).
    f, on_owner, on_other = await _two_busy(8, 30.0, on_owner=8, on_other=7)
    owner = f.urls[0]
    task = asyncio.create_task(f.placer.place(chat_key(SYSTEM, "a new question")))
    await settle()
    assert f.placer.waiting == 1 and not task.done(), "the other backend has room but is as busy"
    on_other.pop().release()  # 6 left there: still about as busy as the owner
    await settle()
    assert f.placer.waiting == 1 and not task.done()
    on_owner.pop().release()
    placed = await task
    assert (placed.backend_id, placed.branch) == (owner, Branch.PREFIX_MATCH)
    assert [reason for reason, _ in f.waits.waits] == ["owner"]
    _release_all(f, placed, *on_owner, *on_other)


async def test_a_request_waiting_for_its_owner_goes_where_a_backend_turns_clearly_less_busy() -> None:
    f, on_owner, on_other = await _two_busy(8, 30.0, on_owner=8, on_other=6)
    other = f.urls[1]
    task = asyncio.create_task(f.placer.place(chat_key(SYSTEM, "a new question")))
    await settle()
    assert f.placer.waiting == 1
    on_other.pop().release()  # 5 left: clearly less busy than the full owner
    placed = await task
    assert placed.backend_id == other and placed.branch is not Branch.PREFIX_MATCH
    _release_all(f, placed, *on_owner, *on_other)


async def test_the_wait_for_a_full_owner_ends_at_the_queue_timeout_on_a_backend_with_room() -> None:
    f, on_owner, on_other = await _two_busy(4, 0.05, on_owner=4, on_other=3)
    other = f.urls[1]
    placed = await f.placer.place(chat_key(SYSTEM, "a new question"))
    assert placed.backend_id == other, "room elsewhere: not refused after waiting for the owner"
    ((reason, waited),) = f.waits.waits
    assert reason == "owner" and waited >= 0.04
    _release_all(f, placed, *on_owner, *on_other)


async def test_a_slot_freed_elsewhere_goes_to_a_request_for_any_backend_not_to_the_owners_waiter() -> None:
    f, on_owner, on_other = await _two_busy(4, 30.0, on_owner=4, on_other=4)
    owner, other = f.urls
    for_owner = asyncio.create_task(f.placer.place(chat_key(SYSTEM, "a new question")))
    await settle()
    for_any = asyncio.create_task(f.placer.place(chat_key("a prompt nobody sent yet " * 40, "q")))
    await settle()
    assert f.placer.waiting == 2
    # 3 left there. The first waiter, queued for any backend while none had room, is woken, finds
    # the other as busy as its owner, waits for its owner and passes the slot on.
    on_other.pop().release()
    went_anywhere = await for_any
    assert went_anywhere.backend_id == other and not for_owner.done()
    on_owner.pop().release()
    went_to_owner = await for_owner
    assert went_to_owner.backend_id == owner
    assert sorted(reason for reason, _ in f.waits.waits) == ["capacity", "owner"]
    _release_all(f, went_anywhere, went_to_owner, *on_owner, *on_other)
