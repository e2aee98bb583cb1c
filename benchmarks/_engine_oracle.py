"""The LRU oracle for external engines: real vLLM servers cache the served model's tokens in their own
blocks, so the sim's oracle (its own tokenizer and block size) does not apply to them. With the model's
tokenizer and each engine's `vllm:cache_config_info`, a run against real servers gets the same bound
the simulated runs get: every prompt tokenized as the engine tokenizes it (the chat template, then the
tokens), cut into the engine's full blocks and chained as vLLM chains its block hashes (the salt in
the first), then served in order on one LRU of the fleet's blocks."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from prefix_router.loadgen.workloads import OracleResult, Workload, oracle_from_blocks

Tokenize = Callable[[Sequence[Mapping[str, Any]]], list[int]]


def chat_tokenizer(name_or_path: str) -> Tokenize:
    """The served model's chat template and tokenizer, as vLLM's chat endpoint applies them."""
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise SystemExit("--tokenizer needs transformers (pip install transformers)") from exc
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)

    def tokenize(messages: Sequence[Mapping[str, Any]]) -> list[int]:
        out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
        return [int(i) for i in ids]

    return tokenize


def engine_blocks(metrics_text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) from one engine's /metrics; None when it does not say."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm:cache_config_info":
            continue
        for sample in family.samples:
            try:
                blocks, size = int(sample.labels["num_gpu_blocks"]), int(sample.labels["block_size"])
            except (KeyError, ValueError):
                continue
            if blocks > 0 and size > 0:
                return blocks, size
    return None


@dataclass(frozen=True)
class EngineFleet:
    """What an external fleet caches: its engines' blocks and block size, and the model's tokenizer."""

    blocks_per_backend: tuple[int, ...]
    block_size: int
    tokenize: Tokenize

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_per_backend)

    def prompt(self, body: Mapping[str, Any]) -> tuple[int, list[int]]:
        """(prompt tokens, chained hashes of its full blocks), the engine's way."""
        ids = self.tokenize(body["messages"])
        salt = body.get("cache_salt")
        parent: int | None = None
        hashes: list[int] = []
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            block = tuple(ids[start : start + self.block_size])
            parent = hash((parent, block, salt if start == 0 else None))
            hashes.append(parent)
        return len(ids), hashes

    def oracle(self, workload: Workload) -> OracleResult:
        prompts = [self.prompt(r.body) for r in workload.requests]
        return oracle_from_blocks(prompts, block_size=self.block_size, capacity_blocks=self.total_blocks)

    def working_set_blocks(self, workload: Workload) -> int:
        seen: set[int] = set()
        for r in workload.requests:
            seen.update(self.prompt(r.body)[1])
        return len(seen)


def read_engine_fleet(urls: Sequence[str], tokenize: Tokenize, timeout_s: float = 10.0) -> EngineFleet:
    """Each engine's cache from its /metrics; every engine must state it, with one block size."""
    blocks: list[int] = []
    sizes: set[int] = set()
    for url in urls:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as resp:
            found = engine_blocks(resp.read().decode("utf-8", "replace"))
        if found is None:
            raise SystemExit(f"{url}/metrics has no vllm:cache_config_info: --tokenizer needs vLLM backends")
        blocks.append(found[0])
        sizes.add(found[1])
    if len(sizes) != 1:
        raise SystemExit(f"the backends' block sizes differ ({sorted(sizes)}): no one oracle")
    return EngineFleet(tuple(blocks), sizes.pop(), tokenize)
