"""Knobs of one simulated vLLM backend, with defaults for an 8B model on one H100.

The figures are estimates, not measurements; each field says where its default comes from, so a
benchmark can state what it simulated. Every field is also a CLI flag (see `sim/cli.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One backend's model, cache geometry and timing model.

    TTFT = queue wait + `overhead_ms` + uncached prompt tokens x `prefill_ms_per_token`; then each
    further token takes `itl_ms` x (1 + `itl_batch_slowdown` x (running - 1)). This is the
    "per-token" latency model of llm-d-inference-sim (prefill overhead + time per uncached prompt
    token + inter-token latency that grows under load), https://github.com/llm-d/llm-d-inference-sim.
    """

    model: str = "sim-llama"
    """Served model name, reported by /v1/models and used as the metrics' `model_name` label."""

    adapters: tuple[str, ...] = ()
    """LoRA adapters loaded on this server (vLLM's `--lora-modules`): listed by /v1/models with
    `parent` naming `model`, and served like it."""

    responses_store: bool = True
    """Keep Responses API results in memory (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1), so
    `previous_response_id`, GET, DELETE and cancel find them; off: `store` is ignored, as in vLLM."""

    responses_store_max: int = 10_000
    """Stored responses kept at most, oldest dropped first (vLLM's store is unbounded)."""

    block_size: int = 16
    """Tokens per KV block; 16 is vLLM's default `--block-size` on CUDA."""

    capacity_blocks: int = 25_000
    """KV cache size in blocks. Llama-3-8B stores 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
    = 128 KiB per token; an H100 80 GB at gpu_memory_utilization 0.9 keeps ~50 GB for KV after 16 GB
    of bf16 weights and activations, i.e. ~400k tokens = 25k blocks of 16."""

    max_num_seqs: int = 256
    """Running requests at most; beyond it requests wait FIFO. 256 is vLLM's long-standing default."""

    overhead_ms: float = 30.0
    """Fixed part of every TTFT (scheduling, a forward pass, sampling, detokenising, HTTP). llm-d
    inference-sim example configs use 20-50 ms for `prefill-overhead`."""

    prefill_ms_per_token: float = 0.04
    """Cost of one uncached prompt token. An 8B dense model needs ~2 x 8e9 = 16 GFLOP per token; an
    H100 SXM gives 989 dense bf16 TFLOP/s, so at ~40-50% MFU prefill runs at ~25-30k tokens/s,
    i.e. ~0.035-0.04 ms per token."""

    itl_ms: float = 10.0
    """Inter-token latency of a lone sequence. Decode is memory-bound: 16 GB of bf16 weights over
    3.35 TB/s of HBM3 is 4.8 ms per step at best; ~10 ms with kernel and framework overheads."""

    itl_batch_slowdown: float = 0.004
    """Relative ITL growth per extra running sequence (alpha). 0.004 doubles the ITL at 256 running
    sequences, as KV reads grow to rival weight reads; an estimate, like llm-d-inference-sim's
    `time-factor-under-load`."""

    default_max_tokens: int = 16
    """Output tokens when a request names no limit; 16 is the OpenAI/vLLM completions default."""

    max_tokens_limit: int = 4096
    """Requested output lengths above this are clamped, so a typo cannot stream for hours."""

    @property
    def served_models(self) -> frozenset[str]:
        return frozenset((self.model, *self.adapters))

    def validate(self) -> None:
        """Raise ValueError for a config no scheduler could run."""
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if any(not name or name == self.model for name in self.adapters):
            raise ValueError("adapters must be non-empty names other than the model's")
        if self.responses_store_max < 1:
            raise ValueError("responses_store_max must be at least 1")
        for name in ("block_size", "capacity_blocks", "max_num_seqs", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_tokens_limit < self.default_max_tokens:
            raise ValueError("max_tokens_limit must be at least default_max_tokens")
        for name in ("overhead_ms", "prefill_ms_per_token", "itl_ms", "itl_batch_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} cannot be negative")
