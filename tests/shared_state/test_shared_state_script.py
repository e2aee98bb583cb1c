"""The claim and take-over scripts on a real redis-server: first writer wins, the follow table is
respected, eviction drops stale owners, footprints are returned; and the client's failure handling."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from prefix_router.fleet import shared_state
from prefix_router.fleet.shared_state import NAMESPACE, SharedPlacement
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.shared_view import ClaimAnswer, ClaimRequest, Takeover

from loopback import eventually_equal
from redisserver import RedisServer
from routerkit import eventually
from storerelay import PartitionRelay

BIG = float(1 << 40)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[SharedPlacement, asyncio.Task[None]]] = []

    async def make(**kwargs: Any) -> SharedPlacement:
        registry = CollectorRegistry()
        shared = SharedPlacement(redis_server.url, kwargs.pop("timeout_s", 2.0), registry, **kwargs)
        shared.registry = registry  # type: ignore[attr-defined]
        task = asyncio.get_running_loop().create_task(shared.run())
        made.append((shared, task))
        await eventually(lambda: shared.up)
        return shared

    yield make
    for shared, task in made:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shared.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def claim(
    blocks: list[int],
    proposed: str,
    follow: str | None = None,
    *,
    sizes: list[int] | None = None,
    capacity: float = BIG,
    listed: tuple[str, ...] = (),
    follow_limit: int = 0,
) -> ClaimRequest:
    return ClaimRequest(
        tuple(blocks),
        tuple(sizes or [100] * len(blocks)),
        follow if follow is not None else "1" * len(blocks),
        proposed,
        capacity,
        listed,
        follow_limit=follow_limit,
    )


async def claimed(shared: SharedPlacement, request: ClaimRequest) -> ClaimAnswer:
    answer = await shared.claim(request)
    assert answer is not None
    return answer


async def pinned(raw: Redis, backend: str) -> dict[int, int]:
    """The blocks requests in flight pin on the backend: block -> requests holding it."""
    prefix = f"{NAMESPACE}pin:{backend}:"
    keys = [key async for key in raw.scan_iter(match=prefix + "*")]
    values = await raw.mget(keys) if keys else []
    return {int(key[len(prefix) :]): int(value) for key, value in zip(keys, values, strict=True) if value}


async def served(shared: SharedPlacement, raw: Redis, request: ClaimRequest) -> ClaimAnswer:
    """A claim whose request has ended by the time the next one comes: its pins are let go of (none of
    its blocks is pinned by another request)."""
    answer = await claimed(shared, request)
    shared.unpin(answer.chosen, request)
    blocks = set(request.blocks)
    await eventually_equal(lambda: _pinned_among(raw, answer.chosen, blocks), set())
    return answer


async def _pinned_among(raw: Redis, backend: str, blocks: set[int]) -> set[int]:
    return blocks & set(await pinned(raw, backend))


async def owners(raw: Redis, blocks: list[int]) -> list[str | None]:
    return [
        v.decode() if isinstance(v, bytes) else v
        for v in await raw.mget([f"{NAMESPACE}o:{b}" for b in blocks])
    ]


async def test_the_first_writer_wins_and_is_followed(store: Any, raw: Redis) -> None:
    a, b = await store(), await store()  # two replicas
    first = await claimed(a, claim([1, 2, 3], "X"))
    assert (first.chosen, first.depth, first.followed) == ("X", 0, False)
    second = await claimed(b, claim([1, 2, 3], "Y"))
    assert (second.chosen, second.depth, second.followed) == ("X", 3, True)
    # A longer request sharing the prefix: followed to X, and X owns its new blocks too.
    third = await claimed(b, claim([1, 2, 3, 4, 5], "Y"))
    assert (third.chosen, third.depth) == ("X", 3)
    assert await owners(raw, [1, 2, 3, 4, 5]) == ["X"] * 5


async def test_the_follow_table_decides_and_owned_blocks_stay(store: Any, raw: Redis) -> None:
    shared = await store()
    await claimed(shared, claim([1, 2], "X"))
    # The shared prefix covers too little of this request (follow[2] == 0): the proposal stands.
    answer = await claimed(shared, claim([1, 2, 7, 8], "Y", follow="0011"))
    assert (answer.chosen, answer.depth, answer.followed) == ("Y", 2, False)
    assert await owners(raw, [1, 2, 7, 8]) == ["X", "X", "Y", "Y"]
    # The deepest owned block decides, whoever owns the shallower ones.
    deeper = await claimed(shared, claim([1, 2, 7, 9], "Z", follow="0111"))
    assert (deeper.chosen, deeper.depth, deeper.followed) == ("Y", 3, True)
    assert await owners(raw, [9]) == ["Y"]


async def test_a_prompts_own_history_is_followed_whatever_share_it_covers(store: Any, raw: Redis) -> None:
    """A conversation's next turn, its history placed through another replica: with `continued`, the
    owner of a prefix that ends where a prompt claimed before ended, and that nothing went on from
    since, is followed however little of the request it covers. A system prompt new conversations
    share, or a prefix that went on another way before, needs the follow table."""
    a, b = await store(), await store()

    def turn(blocks: list[int], proposed: str, continued: bool = True) -> ClaimRequest:
        request = claim(blocks, proposed, follow="0" * len(blocks))
        return dataclasses.replace(request, continued=continued)

    await claimed(a, claim([1, 2], "X"))  # the first turn: a system prompt (1) and a question (2)
    second = await claimed(b, turn([1, 2, 3, 4, 5], "Y"))
    assert (second.chosen, second.depth, second.followed) == ("X", 2, True)
    assert await owners(raw, [3, 4, 5]) == ["X"] * 3
    # Another conversation on the same system prompt, which no prompt ended with: placed by the replica.
    other = await claimed(a, turn([1, 6, 7], "Z"))
    assert (other.chosen, other.depth, other.followed) == ("Z", 1, False)
    assert (await claimed(b, turn([1, 6, 7, 8, 9], "W"))).chosen == "Z"
    # Without `continued` (placements by the ring), the follow table alone decides, as before.
    ring = await claimed(b, turn([1, 6, 7, 8, 9, 10, 11], "W", continued=False))
    assert (ring.chosen, ring.depth, ring.followed) == ("W", 5, False)
    # That claim went on from block 9: the same history resumed another way is no longer one prompt's.
    resumed = await claimed(b, turn([1, 6, 7, 8, 9, 12, 13], "V"))
    assert (resumed.chosen, resumed.depth, resumed.followed) == ("V", 5, False)


async def test_a_history_whose_end_aged_out_is_placed_anew(store: Any, raw: Redis) -> None:
    """What is still owned of it ends inside the prompt, where no prompt ended: the owner is evicting
    the prompt, and the request goes where the replica places it (unless the table follows it)."""
    shared = await store()
    await served(shared, raw, claim([1, 2, 3, 4], "X", capacity=400))
    assert await raw.get(f"{NAMESPACE}end:4") == "0"
    await served(shared, raw, claim([1, 2, 9, 10], "X", follow="0000", capacity=400))  # pushes 3, 4 out
    assert await owners(raw, [1, 2, 3, 4]) == ["X", "X", None, None]
    assert await raw.get(f"{NAMESPACE}end:4") is None  # gone with its owner
    request = dataclasses.replace(claim([1, 2, 3, 4, 11], "Y", follow="00000"), continued=True)
    answer = await claimed(shared, request)
    assert (answer.chosen, answer.depth, answer.followed) == ("Y", 2, False)


async def test_eviction_drops_the_owners_that_name_the_backend(store: Any, raw: Redis) -> None:
    shared = await store()
    await served(shared, raw, claim([50], "Y"))  # Y owns 50
    # X holds 300 bytes: 50 (owned by Y) and 1, 2 on the first request, then 3, 4 push them out.
    await served(shared, raw, claim([50, 1, 2], "X", follow="000", capacity=300))
    assert await owners(raw, [50, 1, 2]) == ["Y", "X", "X"]
    answer = await claimed(shared, claim([3, 4], "X", capacity=300, listed=("X", "Y")))
    assert answer.chosen == "X"
    # Oldest first, the request's deepest block first: 2, then 1; then 300 bytes hold, 50 stays.
    assert await owners(raw, [1, 2, 3, 4]) == [None, None, "X", "X"]
    assert await owners(raw, [50]) == ["Y"]  # stale only on X: Y's owner entry stays
    figures = dict((b, (used, oldest, entries)) for b, used, oldest, entries in answer.figures)
    used, oldest, entries = figures["X"]
    assert (used, entries) == (300, 3)
    assert set(await raw.zrange(f"{NAMESPACE}lru:X", 0, -1)) == {"50", "3", "4"}
    assert oldest == int(float((await raw.zrange(f"{NAMESPACE}lru:X", 0, 0, withscores=True))[0][1]))
    assert figures["Y"][0] == 100 and figures["Y"][2] == 1


async def test_blocks_being_prefilled_are_not_aged_out_by_the_claims_made_meanwhile(
    store: Any, raw: Redis
) -> None:
    """Replicas placing two new documents at once, each proposing the same backend, whose cache holds
    one: the first is being prefilled there, so the engine keeps it, and so must the store. The second
    claim sees that backend full (what a first placement compares), and the first keeps its owner."""
    a, b = await store(prefill_wait_s=5.0), await store(prefill_wait_s=5.0)
    await eventually(lambda: a.can_wait and b.can_wait)
    mark = a.new_mark()
    first = ClaimRequest((1, 2, 3), (100,) * 3, "111", "X", 300, ("X", "Y"), mark, True)
    assert (await claimed(a, first)).marked
    other = ClaimRequest((7, 8, 9), (100,) * 3, "111", "X", 300, ("X", "Y"), b.new_mark(), True)
    second = await claimed(b, other)
    assert second.chosen == "X"
    before = {backend: used for backend, used, _, _ in second.figures_before()}
    assert before["X"] == 300  # the first document, still held by its prefill
    assert await owners(raw, [1, 2, 3, 7, 8, 9]) == ["X"] * 6
    # Its prefill over and its request ended, the first document ages out as any other: the next
    # claim makes room, and the second document, still being prefilled, stays.
    a.prefilled(mark, first, "X")
    a.unpin("X", first)
    await eventually_equal(lambda: raw.get(f"{NAMESPACE}p:1"), None)
    await eventually_equal(lambda: _pinned_among(raw, "X", {1, 2, 3}), set())
    await claimed(b, ClaimRequest((20,), (100,), "1", "X", 300, (), "", False))
    assert await owners(raw, [1, 2, 3]) == [None, None, None]
    assert await owners(raw, [7, 8, 9, 20]) == ["X"] * 4


async def test_a_request_sent_after_a_prefill_touches_its_blocks_and_owns_the_ones_nobody_owns(
    store: Any, raw: Redis
) -> None:
    """While the prefill it waited for ran, other claims aged the prefix out of the footprint (the
    request that prefilled it has ended, and what it pinned with it): when the request goes there,
    they are the backend's most recent blocks again, and owned by it where nobody owns them."""
    shared = await store()
    prefilled = claim([1, 2], "X", capacity=200)
    await served(shared, raw, prefilled)
    await served(shared, raw, claim([3, 4], "X", capacity=200))  # pushes 2, then 1, out of it
    assert await owners(raw, [1, 2, 3, 4]) == [None, None, "X", "X"]
    shared.touch(prefilled, "X", 200)
    await eventually_equal(lambda: owners(raw, [1, 2]), ["X", "X"])
    assert await raw.zrange(f"{NAMESPACE}lru:X", 0, -1) == ["2", "1"]  # the others made room
    assert await owners(raw, [3, 4]) == [None, None]
    # A block another backend owns by now keeps its owner.
    await served(shared, raw, claim([7], "Y"))
    shared.touch(claim([7], "X"), "X", 200)
    await eventually_equal(lambda: raw.zrange(f"{NAMESPACE}lru:X", 0, -1), ["1", "7"])
    assert await owners(raw, [7]) == ["Y"]


