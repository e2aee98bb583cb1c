"""What one backend has counted since start (or since the last reset): plain numbers, no I/O.

The scheduler writes these; `/metrics` and `/sim/stats` read them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# vLLM's bucket bounds for vllm:time_to_first_token_seconds, so dashboards and quantiles compare.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass(slots=True)
class LatencyHistogram:
    """Prometheus-style histogram: per-bucket counts (not cumulative) plus an overflow bucket."""

    bounds_s: tuple[float, ...] = TTFT_BUCKETS_S
    bucket_counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.bucket_counts:
            self.bucket_counts = [0] * (len(self.bounds_s) + 1)

    def observe(self, value_s: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is inclusive).
        self.bucket_counts[bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1

    def cumulative_counts(self) -> list[int]:
        running_total = 0
        cumulative = []
        for bucket_count in self.bucket_counts:
            running_total += bucket_count
            cumulative.append(running_total)
        return cumulative


@dataclass(slots=True)
class BackendCounters:
    """Monotonic totals (tokens where the name says so) and high-water marks of one backend."""

    requests_arrived: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    peak_inflight: int = 0
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)

    def note_occupancy(self, running: int, waiting: int) -> None:
        self.peak_running = max(self.peak_running, running)
        self.peak_waiting = max(self.peak_waiting, waiting)
        self.peak_inflight = max(self.peak_inflight, running + waiting)
