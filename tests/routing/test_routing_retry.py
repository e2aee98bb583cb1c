"""The retry policy: one verdict with its reason for every way an attempt can end; never a retry once
the client has some of the answer, never more than max_attempts attempts, never over the budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.routing.retry import RETRY_STATUSES, AttemptEnd, RetryPolicy, Verdict

POLICY = RetryPolicy(max_attempts=3, budget_min=3, budget_ratio=0.2)
CONNECT, FAILED, ANSWERED, RELAYED = (
    AttemptEnd.CONNECT_FAILED,
    AttemptEnd.FAILED,
    AttemptEnd.ANSWERED,
    AttemptEnd.RELAYED,
)


@pytest.mark.parametrize(
    ("end", "status", "attempts", "retrying", "active", "other", "verdict"),
    [
        pytest.param(CONNECT, None, 1, 0, 1, True, Verdict.RETRY, id="connect-refused-first-attempt"),
        pytest.param(ANSWERED, 503, 1, 0, 1, True, Verdict.RETRY, id="503-before-first-byte"),
        pytest.param(ANSWERED, 429, 2, 1, 1, True, Verdict.RETRY, id="429-on-the-second-attempt"),
        pytest.param(ANSWERED, 200, 1, 0, 1, True, Verdict.NOT_RETRYABLE, id="200"),
        pytest.param(ANSWERED, 500, 1, 0, 1, True, Verdict.NOT_RETRYABLE, id="500-the-backend-tried"),
        pytest.param(ANSWERED, 502, 1, 0, 1, True, Verdict.NOT_RETRYABLE, id="502"),
        pytest.param(FAILED, None, 1, 0, 1, True, Verdict.NOT_RETRYABLE, id="timeout-may-have-run"),
        pytest.param(RELAYED, 503, 1, 0, 1, True, Verdict.NO_RETRY_STARTED, id="503-after-bytes-went"),
        pytest.param(RELAYED, None, 1, 0, 1, True, Verdict.NO_RETRY_STARTED, id="broken-mid-stream"),
        pytest.param(CONNECT, None, 3, 0, 1, True, Verdict.NO_RETRY_ATTEMPTS, id="connect-third-attempt"),
        pytest.param(ANSWERED, 503, 3, 2, 1, True, Verdict.NO_RETRY_ATTEMPTS, id="503-third-attempt"),
        pytest.param(CONNECT, None, 1, 0, 1, False, Verdict.NO_OTHER_BACKEND, id="connect-only-backend"),
        pytest.param(ANSWERED, 503, 1, 0, 1, False, Verdict.NO_OTHER_BACKEND, id="503-pinned-or-alone"),
        pytest.param(CONNECT, None, 1, 3, 10, True, Verdict.NO_RETRY_BUDGET, id="min-budget-spent"),
        pytest.param(ANSWERED, 503, 1, 3, 19, True, Verdict.NO_RETRY_BUDGET, id="ratio-under-min"),
        pytest.param(ANSWERED, 503, 1, 3, 20, True, Verdict.RETRY, id="ratio-above-min"),
        pytest.param(ANSWERED, 503, 1, 4, 20, True, Verdict.NO_RETRY_BUDGET, id="ratio-budget-spent"),
        # The reasons in the order they are given: what the client holds, what the backend did,
        # attempts, another backend, then the budget (spent only where a retry could happen).
        pytest.param(RELAYED, 200, 9, 9, 1, False, Verdict.NO_RETRY_STARTED, id="started-first"),
        pytest.param(FAILED, None, 9, 9, 1, False, Verdict.NOT_RETRYABLE, id="not-retryable-next"),
        pytest.param(CONNECT, None, 3, 9, 1, False, Verdict.NO_RETRY_ATTEMPTS, id="attempts-next"),
        pytest.param(CONNECT, None, 1, 9, 1, False, Verdict.NO_OTHER_BACKEND, id="other-before-budget"),
    ],
)
def test_verdicts(
    end: AttemptEnd,
    status: int | None,
    attempts: int,
    retrying: int,
    active: int,
    other: bool,
    verdict: Verdict,
) -> None:
    assert POLICY.decide(end, status, attempts, retrying, active, other) is verdict


def test_a_budget_of_zero_never_retries() -> None:
    none = RetryPolicy(max_attempts=3, budget_min=0, budget_ratio=0.0)
    assert none.decide(CONNECT, None, 1, 0, 100, True) is Verdict.NO_RETRY_BUDGET


def test_one_attempt_is_never_retried() -> None:
    once = RetryPolicy(max_attempts=1, budget_min=3, budget_ratio=0.2)
    assert once.decide(ANSWERED, 503, 1, 0, 1, True) is Verdict.NO_RETRY_ATTEMPTS


policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, 10),
    budget_min=st.integers(0, 10),
    budget_ratio=st.floats(0, 1),
)
statuses = st.one_of(st.none(), st.sampled_from(sorted(RETRY_STATUSES)), st.integers(100, 599))
facts = st.tuples(
    st.sampled_from(AttemptEnd),
    statuses,
    st.integers(1, 12),
    st.integers(0, 50),
    st.integers(1, 200),
    st.booleans(),
)


@given(policies, facts)
def test_never_a_retry_after_the_first_byte_reached_the_client(
    policy: RetryPolicy, fact: tuple[AttemptEnd, int | None, int, int, int, bool]
) -> None:
    _, status, attempts, retrying, active, other = fact
    assert policy.decide(RELAYED, status, attempts, retrying, active, other) is Verdict.NO_RETRY_STARTED


@given(policies, facts)
def test_a_retry_is_only_ever_one_more_attempt_within_max_attempts_budget_and_fleet(
    policy: RetryPolicy, fact: tuple[AttemptEnd, int | None, int, int, int, bool]
) -> None:
    end, status, attempts, retrying, active, other = fact
    verdict = policy.decide(end, status, attempts, retrying, active, other)
    if verdict is Verdict.RETRY:
        assert attempts + 1 <= policy.max_attempts
        assert retrying < policy.budget(active)
        assert other
        assert end is CONNECT or (end is ANSWERED and status in RETRY_STATUSES)


@given(policies, st.lists(st.sampled_from([CONNECT, ANSWERED]), min_size=1, max_size=20))
def test_a_request_retried_whenever_allowed_makes_at_most_max_attempts(
    policy: RetryPolicy, ends: list[AttemptEnd]
) -> None:
    """However its attempts end (each turned away), retrying while the policy says so stops at
    max_attempts; the budget and the fleet are as generous as they can be."""
    attempts = 0
    for end in ends:
        attempts += 1
        if policy.decide(end, 503, attempts, 0, 10**6, True) is not Verdict.RETRY:
            break
    assert attempts <= policy.max_attempts
    assert attempts == min(len(ends), policy.max_attempts) or policy.budget(10**6) == 0
