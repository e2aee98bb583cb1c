"""`/metrics` for one backend, under vLLM's own metric names, types and labels.

Names follow vLLM v1 (https://docs.vllm.ai/en/latest/design/metrics.html): labels `model_name` and
`engine` ("0", one engine per server), `finished_reason` on request_success. The collector reads the
backend's counters at scrape time, so requests pay nothing for metrics, and it lives on a
per-backend CollectorRegistry because a fleet shares one process.

`vllm:cache_config_info` is vLLM's info gauge (value 1) whose labels are the engine's CacheConfig
fields as strings (`CacheConfig.metrics_info()` plus `engine`, no `model_name`): a router reads the
KV capacity of a backend from `num_gpu_blocks` x `block_size` tokens. The sim fills the fields it
models from its config and the rest with the values a default vLLM start-up shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from prefix_router.sim.config import SimConfig
from prefix_router.sim.stats import BackendCounters

_LABELS = ["model_name", "engine"]
_ENGINE = "0"


class LiveBackendState(Protocol):
    """What the collector reads besides counters: the scheduler's present occupancy."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    @property
    def counters(self) -> BackendCounters: ...

    @property
    def config(self) -> SimConfig: ...


def cache_config_labels(config: SimConfig) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` for a backend with this config, as vLLM prints them."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "True",
        "engine": _ENGINE,
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.capacity_blocks),
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "swap_space_bytes": str(4 * 1024**3),
    }


class SimMetricsCollector(Collector):
    def __init__(self, model_name: str, state: LiveBackendState) -> None:
        self._label_values = [model_name, _ENGINE]
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        counters = state.counters
        labels = self._label_values

        info = cache_config_labels(state.config)
        cache_config = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        cache_config.add_metric(list(info.values()), 1.0)
        yield cache_config
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", state.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", state.num_waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", state.kv_cache_usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            counters.prefix_cache_queries_tokens,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            counters.prefix_cache_hits_tokens,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens
        )
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens
        )

        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        # The sim never samples a stop token: it always runs to max_tokens ("length").
        success.add_metric([*labels, "stop"], 0)
        success.add_metric([*labels, "length"], counters.requests_finished)
        success.add_metric([*labels, "abort"], counters.requests_aborted)
        # vLLM 0.32 also exports these reasons; the sim never produces them, so they stay at zero.
        success.add_metric([*labels, "error"], 0)
        success.add_metric([*labels, "repetition"], 0)
        yield success

        ttft = counters.ttft
        histogram = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels=_LABELS
        )
        # repr gives "0.001", "1.0", "2560.0": the `le` values vLLM's own client library prints.
        bounds = [*(repr(bound) for bound in ttft.bounds_s), "+Inf"]
        histogram.add_metric(labels, list(zip(bounds, ttft.cumulative_counts(), strict=True)), ttft.sum_s)
        yield histogram

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, documentation, labels=_LABELS)
        gauge.add_metric(self._label_values, value)
        return gauge

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        counter = CounterMetricFamily(name, documentation, labels=_LABELS)
        counter.add_metric(self._label_values, value)
        return counter


class SimMetrics:
    """The backend's own registry and its exposition."""

    def __init__(self, model_name: str, state: LiveBackendState) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SimMetricsCollector(model_name, state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
