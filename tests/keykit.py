"""Routing keys for the pure and placement tests: a chat request's as the router extracts it, and bare keys
built from a ring hash and block hashes."""

from __future__ import annotations

import orjson

from prefix_router.routing.config import KeyConfig
from prefix_router.routing.keys import KeySource, RoutingKey, extract_key


def chat_key(system: str, user: str, stream: bool = True) -> RoutingKey:
    """The key of a chat request: a system prompt, one user message, streaming or not."""
    body = orjson.dumps(
        {
            "model": "m",
            "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
    )
    return extract_key("/v1/chat/completions", body, None, KeyConfig())


def bare_key(ring_hash: int, blocks: tuple[int, ...] = (), size: int | None = None) -> RoutingKey:
    """A key of 256-byte blocks; `size` bytes of key material (default: the blocks exactly)."""
    ends = tuple(256 * (i + 1) for i in range(max(len(blocks), 1)))
    return RoutingKey(
        ring_hash=ring_hash,
        blocks=blocks,
        source=KeySource.RAW,
        model=None,
        tenant=None,
        size=256 * len(blocks) if size is None else size,
        ends=ends,
    )