async def test_footprints_report_each_listed_backend(store: Any) -> None:
    shared = await store()
    await claimed(shared, claim([1, 2], "X", sizes=[256, 512]))
    await claimed(shared, claim([9], "Y", sizes=[128]))
    answer = await claimed(shared, claim([20], "Y", sizes=[64], listed=("X", "Y", "W")))
    figures = {b: (used, oldest, entries) for b, used, oldest, entries in answer.figures}
    assert figures["X"][0] == 768 and figures["X"][2] == 2
    assert figures["Y"][0] == 192 and figures["Y"][2] == 2
    assert figures["W"] == (0, -1, 0)  # nothing placed there yet
    # On the shared clock, X's least recently used entry is older than Y's.
    assert figures["X"][1] < figures["Y"][1]


async def test_a_take_over_moves_the_blocks_the_claim_gave_the_owner(store: Any, raw: Redis) -> None:
    shared = await store()
    await claimed(shared, claim([1, 2], "X"))
    request = claim([1, 2, 3, 4], "Y")
    answer = await claimed(shared, request)
    assert (answer.chosen, answer.depth) == ("X", 2)  # the router then could not use X
    shared.take_over(Takeover("X", "Y", answer.depth), request, BIG)
    await eventually_equal(lambda: owners(raw, [1, 2, 3, 4]), ["X", "X", "Y", "Y"])
    assert set(await raw.zrange(f"{NAMESPACE}lru:X", 0, -1)) == {"1", "2"}
    assert set(await raw.zrange(f"{NAMESPACE}lru:Y", 0, -1)) == {"1", "2", "3", "4"}
    assert int(await raw.hget(f"{NAMESPACE}used", "X") or 0) == 200
    # A backend that cannot take requests at all loses every block it owns here.
    shared.take_over(Takeover("X", "Y", 0), request, BIG)
    await eventually_equal(lambda: owners(raw, [1, 2, 3, 4]), ["Y"] * 4)


