"""The routing key: what of a request decides where it goes.

OpenAI endpoints key on the conversation text in the order a chat template renders it: the `tools`
definitions first (templates put them in the system preamble), then each message as a role marker
followed by its content. Other paths key on the canonical JSON of the body's prompt fields (the whole
canonical body when it has none), or on the raw bytes when the body is not JSON. The model and the
tenant seed every hash, so two models or two tenants never share a placement. The key never fails a
request: anything unexpected falls back to raw bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from prefix_router.routing.canonical import NotCanonicalisable, canonical_bytes, canonical_prompt, parse_json
from prefix_router.routing.config import KeyConfig, KeyMode
from prefix_router.routing.hashing import encode_parts, hash_bytes, prefix_hashes

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"})

# Role and part markers. A client can write them itself (as \u001e…), which can only make its own
# requests share a placement; the tenant and model seed the hash before any of this text.
_MSG = "\x1e"
_FIELD = "\x1f"
_DIGEST = "\x1d"


class KeySource(StrEnum):
    OPENAI = "openai"  # message text
    NATIVE = "native"  # canonical JSON body
    RAW = "raw"  # raw body bytes (not JSON, or not canonicalisable)


@dataclass(frozen=True, slots=True)
class RoutingKey:
    ring_hash: int  # position on the ring: tenant, model, first N characters/bytes
    blocks: tuple[int, ...]  # chained hashes of fixed-size blocks of the key material (prefix index)
    source: KeySource
    model: str | None
    tenant: str | None  # the header's value, else the body's prompt_cache_key when trusted
    # The body asks for a stream ("stream": true): how the request is answered, not where it goes.
    streaming: bool = field(default=False, compare=False)


def extract_key(path: str, body: bytes, tenant: str | None, config: KeyConfig) -> RoutingKey:
    """Build the key of one request; never raises for any body."""
    doc: Any = None
    parsed = False
    if body:
        try:
            doc = parse_json(body)
            parsed = True
        except NotCanonicalisable:
            parsed = False
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, str):
        model = None
    streaming = isinstance(doc, dict) and doc.get("stream") is True
    if tenant is None and config.tenant_body_field and isinstance(doc, dict):
        tenant_field = doc.get(config.tenant_body_field)
        if isinstance(tenant_field, str):
            tenant = tenant_field

    use_openai = config.mode is KeyMode.OPENAI or (config.mode is KeyMode.AUTO and path in OPENAI_PATHS)
    if use_openai and isinstance(doc, dict):
        try:
            text = openai_text(path, doc)
        except NotCanonicalisable:
            text = ""  # a part too deep to encode: the request still routes, by its raw bytes below
        if text:
            material = text[: config.prefix_chars].encode("utf-8", "surrogatepass")
            full = text.encode("utf-8", "surrogatepass")[: config.max_key_bytes]
            return _key(KeySource.OPENAI, material, full, tenant, model, config, streaming)

    if parsed:
        try:
            canon = canonical_prompt(doc) or canonical_bytes(doc)
            return _key(
                KeySource.NATIVE, canon[: config.prefix_bytes], canon, tenant, model, config, streaming
            )
        except NotCanonicalisable:
            pass
    return _key(KeySource.RAW, body[: config.prefix_bytes], body, tenant, model, config)


def _key(
    source: KeySource,
    material: bytes,
    full: bytes,
    tenant: str | None,
    model: str | None,
    config: KeyConfig,
    streaming: bool = False,
) -> RoutingKey:
    tenant_b = b"" if tenant is None else tenant.encode("utf-8", "surrogatepass")
    model_b = b"" if model is None else model.encode("utf-8", "surrogatepass")
    root = encode_parts(tenant_b, model_b)
    ring = hash_bytes(root + encode_parts(material))  # == hash_parts(tenant_b, model_b, material)
    blocks = prefix_hashes(root, full, block_ends(config.block_bytes, config.max_key_bytes))
    return RoutingKey(ring, tuple(blocks), source, model, tenant, streaming)


@functools.lru_cache(maxsize=8)
def block_ends(first_block: int, limit: int) -> tuple[int, ...]:
    """Where blocks of the key material end: `first_block` bytes each, doubling every 4 blocks, up to
    64x. Fine grain where conversations diverge, coarse deep in long documents, so a 32 KB body costs
    20 hashes and a 1 MB body ~80 rather than 4,000. Depends on position only, so two keys sharing a
    prefix of length L share every boundary below L."""
    ends: list[int] = []
    size, pos = first_block, 0
    while True:
        for _ in range(4):
            pos += size
            if pos > limit:
                return tuple(ends)
            ends.append(pos)
        size = min(size * 2, first_block * 64)


def openai_text(path: str, doc: dict[str, Any]) -> str:
    """The prompt text of an OpenAI-style request, in the order the engine sees it ('' if none)."""
    parts: list[str] = []
    if path.endswith("/chat/completions") or "messages" in doc:
        tools = doc.get("tools")
        if tools is not None:
            parts.append(_MSG + "tools" + _FIELD + _json_text(tools))
        messages = doc.get("messages")
        if isinstance(messages, list):
            for message in messages:
                _append_message(parts, message)
    elif path.endswith("/responses"):
        instructions = doc.get("instructions")
        if isinstance(instructions, str):
            parts.append(_MSG + "instructions" + _FIELD + instructions)
        _append_input(parts, doc.get("input"))
    elif "prompt" in doc:
        _append_prompt(parts, doc.get("prompt"))
    else:
        _append_input(parts, doc.get("input"))
    return "".join(parts)


def _append_message(parts: list[str], message: Any) -> None:
    if not isinstance(message, dict):
        parts.append(_MSG + _json_text(message))
        return
    role = message.get("role")
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str) and isinstance(role, str):
        parts.append(_MSG + role + _FIELD)  # most messages: a role and a string, only
        parts.append(content)  # (not concatenated: the text is copied once, by the final join)
        return
    parts.append(_MSG + (role if isinstance(role, str) else "") + _FIELD)
    name = message.get("name")
    if isinstance(name, str):
        parts.append(name + _FIELD)
    _append_content(parts, content)
    for call_field in ("tool_calls", "function_call"):
        value = message.get(call_field)
        if value is not None:
            parts.append(_FIELD + _json_text(value))
    tool_call_id = message.get("tool_call_id")
    if isinstance(tool_call_id, str):
        parts.append(_FIELD + tool_call_id)


def _append_content(parts: list[str], content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        parts.append(content)
        return
    if isinstance(content, list):
        for part in content:
            _append_part(parts, part)
        return
    parts.append(_json_text(content))


def _append_part(parts: list[str], part: Any) -> None:
    if isinstance(part, str):
        parts.append(part)
        return
    if isinstance(part, dict):
        text = part.get("text")
        if isinstance(text, str) and part.get("type") in (None, "text", "input_text", "output_text"):
            parts.append(text)
            return
    # An image, audio or file part: a stable digest of its data, so two images are two prefixes.
    parts.append(_DIGEST + format(hash_bytes(_json_bytes(part)), "016x") + _DIGEST)


def _append_input(parts: list[str], value: Any) -> None:
    if isinstance(value, str):
        parts.append(_MSG + "input" + _FIELD + value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and ("role" in item or "content" in item):
                _append_message(parts, item)
            elif isinstance(item, str):
                parts.append(_MSG + _FIELD + item)
            else:
                parts.append(_MSG + _json_text(item))
    elif value is not None:
        parts.append(_MSG + _json_text(value))


def _append_prompt(parts: list[str], prompt: Any) -> None:
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        # A list of strings, one token-id array, or a list of token-id arrays: each in order.
        for item in prompt:
            parts.append(item if isinstance(item, str) else _json_text(item))
            parts.append(_MSG)
    elif prompt is not None:
        parts.append(_json_text(prompt))


def _json_bytes(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError) as exc:  # nested past orjson's encoder limit
        raise NotCanonicalisable(str(exc)) from exc


def _json_text(value: Any) -> str:
    return _json_bytes(value).decode("utf-8", "replace")
