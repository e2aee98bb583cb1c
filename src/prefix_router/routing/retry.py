"""Whether a failed attempt moves to the next backend, and why not when it does not. Pure: the relay
says what happened and what it knows, and records the verdict.

A request is retried only before any of its answer reached the client, only when nothing was done
for it (the connection was never made) or the backend turned it away (503, 429), only while
attempts remain (`max_attempts` counts the first), only when a backend it has not tried may take
it, and only while the retries in flight stay within the budget: `max(budget_min, budget_ratio x
requests in flight)`, Envoy's retry budget and its defaults (budget_percent 20%, min_retry_concurrency
3: https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/circuit_breaker.proto), so a
failing fleet does not see its load multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

RETRY_STATUSES = frozenset({429, 503})  # the backend turned the request away before doing any of it


class AttemptEnd(StrEnum):
    """How an attempt ended, as far as retrying goes."""

    CONNECT_FAILED = "connect_failed"  # no connection: the backend never saw the request
    FAILED = "failed"  # any other failure before the response head (a timeout, a reset)
    ANSWERED = "answered"  # the response head came; none of it has reached the client
    RELAYED = "relayed"  # some of the answer reached the client


class Verdict(StrEnum):
    RETRY = "retry"
    NOT_RETRYABLE = "not_retryable"  # the backend may have done the work, or answered for good
    NO_RETRY_STARTED = "no_retry_started"  # the client already has some of the answer
    NO_RETRY_ATTEMPTS = "no_retry_attempts"  # max_attempts reached
    NO_OTHER_BACKEND = "no_other_backend"  # every backend that could answer has been tried
    NO_RETRY_BUDGET = "no_retry_budget"  # the retries in flight are at the budget


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    budget_min: int
    budget_ratio: float

    def budget(self, active: int) -> int:
        """Retries that may be in flight while `active` requests are."""
        return max(self.budget_min, int(self.budget_ratio * active))

    def decide(
        self,
        end: AttemptEnd,
        status: int | None,
        attempts: int,
        retrying: int,
        active: int,
        other_backend: bool,
    ) -> Verdict:
        """`attempts` made for this request, the one that just ended included; `retrying` retries in
        flight now (this request's own, if it is one, included); `active` requests in flight now;
        `other_backend`: an untried backend may take it. `status` is the answer's, with ANSWERED."""
        if end is AttemptEnd.RELAYED:
            return Verdict.NO_RETRY_STARTED
        if end is AttemptEnd.FAILED or (end is AttemptEnd.ANSWERED and status not in RETRY_STATUSES):
            return Verdict.NOT_RETRYABLE
        if attempts >= self.max_attempts:
            return Verdict.NO_RETRY_ATTEMPTS
        if not other_backend:
            return Verdict.NO_OTHER_BACKEND
        if retrying >= self.budget(active):
            return Verdict.NO_RETRY_BUDGET
        return Verdict.RETRY
