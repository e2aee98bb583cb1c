"""BackendSet: membership, ejection and its cap, probe grace, draining, slow start (fake clock)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy, HealthState
from prefix_router.routing.hashing import hash_bytes
from prefix_router.routing.load import LoadTracker

URLS = [f"http://10.0.3.{i}:8000" for i in range(4)]
A, B, C, D = URLS
KEYS = [hash_bytes(i.to_bytes(8, "little")) for i in range(5000)]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(
    urls: list[str] = URLS, clock: Clock | None = None, load: LoadTracker | None = None, **policy: Any
) -> BackendSet:
    return BackendSet(
        [BackendSpec(u) for u in urls],
        vnodes=64,
        health=HealthPolicy(**policy),
        load=load,
        clock=clock or Clock(),
    )


def fail(bs: BackendSet, url: str, times: int, *, probe: bool = False) -> None:
    for _ in range(times):
        bs.record_failure(url, probe=probe)


def state(bs: BackendSet, url: str) -> HealthState:
    backend = bs.get(url)
    assert backend is not None
    return backend.state


def placement(bs: BackendSet) -> list[str | None]:
    """Where each key goes: the first candidate of its ring walk (what the picker does when idle)."""
    members = bs.candidates.members
    return [next((b for b in bs.ring.walk(k) if b in members), None) for k in KEYS]


def test_initial_state() -> None:
    bs = make()
    assert bs.candidates.ids == tuple(sorted(URLS))
    assert bs.ring.members == tuple(sorted(URLS))
    assert not bs.is_ready()  # configured is not ready: no backend has answered a probe yet
    bs.record_success(A, probe=False)
    assert not bs.is_ready()  # nor is a request served
    bs.record_success(A, probe=True)
    assert bs.is_ready()
    assert not bs.all_ejected_override
    assert bs.get("http://nope:1") is None


def test_ejection_after_threshold() -> None:
    bs = make(unhealthy_threshold=3)
    fail(bs, A, 2)
    assert A in bs.candidates.members
    fail(bs, A, 1)
    assert state(bs, A) is HealthState.EJECTED
    assert A not in bs.candidates.members
    assert A in bs.ring.members  # health never rebuilds the ring
    assert not bs.all_ejected_override


def test_success_resets_consecutive_failures() -> None:
    bs = make(unhealthy_threshold=3)
    fail(bs, A, 2)
    bs.record_success(A, probe=False)
    fail(bs, A, 2)
    assert state(bs, A) is HealthState.HEALTHY
    bs.record_success(A, probe=True)
    fail(bs, A, 2)
    assert state(bs, A) is HealthState.HEALTHY
    fail(bs, A, 1)
    assert state(bs, A) is HealthState.EJECTED


def test_probes_bring_back_after_healthy_threshold() -> None:
    bs = make(unhealthy_threshold=1, healthy_threshold=2)
    fail(bs, A, 1)
    bs.record_success(A, probe=False)  # a served request does not readmit an ejected backend
    bs.record_success(A, probe=False)
    assert state(bs, A) is HealthState.EJECTED
    bs.record_success(A, probe=True)
    assert state(bs, A) is HealthState.EJECTED
    fail(bs, A, 1, probe=True)  # a failure breaks the run of successes
    bs.record_success(A, probe=True)
    assert state(bs, A) is HealthState.EJECTED
    bs.record_success(A, probe=True)
    assert state(bs, A) is HealthState.HEALTHY
    assert A in bs.candidates.members


def test_ejected_keys_come_back_and_others_never_move() -> None:
    bs = make(unhealthy_threshold=1, healthy_threshold=1)
    before = placement(bs)
    fail(bs, B, 1)
    during = placement(bs)
    for old, new in zip(before, during, strict=True):
        assert new == old if old != B else new != B
    bs.record_success(B, probe=True)
    assert placement(bs) == before


@pytest.mark.parametrize(
    ("ratio", "ejected", "expected_candidates", "override"),
    [
        pytest.param(0.5, 2, 2, False, id="half-within-cap"),
        pytest.param(0.5, 3, 2, True, id="three-of-four-over-cap"),
        pytest.param(0.5, 4, 2, True, id="all-fail"),
        pytest.param(0.25, 2, 3, True, id="quarter-cap"),
        pytest.param(1.0, 4, 0, False, id="no-cap"),
        pytest.param(0.0, 1, 4, True, id="zero-cap"),
    ],
)
def test_ejection_cap(ratio: float, ejected: int, expected_candidates: int, override: bool) -> None:
    bs = make(unhealthy_threshold=3, max_ejected_ratio=ratio)
    for url in URLS:
        bs.record_success(url, probe=True)
    # Eject the first `ejected` backends with different failure counts, least-failing last.
    for i, url in enumerate(URLS[:ejected]):
        fail(bs, url, 3 + ejected - i)
    assert len(bs.candidates.ids) == expected_candidates
    assert bs.all_ejected_override is override
    healthy = set(URLS[ejected:])
    assert healthy <= bs.candidates.members
    readmitted = bs.candidates.members - healthy
    # The readmitted ones are the least-failing of the ejected: the last ones ejected here.
    assert readmitted == set(URLS[ejected - len(readmitted) : ejected])
    assert bs.is_ready() is bool(healthy)


def test_override_clears_when_backends_recover() -> None:
    bs = make(unhealthy_threshold=1, healthy_threshold=1, max_ejected_ratio=0.5)
    for url in URLS:
        fail(bs, url, 1)
    assert bs.all_ejected_override
    assert not bs.is_ready()
    bs.record_success(A, probe=True)
    bs.record_success(B, probe=True)
    assert not bs.all_ejected_override
    assert bs.candidates.ids == (A, B)


def test_failed_probe_within_grace_does_not_eject() -> None:
    clock = Clock()
    bs = make(clock=clock, unhealthy_threshold=2, probe_grace_s=10.0)
    bs.record_success(A, probe=False)  # served a request at t=1000
    clock.now += 9.0
    fail(bs, A, 5, probe=True)
    assert state(bs, A) is HealthState.HEALTHY
    clock.now += 2.0  # 11 s since it last served
    fail(bs, A, 2, probe=True)
    assert state(bs, A) is HealthState.EJECTED


def test_grace_does_not_cover_request_failures() -> None:
    bs = make(unhealthy_threshold=2, probe_grace_s=10.0)
    bs.record_success(A, probe=False)
    fail(bs, A, 2, probe=False)
    assert state(bs, A) is HealthState.EJECTED


def test_failed_probe_without_served_request_counts() -> None:
    bs = make(unhealthy_threshold=2, probe_grace_s=10.0)
    fail(bs, A, 2, probe=True)
    assert state(bs, A) is HealthState.EJECTED


# -- draining ------------------------------------------------------------------------------------


def test_drain_idle_backend_leaves_at_once() -> None:
    bs = make()
    before = placement(bs)
    assert bs.drain(C)
    assert bs.get(C) is None
    assert C not in bs.ring.members
    for old, new in zip(before, placement(bs), strict=True):
        assert new == old if old != C else new != C
    assert not bs.drain("http://unknown:1")


def test_drain_with_inflight_leases() -> None:
    bs = make()
    before = placement(bs)
    leases = [bs.load.acquire(C), bs.load.acquire(C)]
    assert bs.drain(C)
    assert state(bs, C) is HealthState.DRAINING
    assert C not in bs.candidates.members
    for old, new in zip(before, placement(bs), strict=True):
        assert new == old if old != C else new != C
    leases[0].release()
    bs.lease_ended(C)
    assert bs.get(C) is not None  # one request still running
    leases[1].release()
    bs.lease_ended(C)
    assert bs.get(C) is None
    assert C not in bs.ring.members
    assert bs.load.total_inflight() == 0
    for old, new in zip(before, placement(bs), strict=True):
        assert new == old if old != C else new != C


def test_draining_backend_stays_on_ring_while_leases_are_open() -> None:
    bs = make()
    lease = bs.load.acquire(C)
    bs.drain(C)
    assert C in bs.ring.members
    lease.release()
    bs.lease_ended(C)
    assert C not in bs.ring.members


def test_draining_backend_ignores_health_signals() -> None:
    bs = make(unhealthy_threshold=1, healthy_threshold=1)
    lease = bs.load.acquire(C)
    bs.drain(C)
    fail(bs, C, 3)
    bs.record_success(C, probe=True)
    assert state(bs, C) is HealthState.DRAINING
    assert C not in bs.candidates.members
    lease.release()


def test_replace_members_rebuilds_ring_and_keeps_counts() -> None:
    load = LoadTracker()
    bs = make(URLS[:3], load=load)
    changes: list[int] = []
    bs.on_change(lambda: changes.append(1))
    lease_a = load.acquire(A)
    lease_c = load.acquire(C)
    old_ring = bs.ring

    bs.replace_members([BackendSpec(A), BackendSpec(B), BackendSpec(D)])  # C leaves, D joins

    assert bs.ring is not old_ring
    assert bs.ring.members == (A, B, C, D)  # C stays on the ring until its request ends
    assert bs.load is load
    assert load.inflight(A) == 1
    assert load.inflight(C) == 1
    assert load.total_inflight() == 2
    assert state(bs, C) is HealthState.DRAINING  # still serving its request
    assert bs.candidates.ids == (A, B, D)
    assert changes
    lease_c.release()
    bs.lease_ended(C)
    assert bs.get(C) is None
    assert list(bs.ring.members) == [A, B, D]  # a list: mypy keeps the narrowing of the assert above
    assert load.inflight(A) == 1
    lease_a.release()


def test_replace_members_same_set_keeps_the_ring() -> None:
    bs = make()
    ring = bs.ring
    bs.replace_members([BackendSpec(u) for u in reversed(URLS)])
    assert bs.ring is ring


def test_replace_members_weight_change_rebuilds() -> None:
    bs = make()
    ring = bs.ring
    bs.replace_members([BackendSpec(A, weight=2.0), *(BackendSpec(u) for u in URLS[1:])])
    assert bs.ring is not ring
    backend = bs.get(A)
    assert backend is not None
    assert backend.weight == 2.0


def test_readded_while_draining_is_healthy_again() -> None:
    bs = make()
    lease = bs.load.acquire(C)
    bs.replace_members([BackendSpec(u) for u in URLS if u != C])
    assert state(bs, C) is HealthState.DRAINING
    bs.replace_members([BackendSpec(u) for u in URLS])
    assert state(bs, C) is HealthState.HEALTHY
    assert C in bs.candidates.members
    assert C in bs.ring.members
    lease.release()
    bs.lease_ended(C)
    assert bs.get(C) is not None


# -- slow start ----------------------------------------------------------------------------------


def _share_included(bs: BackendSet, url: str, rng: random.Random, rounds: int = 2000) -> float:
    return sum(url in bs.candidates_now(rng).members for _ in range(rounds)) / rounds


def test_slow_start_share_grows_to_full() -> None:
    clock = Clock()
    bs = make(clock=clock, unhealthy_threshold=1, healthy_threshold=1, slow_start_s=10.0)
    rng = random.Random(7)
    fail(bs, A, 1)
    bs.record_success(A, probe=True)  # recovered at t=1000
    assert state(bs, A) is HealthState.HEALTHY

    shares = []
    for elapsed in (0.0, 2.5, 5.0, 7.5, 10.0, 20.0):
        clock.now = 1000.0 + elapsed
        share = _share_included(bs, A, rng)
        assert share == pytest.approx(min(1.0, elapsed / 10.0), abs=0.05)
        shares.append(share)
        assert _share_included(bs, B, rng, rounds=200) == 1.0  # others never skipped
    assert shares == sorted(shares)
    assert shares[0] < 0.01
    assert shares[-1] == 1.0


def test_slow_start_ends_after_first_success_past_the_window() -> None:
    clock = Clock()
    bs = make(clock=clock, unhealthy_threshold=1, healthy_threshold=1, slow_start_s=10.0)
    fail(bs, A, 1)
    bs.record_success(A, probe=True)
    clock.now += 11.0
    bs.record_success(A, probe=False)
    backend = bs.get(A)
    assert backend is not None
    assert backend.recovered_at is None
    assert bs.candidates_now(random.Random(0)) is bs.candidates


def test_slow_start_never_empties_the_candidates() -> None:
    clock = Clock()
    bs = make([A], clock=clock, unhealthy_threshold=1, healthy_threshold=1, max_ejected_ratio=1.0)
    fail(bs, A, 1)
    assert bs.candidates.ids == ()
    bs.record_success(A, probe=True)
    rng = random.Random(0)
    assert all(bs.candidates_now(rng).ids == (A,) for _ in range(100))


def test_slow_start_disabled() -> None:
    clock = Clock()
    bs = make(clock=clock, unhealthy_threshold=1, healthy_threshold=1, slow_start_s=0.0)
    fail(bs, A, 1)
    bs.record_success(A, probe=True)
    assert _share_included(bs, A, random.Random(0), rounds=200) == 1.0