async def test_a_request_in_flight_keeps_its_blocks_in_the_footprint_until_it_ends(
    store: Any, raw: Redis
) -> None:
    """The engine keeps a running request's blocks, so must the store: X's cache holds one document of
    three blocks; while the first one's request runs, the next documents placed there push out each
    other, not it, and the footprint says X is over its capacity (no room for a new prompt)."""
    a, b = await store(), await store()
    running = claim([1, 2, 3], "X", capacity=300)
    await claimed(a, running)
    assert await pinned(raw, "X") == {1: 1, 2: 1, 3: 1}
    await served(b, raw, claim([4, 5, 6], "X", capacity=300))
    answer = await served(b, raw, claim([7, 8, 9], "X", capacity=300, listed=("X",)))
    assert await owners(raw, [1, 2, 3]) == ["X"] * 3
    assert await owners(raw, [4, 5, 6]) == [None] * 3
    used, _, entries = {f[0]: f[1:] for f in answer.figures}["X"]
    assert (used, entries) == (600, 6)
    # Two requests hold the shallow block: it stays pinned until both end.
    await claimed(b, claim([1], "X", capacity=300))
    assert (await pinned(raw, "X"))[1] == 2
    a.unpin("X", running)
    await eventually_equal(lambda: pinned(raw, "X"), {1: 1})
    # Ended, the document ages like any other: the next one placed there pushes out its deep blocks.
    await served(b, raw, claim([10, 11, 12], "X", capacity=300))
    assert await owners(raw, [1, 2, 3, 7, 8, 9]) == ["X", None, None, None, None, None]


async def test_a_take_over_moves_the_pins_and_pins_expire_with_a_replica_gone(store: Any, raw: Redis) -> None:
    shared = await store()
    request = claim([1, 2], "X")
    await claimed(shared, request)
    shared.take_over(Takeover("X", "Y", 0), request, BIG)
    await eventually_equal(lambda: pinned(raw, "Y"), {1: 1, 2: 1})
    assert await pinned(raw, "X") == {}
    shared.unpin("Y", request)
    await eventually_equal(lambda: pinned(raw, "Y"), {})
    # A replica that dies with requests in flight: their pins go after their lifetime.
    gone = await store(pin_ttl_s=0.3)
    await claimed(gone, claim([5, 6], "X"))
    assert await pinned(raw, "X") == {5: 1, 6: 1}
    await eventually_equal(lambda: pinned(raw, "X"), {})


def _errors(shared: SharedPlacement, reason: str) -> float:
    registry: CollectorRegistry = shared.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("prefix_router_shared_state_errors_total", {"reason": reason}) or 0.0


