"""The bounded-load predicate (worked arithmetic), leases, and the external load signal."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.load import LoadTracker, least_bound, load_bound, load_ok

BIG = 10_000  # a max_inflight that never binds


@pytest.mark.parametrize(
    ("load", "total", "n", "c", "max_inflight", "expected"),
    [
        # ceil(1.25 * (0 + 1) / 4) = ceil(0.3125) = 1; 0 + 1 <= 1
        pytest.param(0, 0, 4, 1.25, BIG, True, id="empty-fleet"),
        # ceil(1.25 * 9 / 4) = ceil(2.8125) = 3; 2 + 1 <= 3
        pytest.param(2, 8, 4, 1.25, BIG, True, id="2-of-8-fits"),
        # 3 + 1 <= 3 is false: the +1 is the request being placed
        pytest.param(3, 8, 4, 1.25, BIG, False, id="3-of-8-full"),
        # ceil(1.0 * (4 + 1) / 4) = 2; 1 + 1 <= 2. Without the +1 on total: ceil(4 / 4) = 1 -> False
        pytest.param(1, 4, 4, 1.0, BIG, True, id="total-plus-one"),
        # ceil(1.0 * 4 / 4) = 1; 1 + 1 <= 1 false
        pytest.param(1, 3, 4, 1.0, BIG, False, id="c1-strict"),
        # ceil(1.0 * 6 / 4) = ceil(1.5) = 2; 1 + 1 <= 2. With a floor (or round-half-down) it would be 1
        pytest.param(1, 5, 4, 1.0, BIG, True, id="ceil-not-floor"),
        # ceil(2.0 * 11 / 2) = 11; 10 + 1 <= 11
        pytest.param(10, 10, 2, 2.0, BIG, True, id="c2-edge"),
        pytest.param(11, 10, 2, 2.0, BIG, False, id="c2-over"),
        # single backend: ceil(1.25 * 6) = 8, so load 5 fits
        pytest.param(5, 5, 1, 1.25, BIG, True, id="one-backend"),
        # max_inflight: 3 + 1 > 3 whatever the mean says
        pytest.param(3, 100, 4, 1.25, 3, False, id="max-inflight-binds"),
        pytest.param(2, 100, 4, 1.25, 3, True, id="max-inflight-edge"),
        pytest.param(0, 0, 4, 1.25, 0, False, id="max-inflight-zero"),
        pytest.param(0, 0, 0, 1.25, BIG, False, id="no-backends"),
        # fractional load from the external signal: ceil(1.25 * 9.5 / 4) = ceil(2.97) = 3; 2.5 + 1 > 3
        pytest.param(2.5, 8.5, 4, 1.25, BIG, False, id="fractional-load"),
        pytest.param(1.5, 8.5, 4, 1.25, BIG, True, id="fractional-fits"),
    ],
)
def test_load_ok_worked_arithmetic(
    load: float, total: float, n: int, c: float, max_inflight: int, expected: bool
) -> None:
    assert load_ok(load, total, n, c, max_inflight) is expected


@pytest.mark.parametrize(
    ("load", "total", "floor", "max_inflight", "expected"),
    [
        # 4 backends, c=1.25, 8 in flight: ceil(1.25 * 9 / 4) = 3, but the floor of 8 lifts the bound
        pytest.param(3, 8, 8, BIG, True, id="floor-lifts-a-small-bound"),
        pytest.param(7, 8, 8, BIG, True, id="floor-edge"),
        pytest.param(8, 8, 8, BIG, False, id="floor-reached"),
        # at 100 in flight the relative bound, ceil(1.25 * 101 / 4) = 32, is above the floor and rules
        pytest.param(31, 100, 8, BIG, True, id="relative-bound-above-floor"),
        pytest.param(32, 100, 8, BIG, False, id="relative-bound-binds"),
        # max_inflight still binds below the floor
        pytest.param(3, 8, 8, 4, True, id="max-inflight-below-floor-edge"),
        pytest.param(4, 8, 8, 4, False, id="max-inflight-below-floor"),
    ],
)
def test_load_floor_worked_arithmetic(
    load: float, total: float, floor: int, max_inflight: int, expected: bool
) -> None:
    assert load_ok(load, total, 4, 1.25, max_inflight, floor) is expected


@settings(max_examples=300)
@given(
    st.floats(0, 1e12),
    st.integers(1, 1000),
    st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    st.integers(1, 64),
    st.integers(0, 64),
)
def test_load_bound_never_falls_below_least_bound(
    total: float, n: int, c: float, max_inflight: int, floor: int
) -> None:
    # The picker lets a backend at or under least_bound through without computing load_bound.
    assert load_bound(total, n, c, max_inflight, floor) >= least_bound(max_inflight, floor)


def test_a_figure_that_is_not_finite_is_no_figure() -> None:
    tracker = LoadTracker()
    tracker.acquire("a")
    for figure in (math.inf, -math.inf, math.nan):
        tracker.set_external("a", figure)
        tracker.set_external("b", 3.0)
        tracker.set_external("b", figure)  # replaces b's figure: nothing of it may stay behind
        assert (tracker.load("a"), tracker.load("b")) == (1, 0)
        assert tracker.total_load() == 1


@pytest.mark.parametrize("total", [pytest.param(1e308, id="1e308"), pytest.param(1.7e308, id="max-float")])
def test_a_huge_total_leaves_the_absolute_bound(total: float) -> None:
    # 1.25 * (1.7e308 + 1) is past the largest float: only max_inflight can still say no.
    assert load_ok(31, total, 2, 1.25, 32) is True
    assert load_ok(32, total, 2, 1.25, 32) is False


def test_load_ok_is_not_fooled_by_float_rounding() -> None:
    # Regression: 1.1 * 100 / 2 == 55.00000000000001 in floats; a plain ceil made the bound 56.
    # ceil(1.1 * (99 + 1) / 2) = ceil(55) = 55, so a backend already at 55 must not take one more.
    assert load_ok(55, 99, 2, 1.1, BIG) is False


@settings(max_examples=200)
@given(st.integers(0, 200), st.integers(1, 20), st.sampled_from([1.0, 1.25, 1.5, 2.0]), st.integers(1, 64))
def test_load_ok_is_monotone_in_load(total: int, n: int, c: float, max_inflight: int) -> None:
    results = [load_ok(load, total, n, c, max_inflight) for load in range(total + 2)]
    assert results == sorted(results, reverse=True)  # True..True False..False
    # and the last load that fits is exactly the formula's
    fits = sum(results)
    assert fits == min(max_inflight, math.ceil(c * (total + 1) / n), total + 2)


def test_lease_release_is_idempotent() -> None:
    tracker = LoadTracker()
    a, b = tracker.acquire("x"), tracker.acquire("x")
    assert tracker.inflight("x") == 2
    a.release()
    a.release()
    assert a.released
    assert not b.released
    assert tracker.inflight("x") == 1
    assert tracker.total_inflight() == 1
    b.release()
    assert tracker.inflight("x") == 0
    assert tracker.total_inflight() == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from("abcd")),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(OPS)
def test_leases_balance_to_zero(ops: list[tuple[str, object]]) -> None:
    tracker = LoadTracker()
    leases = []
    for op, arg in ops:
        if op == "acquire":
            assert isinstance(arg, str)
            leases.append(tracker.acquire(arg))
        elif leases:
            assert isinstance(arg, int)
            leases[arg % len(leases)].release()  # may well be a second release
        open_ = [lease for lease in leases if not lease.released]
        for backend in "abcd":
            assert tracker.inflight(backend) == sum(1 for lease in open_ if lease.backend_id == backend)
        assert tracker.total_inflight() == len(open_) == sum(tracker.inflight(b) for b in "abcd")
        assert tracker.total_load() == tracker.total_inflight()
    for lease in leases:
        lease.release()
    assert tracker.total_inflight() == 0
    assert all(tracker.inflight(b) == 0 for b in "abcd")


def test_external_signal_arithmetic() -> None:
    tracker = LoadTracker()
    mine = [tracker.acquire("a") for _ in range(2)]
    tracker.set_external("a", 5.0)  # 2 of the 5 are ours: 3 belong to other replicas
    assert tracker.load("a") == 5.0
    assert tracker.total_load() == 5.0
    tracker.acquire("a")  # one more since the scrape
    assert tracker.load("a") == 6.0
    mine[0].release()
    assert tracker.load("a") == 5.0
    tracker.set_external("b", 4.0)  # nothing of ours on b
    assert tracker.load("b") == 4.0
    assert tracker.total_load() == 9.0
    tracker.set_external("a", 1.0)  # the backend says fewer than we hold: never below our own count
    assert tracker.load("a") == 2.0
    assert tracker.total_load() == 6.0
    tracker.clear_external("b")
    tracker.clear_external("b")
    assert tracker.load("b") == 0
    assert tracker.total_load() == 2.0
    assert tracker.total_inflight() == 2


EXT_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from("abc"), st.just(0)),
        st.tuples(st.just("release"), st.sampled_from("abc"), st.integers(0, 30)),
        st.tuples(st.just("set"), st.sampled_from("abc"), st.integers(0, 20)),
        st.tuples(st.just("clear"), st.sampled_from("abc"), st.just(0)),
        st.tuples(st.just("peers"), st.sampled_from("abc"), st.integers(0, 20)),
        st.tuples(st.just("no_peers"), st.sampled_from("abc"), st.just(0)),
        st.tuples(st.just("peer"), st.sampled_from("abc"), st.integers(0, 20)),
    ),
    max_size=50,
)


@settings(max_examples=200)
@given(EXT_OPS)
def test_total_load_is_the_sum_of_loads(ops: list[tuple[str, str, int]]) -> None:
    tracker = LoadTracker()
    leases = []
    for op, backend, n in ops:
        if op == "acquire":
            leases.append(tracker.acquire(backend))
        elif op == "release" and leases:
            leases[n % len(leases)].release()
        elif op == "set":
            tracker.set_external(backend, float(n))
        elif op == "clear":
            tracker.clear_external(backend)
        elif op == "peers":
            tracker.set_peers([(backend, n), ("z", 0)])
        elif op == "no_peers":
            tracker.clear_peers()
        elif op == "peer":
            tracker.set_peer(backend, n)
        assert tracker.total_load() == pytest.approx(sum(tracker.load(b) for b in "abc"))
        assert all(tracker.load(b) >= tracker.inflight(b) for b in "abc")


def test_the_other_replicas_counts_from_the_store_replace_the_scraped_share() -> None:
    load = LoadTracker()
    mine = [load.acquire("a"), load.acquire("a"), load.acquire("b")]
    load.set_external("a", 9.0)  # scraped: 7 of a's 9 are the others'
    assert load.load("a") == 9
    load.set_peers([("a", 3), ("c", 4)])  # the store knows each replica's own count
    assert (load.load("a"), load.load("b"), load.load("c")) == (5, 1, 4)
    assert load.total_load() == 3 + 7
    load.set_peers([("c", 1)])  # a full picture each time: a backend left out has none
    assert (load.load("a"), load.load("c"), load.total_load()) == (2, 1, 4)
    load.set_peer("a", 6)  # one backend's figure heard since (a prefill's end there)
    assert (load.load("a"), load.load("c"), load.total_load()) == (8, 1, 10)
    load.clear_peers()  # the store went away: the scraped figure again
    assert (load.load("a"), load.load("c")) == (9, 0)
    load.set_peer("c", 5)  # nothing known of the others: one figure alone does not stand for them
    assert load.load("c") == 0
    for lease in mine:
        lease.release()
    assert load.local_counts() == {}


def test_placements_since_the_scrape_count_for_the_other_replicas_too() -> None:
    load = LoadTracker()
    for _ in range(2):
        load.acquire("a")
    load.acquire("b")
    # Three replicas with an even split: each backend's figure is three times this replica's count.
    load.set_external("a", 6.0, local_then=2)
    load.set_external("b", 3.0, local_then=1)
    assert load.estimate_replicas() == 3.0
    assert load.load("a") == 2 + (6 - 2)
    load.acquire("a")  # one more here since the scrape: the two others likely placed one each
    assert load.load("a") == 3 + (6 - 2) + 2 * 1
    assert load.total_load() == 4 + (6 - 2) + (3 - 1) + 2 * 1
    load.set_external("a", 9.0, local_then=3)  # the next scrape replaces the extrapolation
    assert load.load("a") == 3 + (9 - 3)


def test_replica_estimate_is_one_without_other_traffic_and_bounded() -> None:
    load = LoadTracker()
    assert load.estimate_replicas() == 1.0
    load.acquire("a")
    load.set_external("a", 1.0, local_then=1)
    assert load.estimate_replicas() == 1.0
    load.acquire("a")
    assert load.load("a") == 2  # a lone replica adds nothing for others
    load.set_external("a", 500.0, local_then=1)
    assert load.estimate_replicas() == 8.0  # capped: a huge figure is not 500 replicas
