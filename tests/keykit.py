"""Routing keys of chat requests, as the router extracts them, for the pure and placement tests."""

from __future__ import annotations

import orjson

from prefix_router.routing.config import KeyConfig
from prefix_router.routing.keys import RoutingKey, extract_key


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