def _up(shared: SharedPlacement) -> float | None:
    registry: CollectorRegistry = shared.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("prefix_router_shared_state_up")


async def test_a_store_that_goes_away_is_counted_logged_once_and_found_again(
    store: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_router.shared_state")
    shared = await store(reconnect_interval_s=0.1)
    assert _up(shared) == 1
    redis_server.kill()
    assert await shared.claim(claim([1], "X")) is None
    assert not shared.up and _up(shared) == 0
    assert _errors(shared, "connection") >= 1
    for _ in range(20):  # while down, no call is made: nothing more to count per request
        assert await shared.claim(claim([1], "X")) is None
    await asyncio.sleep(0.5)  # several reconnect attempts fail meanwhile
    downs = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1
    redis_server.start()
    await eventually(lambda: shared.up)
    answer = await shared.claim(claim([1], "X"))
    assert answer is not None and answer.chosen == "X"
    assert len([r for r in caplog.records if "is up" in r.getMessage()]) == 2  # at start, and now


async def test_a_slow_store_times_out_and_the_caller_routes_locally(store: Any, raw: Redis) -> None:
    shared = await store(timeout_s=0.05)
    # The server is busy for 0.3 s (a script that spins): each claim in that window times out.
    spin = (
        "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; while true do"
        " local n = redis.call('TIME'); if n[1] + n[2] / 1e6 - s > 0.3 then break end end return 1"
    )
    busy = asyncio.ensure_future(raw.eval(spin, 0))
    await asyncio.sleep(0.05)
    assert await shared.claim(claim([1], "X")) is None
    assert _errors(shared, "timeout") == 1
    assert shared.up  # one slow reply is that request's, not an outage
    await busy


async def test_a_claim_answered_too_late_leaves_no_mark_for_others_to_wait_on(
    store: Any, raw: Redis, redis_server: RedisServer
) -> None:
    """A claim whose answer comes after its timeout (a busy router's loop, a slow network) has run in
    the store all the same, marking its blocks pending under a prefill whose end its replica would
    never say: it routed locally, without the mark. Another replica's request would then wait out
    prefill_wait_s for nothing, and its pins would hold blocks no request holds. The mark is said
    ended and the claim given up at the timeout (or the cancellation): its pins go, and a claim that
    runs after that marks nothing."""
    relay = PartitionRelay(redis_server.port)
    await relay.start()
    slow = SharedPlacement(f"redis://127.0.0.1:{relay.port}/0", 0.2, CollectorRegistry(), prefill_wait_s=5.0)
    task = asyncio.get_running_loop().create_task(slow.run())
    try:
        other = await store(prefill_wait_s=5.0)
        await eventually(lambda: slow.can_wait and other.can_wait)
        # Connections open before the replies stop: a new one would wait for its handshake's reply.
        await asyncio.gather(*(claimed(slow, claim([100 + i], "W")) for i in range(3)))
        relay.hold_replies()
        late = ClaimRequest((1, 2, 3), (100,) * 3, "111", "X", BIG, (), slow.new_mark(), True)
        assert await slow.claim(late) is None
        await eventually_equal(lambda: owners(raw, [1, 2, 3]), ["X"] * 3)  # it ran
        relay.heal()
        pending = [f"{NAMESPACE}p:{b}" for b in (1, 2, 3)]
        await eventually_equal(lambda: raw.mget(pending), [None, None, None], timeout_s=2.0)
        # Nor pins: no request of this replica's holds those blocks on X (it routed locally).
        await eventually_equal(lambda: pinned(raw, "X"), {}, timeout_s=2.0)
        request = ClaimRequest((1, 2, 3, 4), (100,) * 4, "0111", "Y", BIG, (), "", True)
        follower = await claimed(other, request)
        assert (follower.chosen, follower.wait_for) == ("X", "")
        # The same when the request is cancelled (its client went away) while the answer is due.
        await asyncio.gather(*(claimed(slow, claim([200 + i], "W")) for i in range(3)))
        relay.hold_replies()
        gone = ClaimRequest((7, 8), (100,) * 2, "11", "X", BIG, (), slow.new_mark(), True)
        waiting = asyncio.ensure_future(slow.claim(gone))
        await eventually_equal(lambda: owners(raw, [7, 8]), ["X"] * 2)
        waiting.cancel()
        relay.heal()
        pending = [f"{NAMESPACE}p:{b}" for b in (7, 8)]
        await eventually_equal(lambda: raw.mget(pending), [None, None], timeout_s=2.0)
        await eventually_equal(lambda: _pinned_among(raw, "X", {7, 8}), set(), timeout_s=2.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await slow.close()
        await relay.stop()


async def test_a_claim_that_runs_after_its_mark_was_said_ended_marks_nothing(store: Any, raw: Redis) -> None:
    """The other order of the same race: the end said at the timeout reaches the store first."""
    shared = await store(prefill_wait_s=5.0)
    late = ClaimRequest((1, 2), (100,) * 2, "11", "X", BIG, (), shared.new_mark(), True)
    shared.prefilled(late.mark, late, "X")
    await eventually_equal(lambda: raw.exists(f"{NAMESPACE}e:{late.mark}"), 1)
    answer = await claimed(shared, late)
    assert answer.chosen == "X" and not answer.marked
    assert await raw.mget([f"{NAMESPACE}p:1", f"{NAMESPACE}p:2"]) == [None, None]
    assert 0 < await raw.pttl(f"{NAMESPACE}e:{late.mark}") <= 5000  # gone with the marks it outlives


async def test_a_claim_that_runs_after_its_replica_gave_up_on_it_pins_nothing(store: Any, raw: Redis) -> None:
    """The give-up sent at the timeout reaches the store before the claim: the claim places and
    counts as ever, but pins nothing, since the request it stood for went elsewhere. Both the give-up
    and the receipt of a claim that pinned expire."""
    shared = await store()
    request = claim([1, 2], "X")
    first_id = 1  # a new replica's claims are numbered from 1
    await raw.eval(shared_state.GIVE_UP_SCRIPT, 0, NAMESPACE, shared.replica, first_id, "1\n2", 5000)
    answer = await claimed(shared, request)
    assert answer.chosen == "X" and await owners(raw, [1, 2]) == ["X", "X"]
    assert await pinned(raw, "X") == {}
    assert 0 < await raw.pttl(f"{NAMESPACE}x:{shared.replica}:{first_id}") <= 5000
    await claimed(shared, claim([3], "X"))
    assert await pinned(raw, "X") == {3: 1}
    receipt = f"{NAMESPACE}pc:{shared.replica}:{first_id + 1}"
    assert await raw.get(receipt) == "X"
    assert 0 < await raw.pttl(receipt) <= shared_state.CLAIM_RECEIPT_TTL_S * 1000


async def test_a_wrong_reply_is_counted_and_said_once_without_calling_the_store_down(
    store: Any, raw: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefix_router.shared_state")
    shared = await store()
    await raw.set(f"{NAMESPACE}clock", "not a number")  # INCRBY in the script now fails
    for _ in range(3):
        assert await shared.claim(claim([1], "X")) is None
    assert _errors(shared, "reply") == 3
    assert shared.up
    assert len([r for r in caplog.records if "answered with an error" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if "is down" in r.getMessage()]


async def test_a_prefill_one_replica_opens_is_waited_for_by_another_until_its_end(
    store: Any, raw: Redis
) -> None:
    a, b = await store(prefill_wait_s=5.0), await store(prefill_wait_s=5.0)
    await eventually(lambda: a.can_wait and b.can_wait)
    mark = a.new_mark()
    first = claim([1, 2, 3], "X")
    first = ClaimRequest(first.blocks, first.sizes, first.follow, "X", BIG, (), mark, True)
    opened = await claimed(a, first)
    assert opened.marked and opened.wait_for == ""
    assert await raw.get(f"{NAMESPACE}p:3") == mark
    assert 0 < await raw.pttl(f"{NAMESPACE}p:3") <= 5000  # a dead replica's marks expire
    # The same prefix and a question of its own, from the other replica: it follows X and learns
    # that X is prefilling the prefix right now; its own new block is its own prefill.
    other = b.new_mark()
    second = await claimed(b, ClaimRequest((1, 2, 3, 4), (100,) * 4, "0111", "Y", BIG, (), other, True))
    assert (second.chosen, second.followed, second.wait_for, second.marked) == ("X", True, mark, True)
    assert await raw.get(f"{NAMESPACE}p:4") == other
    # Not asked to wait (a retry, or holds off): no mark reported.
    quiet = await claimed(b, ClaimRequest((1, 2, 3, 5), (100,) * 4, "0111", "Y", BIG, (), "", False))
    assert quiet.wait_for == "" and not quiet.marked
    waiter = asyncio.ensure_future(b.wait_prefilled(mark, 5.0))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    a.prefilled(mark, first, "W")  # A's first byte came, on W: A's request went there after all
    assert await asyncio.wait_for(waiter, 5.0) == ("ready", "W")
    assert await raw.get(f"{NAMESPACE}p:3") is None
    assert await raw.get(f"{NAMESPACE}p:4") == other  # another prefill's mark stays
    # An end heard before the wait began (the answer came after the message) is not waited for.
    assert await asyncio.wait_for(b.wait_prefilled(mark, 5.0), 1.0) == ("ready", "W")
    after = await claimed(b, ClaimRequest((1, 2, 3, 6), (100,) * 4, "0111", "Y", BIG, (), "", True))
    assert after.wait_for == ""


async def test_a_prefill_that_does_not_cover_the_request_or_is_elsewhere_is_not_waited_for(
    store: Any,
) -> None:
    a, b = await store(prefill_wait_s=5.0), await store(prefill_wait_s=5.0)
    await eventually(lambda: a.can_wait and b.can_wait)
    await claimed(a, ClaimRequest((1, 2), (100, 100), "11", "X", BIG, (), a.new_mark(), True))
    # The pending blocks cover too little of this request (follow says 0 at depth 2): not followed.
    thin = await claimed(b, ClaimRequest((1, 2, 7, 8), (100,) * 4, "0001", "Y", BIG, (), "", True))
    assert (thin.chosen, thin.followed, thin.wait_for) == ("Y", False, "")
    # Deeper blocks on Y now: a request following Y does not wait for X's prefill of 1, 2.
    deep = await claimed(b, ClaimRequest((1, 2, 7, 8, 9), (100,) * 5, "01111", "Z", BIG, (), "", True))
    assert (deep.chosen, deep.wait_for) == ("Y", "")


async def test_a_wait_ends_at_its_bound_and_when_the_subscription_is_lost(
    store: Any, redis_server: RedisServer
) -> None:
    shared = await store(prefill_wait_s=5.0, reconnect_interval_s=0.1)
    await eventually(lambda: shared.can_wait)
    assert await shared.wait_prefilled("nobody:1", 0.2) == ("timeout", "")
    waiter = asyncio.ensure_future(shared.wait_prefilled("nobody:2", 30.0))
    await asyncio.sleep(0.1)
    redis_server.kill()
    # Nobody could say that prefill ended now: the request goes on at once, not after 30 s.
    assert await asyncio.wait_for(waiter, 10.0) is None
    assert not shared.can_wait
    assert await shared.wait_prefilled("nobody:3", 30.0) is None
    redis_server.start()
    await eventually(lambda: shared.can_wait, timeout_s=10)


async def test_each_claim_carries_its_replicas_counts_and_answers_the_others(store: Any) -> None:
    loads = [LoadTracker(), LoadTracker()]
    a, b = await store(load=loads[0]), await store(load=loads[1])
    mine = [loads[0].acquire("X"), loads[0].acquire("X"), loads[0].acquire("W")]
    first = await claimed(a, claim([1], "X"))
    # The request goes where its claim counted it, as the router sends it: any write of A's counts,
    # whichever order the store runs them in, then says the same.
    mine.append(loads[0].acquire(first.counted_on))
    assert first.peers == ()  # nobody else has anything in flight
    # A's counts as it sent them, with the request it claimed for counted on X.
    answer = await claimed(b, claim([2], "Y"))
    assert dict(answer.peers) == {"X": 3, "W": 1}
    lease = loads[1].acquire("Y")  # the request B claimed for: the store counted it already
    back = await claimed(a, claim([3], "X"))
    mine.append(loads[0].acquire(back.counted_on))
    assert dict(back.peers) == {"Y": 1}  # never A's own
    assert await _peers(b, [9]) == {"X": 4, "W": 1}
    for held in mine:
        held.release()
    lease.release()
    # No more claims from A: its releases reach the store in the background.
    await eventually_equal(lambda: _peers(b, [9]), {})
    assert a.load_writes >= 1


async def test_each_claim_carries_the_bytes_its_replicas_requests_hold_and_answers_the_others(
    store: Any,
) -> None:
    """Replicas placing new prompts at once must see the KV room each other's requests take."""
    held_by_a = {"X": 5000}
    a = await store(load=LoadTracker(), held=lambda: dict(held_by_a))
    b = await store(load=LoadTracker())
    first = await claimed(a, claim([1, 2], "X", sizes=[300, 200]))
    assert first.peers_held == ()
    answer = await claimed(b, claim([9], "Y"))
    # What A holds as it said, and what its claim just placed on X, before A's own figure has it.
    assert dict(answer.peers_held) == {"X": 5500}
    assert dict(answer.peers) == {"X": 1}, "bytes held are not requests in flight"
    held_by_a.clear()
    held_by_a["W"] = 100  # A's requests on X ended, one on W holds 100 bytes: its next write says so
    await eventually_equal(lambda: _held(b, [9]), {"W": 100})
    held_by_a.clear()
    await eventually_equal(lambda: _held(b, [9]), {})


async def test_a_claim_takes_the_kv_room_of_the_blocks_no_request_in_flight_holds(
    store: Any, raw: Redis
) -> None:
    """A prompt whose requests ended is still in the footprint, but the engine pins it again for the
    next one: that claim adds nothing to the footprint and still takes its room; a second request in
    flight for it at once takes none."""
    a, b = await store(), await store()
    await served(a, raw, claim([1, 2], "X", sizes=[300, 200]))
    again = await claimed(a, claim([1, 2], "X", sizes=[300, 200]))
    assert (again.added, again.taken) == (0, 500)
    beside = await claimed(b, claim([1, 2, 3], "X", sizes=[300, 200, 50]))
    assert (beside.added, beside.taken) == (50, 50)


async def _held(shared: SharedPlacement, blocks: list[int]) -> dict[str, int]:
    return dict((await claimed(shared, claim(blocks, "Z"))).peers_held)


async def test_a_replicas_counts_expire_when_it_writes_no_more(store: Any) -> None:
    load = LoadTracker()
    a = await store(load=load, load_ttl_s=0.3)
    b = await store(load_ttl_s=0.3)
    placed = await claimed(a, claim([1], "X"))
    load.acquire(placed.counted_on)  # the request goes there and never ends
    assert dict((await claimed(b, claim([2], "Y"))).peers) == {"X": 1}
    a._up = False  # as a replica that died: nothing writes them again, nothing deletes them
    await asyncio.sleep(0.5)
    assert (await claimed(b, claim([3], "Y"))).peers == ()


async def test_counts_a_claim_put_on_a_backend_the_request_did_not_go_to_are_written_again_at_once(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_state, "LOAD_FLUSH_S", 30.0)  # no periodic write comes in time
    load = LoadTracker()
    a, b = await store(load=load), await store()
    await claimed(a, claim([1], "X"))  # the script counts the request on X
    lease = load.acquire("Y")  # but it went to Y
    a.counts_moved()
    await eventually_equal(lambda: _peers(b, [9]), {"Y": 1})
    lease.release()


async def test_a_claim_still_in_flight_is_counted_by_the_claims_written_meanwhile(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a burst, each claim writes the replica's counts: those must include the requests whose
    claims are still in flight (they take a lease as their answer comes), or the last one written
    hides them from the other replicas."""
    monkeypatch.setattr(shared_state, "LOAD_FLUSH_S", 30.0)  # only the claims write
    a, b = await store(load=LoadTracker()), await store()
    gate = asyncio.Event()
    script = a._claim

    async def held_back(**kwargs: Any) -> Any:
        await gate.wait()
        return await script(**kwargs)

    a._claim = held_back
    first = asyncio.create_task(claimed(a, claim([1], "X")))
    await asyncio.sleep(0)  # its counts are taken; its call waits at the gate
    a._claim = script
    await claimed(a, claim([2], "X"))
    assert await _peers(b, [9]) == {"X": 2}
    gate.set()
    await first


async def test_a_claim_in_flight_is_counted_where_its_own_script_counted_it(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim whose script ran but whose answer has not come back yet is counted, by the claims its
    replica writes meanwhile, where the store counted it (here the owner it followed), not where the
    replica proposed; and a claim sent later whose script ran first is not hidden by the earlier one's
    write."""
    monkeypatch.setattr(shared_state, "LOAD_FLUSH_S", 30.0)  # only the claims write
    a, b = await store(load=LoadTracker()), await store()
    await claimed(b, claim([1], "Y"))  # Y owns the prefix
    gate = asyncio.Event()
    script = a._claim

    async def answer_held_back(**kwargs: Any) -> Any:
        reply = await script(**kwargs)
        await gate.wait()
        return reply

    a._claim = answer_held_back
    first = asyncio.create_task(claimed(a, claim([1], "X")))
    await asyncio.sleep(0.2)  # its script ran: it follows Y, counted there; its answer waits
    a._claim = script
    second = await claimed(a, claim([1], "X"))
    assert second.counted_on == "Y"
    assert await _peers(b, [9]) == {"Y": 2}
    gate.set()
    assert (await first).counted_on == "Y"

    async def script_held_back(**kwargs: Any) -> Any:
        await gate.wait()
        return await script(**kwargs)

    gate.clear()
    a._claim = script_held_back
    early = asyncio.create_task(claimed(a, claim([1], "X")))
    await asyncio.sleep(0)  # sent (its counts taken) before the next one; its script waits
    a._claim = script
    await claimed(a, claim([1], "X"))  # sent after, run first
    gate.set()
    await early  # its write comes last
    # The later claim's request took its lease after the earlier one's counts were taken: counted.
    assert await _peers(b, [9]) == {"Y": 2}, "the earlier claim's write does not hide the later one"


async def _peers(shared: SharedPlacement, blocks: list[int]) -> dict[str, int]:
    return dict((await claimed(shared, claim(blocks, "Z"))).peers)


async def test_the_answer_names_the_other_backends_that_hold_the_prefix_followed(
    store: Any, raw: Redis
) -> None:
    shared = await store()
    spilled = claim([1, 2, 3], "X")
    await claimed(shared, spilled)
    shared.take_over(Takeover("X", "Y", 3), spilled, BIG)  # X was full: the request went to Y

    async def on_y() -> bool:
        return await raw.zscore(f"{NAMESPACE}lru:Y", "3") is not None

    await eventually(on_y)
    answer = await claimed(shared, claim([1, 2, 3, 4], "Z", listed=("W", "Y", "X", "Z")))
    assert (answer.chosen, answer.followed, answer.holders) == ("X", True, ("Y",))
    thin = await claimed(shared, claim([1, 2, 3, 5], "Z", follow="0000", listed=("Y",)))
    assert not thin.followed and thin.holders == ()


async def test_an_owner_full_by_the_fleets_counts_is_said_full_and_the_request_counted_on_a_holder(
    store: Any, raw: Redis
) -> None:
    """The replica sends a request whose owner is at the follow limit to the first holder with room:
    the store counts it there at once, so the claims other replicas make before this one's next write
    see it where it goes, and says which backends are full by everyone's counts, not only the
    replica's own."""
    loads = [LoadTracker(), LoadTracker()]
    a, b = await store(load=loads[0]), await store(load=loads[1])
    spilled = claim([1, 2, 3], "X")
    await claimed(a, spilled)
    a.take_over(Takeover("X", "Y", 3), spilled, BIG)  # Y holds the prefix too

    async def on_y() -> bool:
        return await raw.zscore(f"{NAMESPACE}lru:Y", "3") is not None

    await eventually(on_y)
    leases = [loads[0].acquire("X"), loads[0].acquire("X")]
    await claimed(a, claim([9], "Z"))  # A's counts now: 2 on X, 1 on Z
    answer = await claimed(b, claim([1, 2, 3, 4], "X", listed=("X", "Y", "Z"), follow_limit=2))
    assert (answer.chosen, answer.followed, answer.holders) == ("X", True, ("Y",))
    assert answer.full == {"X"} and answer.counted_on == "Y"
    assert await _peers(a, [8]) == {"Y": 1}  # B's request, where B sends it
    # Without a limit nothing is full, and the request is counted on the owner.
    free = await claimed(b, claim([1, 2, 3, 5], "X", listed=("X", "Y", "Z")))
    assert free.full == frozenset() and free.counted_on == "X"
    for lease in leases:
        lease.release()


async def test_a_store_called_down_for_its_timeouts_lets_its_waiters_go(store: Any, raw: Redis) -> None:
    shared = await store(timeout_s=0.05, prefill_wait_s=30.0)
    await eventually(lambda: shared.can_wait)
    waiter = asyncio.ensure_future(shared.wait_prefilled("slow:1", 30.0))
    spin = (
        "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; while true do"
        " local n = redis.call('TIME'); if n[1] + n[2] / 1e6 - s > 0.5 then break end end return 1"
    )
    busy = asyncio.ensure_future(raw.eval(spin, 0))
    await asyncio.sleep(0.05)
    for _ in range(3):  # three timeouts in a row: down
        assert await shared.claim(claim([1], "X")) is None
    assert not shared.up and not shared.can_wait
    # The end of that prefill may never be heard now: the request goes on, not after 30 s.
    assert await asyncio.wait_for(waiter, 1.0) is None
    await busy


async def test_the_subscription_opens_as_soon_as_the_store_answers(store: Any) -> None:
    # Not after a reconnect interval: a router's first requests would otherwise never wait for the
    # prefills other routers start (a long interval makes the difference plain).
    shared = await store(prefill_wait_s=5.0, reconnect_interval_s=60.0)
    await eventually(lambda: shared.can_wait, timeout_s=10.0)


def placing(blocks: list[int], proposed: str, room: str, capacities: tuple[float, ...]) -> ClaimRequest:
    """A first placement the store makes: the replica proposed `proposed` on what it knew."""
    base = claim(blocks, proposed, sizes=[300] * len(blocks), listed=("X", "Y", "Z"))
    return ClaimRequest(
        base.blocks,
        base.sizes,
        base.follow,
        proposed,
        capacities[0],
        base.listed,
        room=room,
        capacities=capacities,
    )


async def test_replicas_placing_new_prompts_at_once_do_not_take_the_same_room(store: Any) -> None:
    """Two replicas see the same backend as the roomiest and both propose it: the store places the
    first there, counts the room its request takes, and places the second where room is left."""
    caps = (1000.0, 1000.0, 1000.0)
    a = await store(load=LoadTracker(), held=dict)
    b = await store(load=LoadTracker(), held=dict)
    first = await claimed(a, placing([1, 2], "X", "111", caps))
    assert (first.chosen, first.followed, first.counted_on, first.taken) == ("X", False, "X", 600)
    # B's view is as stale as A's was: it proposes X too. 400 bytes are left there for 600.
    second = await claimed(b, placing([5, 6], "X", "111", caps))
    assert (second.chosen, second.followed, second.counted_on) == ("Y", False, "Y")
    # The footprints say where the blocks went: a third new prompt goes to the one still empty.
    third = await claimed(b, placing([7], "X", "111", caps))
    assert third.chosen == "Z"
    # Where the replica may not place (at its load bound, or not a candidate), the store does not:
    # Z, the emptiest, is left out; X is the only one allowed.
    fourth = await claimed(a, placing([8], "Y", "100", caps))
    assert fourth.chosen == "X"
    # Without room bits (ring placement, or no ledgers), the proposal stands as before.
    plain = await claimed(a, claim([9], "X", sizes=[300], listed=("X", "Y", "Z")))
    assert plain.chosen == "X"


async def test_a_first_placement_never_overrides_a_followed_owner(store: Any) -> None:
    caps = (1000.0, 1000.0, 1000.0)
    a = await store(load=LoadTracker(), held=dict)
    await claimed(a, claim([1, 2, 3], "Z", sizes=[300] * 3, listed=("X", "Y", "Z")))
    again = await claimed(a, placing([1, 2, 3], "X", "111", caps))
    assert (again.chosen, again.followed) == ("Z", True)


async def test_a_requests_end_reaches_the_other_replicas_at_once(
    store: Any, raw: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot and the KV room a request frees are taken the next moment, often through another
    replica: its end is written at once, not with the next periodic write."""
    monkeypatch.setattr(shared_state, "LOAD_FLUSH_S", 30.0)  # no periodic write comes in time
    load = LoadTracker()
    a, b = await store(load=load), await store()
    request = claim([1, 2], "X")
    answer = await claimed(a, request)
    lease = load.acquire(answer.counted_on)
    assert await _peers(b, [9]) == {"X": 1}
    assert await pinned(raw, "X") == {1: 1, 2: 1}
    lease.release()  # the request ends, as the router ends it: lease, then the claim's pins
    a.unpin(answer.chosen, request)
    await eventually_equal(lambda: _peers(b, [9]), {})
    await eventually_equal(lambda: pinned(raw, "X"), {})


async def test_a_turn_after_a_prompt_too_short_to_claim_goes_to_whoever_took_that_prompt(
    store: Any, raw: Redis
) -> None:
    """One replica notes who took a prompt that filled no block; another's first placement of the
    next turn goes there while it may place there, else by room as before."""
    caps = (1000.0, 1000.0, 1000.0)
    a = await store(load=LoadTracker(), held=dict)
    b = await store(load=LoadTracker(), held=dict)
    await claimed(a, placing([1, 2], "X", "111", caps))  # X holds the most now: Y or Z are roomier
    a.prompt_taken(4242, "X")
    key = f"{NAMESPACE}t:4242"
    await eventually_equal(lambda: raw.get(key), "X")
    assert 0 < await raw.pttl(key) <= shared_state.PROMPT_TAKER_TTL_S * 1000
    turn = dataclasses.replace(placing([5, 6], "Y", "111", caps), previous_end=4242)
    followed = await claimed(b, turn)
    assert (followed.chosen, followed.turn_taken, followed.followed) == ("X", True, False)
    assert await raw.get(f"{NAMESPACE}o:5") == "X"  # its blocks are owned there: the next turn follows
    # X is not one the replica may place on now: placed by room instead.
    held_back = dataclasses.replace(placing([7, 8], "Y", "011", caps), previous_end=4242)
    elsewhere = await claimed(b, held_back)
    assert elsewhere.chosen != "X" and not elsewhere.turn_taken
    # A prompt end nobody noted: placed by room.
    unknown = dataclasses.replace(placing([9], "Y", "111", caps), previous_end=77)
    assert not (await claimed(b, unknown)).turn_taken
