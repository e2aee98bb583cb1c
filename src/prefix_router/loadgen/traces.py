"""Replaying production traces in the Mooncake format as workloads of chat requests.

A trace is JSON lines, one request each (https://github.com/kvcache-ai/Mooncake, FAST25-release):
`timestamp` (ms from the start), `input_length` and `output_length` (tokens), and `hash_ids`, one id
per block of `block_tokens` prompt tokens (512 in Mooncake's traces): requests whose leading ids are
equal share that prefix. Alibaba's Qwen-Bailian traces add `chat_id`, `parent_chat_id` (-1 for a
root), `turn` and `type`, count `timestamp` in seconds and use 16-token blocks.

The trace carries no text, so each hash id becomes a fixed run of words of exactly the block's size
(4 characters a token, the sim's arithmetic), drawn from a generator seeded by (seed, id): equal
leading ids give byte-equal prefixes, a different id gives different text from there on. The last
block holds `input_length - block_tokens * (n - 1)` tokens and is the start of its id's full text, so
a partial block is a prefix of the same id's full block. Each request is one user message.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_router.loadgen.workloads import DEFAULT_MODEL, Workload, WorkloadRequest, vocabulary
from prefix_router.sim.tokens import BYTES_PER_TOKEN

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not a request in the Mooncake format."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp: float  # in the trace's unit (ms for Mooncake, s for Qwen-Bailian)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None


def _int(row: dict[str, Any], name: str, line: int, *, minimum: int = 0) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"line {line}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_record(row: object, line: int = 0) -> TraceRecord:
    """One trace line's object as a record; TraceError names the line and the field at fault."""
    if not isinstance(row, dict):
        raise TraceError(f"line {line}: a request must be a JSON object")
    timestamp = row.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"line {line}: timestamp must be a number >= 0, got {timestamp!r}")
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not hash_ids:
        raise TraceError(f"line {line}: hash_ids must be a non-empty list")
    if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise TraceError(f"line {line}: hash_ids must be integers >= 0")
    optional: dict[str, int | None] = {}
    for name in ("chat_id", "parent_chat_id", "turn"):
        value = row.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TraceError(f"line {line}: {name} must be an integer, got {value!r}")
        optional[name] = value
    return TraceRecord(
        float(timestamp),
        _int(row, "input_length", line, minimum=1),
        _int(row, "output_length", line),
        tuple(hash_ids),
        **optional,
    )


def read_trace(path: Path, *, limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` records (all when None) of a JSON-lines trace; blank lines are skipped."""
    with path.open(encoding="utf-8") as lines:
        return list(_records(lines, limit))


def _records(lines: Iterable[str], limit: int | None) -> Iterator[TraceRecord]:
    count = 0
    for number, text in enumerate(lines, 1):
        if limit is not None and count >= limit:
            return
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {number}: not JSON ({exc.msg})") from exc
        yield parse_record(row, number)
        count += 1


def guess_block_tokens(path: Path) -> int:
    """Qwen-Bailian files name their block size (`..._blksz_16.jsonl`); Mooncake's are 512."""
    if match := re.search(r"blksz_(\d+)", path.name):
        return int(match.group(1))
    return MOONCAKE_BLOCK_TOKENS


def guess_time_unit_s(records: list[TraceRecord]) -> float:
    """Seconds per timestamp unit: Qwen-Bailian traces (they carry chat ids) count seconds, Mooncake's ms."""
    return 1.0 if any(r.chat_id is not None for r in records) else 0.001


class BlockText:
    """The text of each hash id: `block_tokens * 4` characters of words, fixed by (seed, id)."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_chars = block_tokens * BYTES_PER_TOKEN
        self._seed = seed
        self._words = vocabulary()
        self._cache: dict[int, str] = {}

    def full(self, hash_id: int) -> str:
        text = self._cache.get(hash_id)
        if text is None:
            rng = random.Random(f"{self._seed}/{hash_id}")
            # Words average ~5 characters; 1 + chars // 3 of them always reach the block's length.
            words = rng.choices(self._words, k=1 + self.block_chars // 3)
            text = " ".join(words)[: self.block_chars]
            self._cache[hash_id] = text
        return text

    def prompt(self, hash_ids: tuple[int, ...], input_length: int) -> str:
        """The prompt of a request: full blocks, then the last one cut to the tokens it holds."""
        block_tokens = self.block_chars // BYTES_PER_TOKEN
        last_tokens = input_length - block_tokens * (len(hash_ids) - 1)
        # A trace whose last block is longer than a block, or empty, is cut to the block it names.
        last_tokens = min(max(last_tokens, 1), block_tokens)
        parts = [self.full(h) for h in hash_ids[:-1]]
        parts.append(self.full(hash_ids[-1])[: last_tokens * BYTES_PER_TOKEN])
        return "".join(parts)


def trace_workload(
    records: list[TraceRecord],
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    time_unit_s: float = 0.001,
    time_scale: float = 1.0,
    max_output_tokens: int | None = None,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    name: str = "trace",
) -> Workload:
    """The records as chat requests, each to be sent at `timestamp * time_unit_s * time_scale`
    seconds from the start (0.1: ten times faster than recorded), in trace order.

    `group` is the conversation: the root of the `parent_chat_id` chain when the trace has chat ids,
    else the request's first two hash ids (in Mooncake's conversation trace the first block is one
    system prompt shared by all, the second starts the conversation). A request whose parent is in
    the replayed records names it in `after`, so a turn is never sent before the one it follows ends.
    `max_output_tokens` caps each request's output (decode time is not what a placement changes)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    text = BlockText(block_tokens, seed)
    start = min((r.timestamp for r in records), default=0.0)
    index_of_chat: dict[int, int] = {}
    root_of_chat: dict[int, int] = {}
    requests: list[WorkloadRequest] = []
    for i, r in enumerate(records):
        after: int | None = None
        if r.chat_id is not None:
            parent = r.parent_chat_id if r.parent_chat_id is not None and r.parent_chat_id >= 0 else None
            after = index_of_chat.get(parent) if parent is not None else None
            root = root_of_chat.get(parent, parent) if parent is not None else r.chat_id
            root_of_chat[r.chat_id] = root
            index_of_chat[r.chat_id] = i
            group = f"chat{root}"
        else:
            group = "h" + "-".join(str(h) for h in r.hash_ids[:2])
        output = r.output_length if max_output_tokens is None else min(r.output_length, max_output_tokens)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": text.prompt(r.hash_ids, r.input_length)}],
            "max_tokens": max(1, output),
        }
        at_s = (r.timestamp - start) * time_unit_s * time_scale
        requests.append(WorkloadRequest(body, group, None, after, at_s))
    span = requests[-1].at_s if requests else 0.0
    return Workload(
        name,
        f"{len(records)} trace requests over {span:.0f} s (time scale {time_scale:g}), {block_tokens}-token "
        "hash blocks, one user message each",
        tuple(requests),
        {"requests": len(records), "block_tokens": block_tokens, "time_unit_s": time_unit_s,
         "time_scale": time_scale, "max_output_tokens": max_output_tokens, "seed": seed},
    )  # fmt: skip
