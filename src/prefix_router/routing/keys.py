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
from prefix_router.routing.config import KeyConfig, KeyMode, RingKey
from prefix_router.routing.hashing import (
    encode_parts,
    hash_bytes,
    hash_rooted,
    prefix_hashes,
    prompt_end_hash,
)

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


# A value, but not frozen: a frozen dataclass sets each field through object.__setattr__, 1.4 µs of
# the 30 µs a decision may take (benchmarks/routing_decision.py). Nothing mutates a key once built,
# so it hashes by value all the same.
@dataclass(slots=True, unsafe_hash=True)
class RoutingKey:
    ring_hash: int  # position on the ring: tenant, model, first N characters/bytes
    blocks: tuple[int, ...]  # chained hashes of fixed-size blocks of the key material (prefix index)
    source: KeySource
    model: str | None
    tenant: str | None  # the header's value, else the body's prompt_cache_key when trusted
    # The body asks for a stream ("stream": true): how the request is answered, not where it goes.
    streaming: bool = field(default=False, compare=False)
    # Bytes of key material the blocks were cut from (at most max_key_bytes), and where the blocks
    # end in it: how much of the request a known prefix covers. Both follow from the fields above.
    size: int = field(default=0, compare=False)
    ends: tuple[int, ...] = field(default=(), compare=False)
    # Byte span of the last assistant message in the key material ((0, 0): none). The backend that
    # took the previous turn generated that reply, so its cache holds it though no request carried it.
    reply: tuple[int, int] = field(default=(0, 0), compare=False)
    # Bytes of key material the ring key covers when it ends at a message's end, short of
    # prefix_chars (0: it is cut at prefix_chars or prefix_bytes): that much of the request, the ring
    # places alike on every replica.
    ring_bytes: int = field(default=0, compare=False)
    # Chat and Responses only (0: none): a hash of the whole key material, and of the material before
    # the last assistant message, i.e. the previous turn's whole prompt. The index remembers where each
    # prompt went by the first, so the next turn finds the backend that took the previous one by the
    # second, however little of it filled a block of its own.
    prompt_end: int = field(default=0, compare=False)
    previous_prompt_end: int = field(default=0, compare=False)
    # Chat and Responses only: bytes at the end of the key material that no block covers and that are
    # this request's own: its last message (the new question, in most requests) and, in a later turn,
    # the last reply before it too. No other request shares them, yet the engine caches them: a
    # backend taking many short questions behind one cached system prompt turns its cache over though
    # its blocks stay few (routing/footprint.py counts them, under prompt_end).
    own_tail: int = field(default=0, compare=False)
    # With `cold_preamble_share` (0: none): the ring position of the preamble alone and the bytes it
    # covers, for the picker to place by while that preamble is cold (Picker.settle_key).
    preamble_ring_hash: int = field(default=0, compare=False)
    preamble_bytes: int = field(default=0, compare=False)
    # Set once by Picker.settle_key, before the first pick: the preamble carries less than one
    # backend's share of the recent traffic, so its cache lives on few backends.
    minor_preamble: bool = field(default=False, compare=False)

    @property
    def blocks_end(self) -> int:
        """Where the key's blocks end in its key material (0: it has none): past it, only the tail."""
        return self.ends[len(self.blocks) - 1] if self.blocks else 0

    def covered_bytes(self, known_blocks: int) -> int:
        """Bytes of key material a backend holding the first `known_blocks` blocks has cached: those
        blocks, and the last reply when they reach into its first block (the previous turn's prompt
        ended there, and its answer was generated on the same backend)."""
        if known_blocks <= 0:
            return 0
        ends = self.ends
        covered = ends[known_blocks - 1]
        start, end = self.reply
        if end > covered and known_blocks < len(ends) and ends[known_blocks] > start:
            return end
        return covered


# Enum members looked up once: reading one costs ~0.1 µs on CPython 3.11, a few per decision.
_MODE_OPENAI, _MODE_AUTO = KeyMode.OPENAI, KeyMode.AUTO
_OPENAI, _NATIVE, _RAW = KeySource.OPENAI, KeySource.NATIVE, KeySource.RAW


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
    is_object = isinstance(doc, dict)
    model: str | None = None
    streaming = False
    if is_object:
        model = doc.get("model")
        if not isinstance(model, str):
            model = None
        streaming = doc.get("stream") is True
        if tenant is None and config.tenant_body_field:
            tenant_field = doc.get(config.tenant_body_field)
            if isinstance(tenant_field, str):
                tenant = tenant_field

    mode = config.mode
    use_openai = mode is _MODE_OPENAI or (mode is _MODE_AUTO and path in OPENAI_PATHS)
    if use_openai and is_object:
        try:
            text = openai_text(path, doc)
        except NotCanonicalisable:
            text = ""  # a part too deep to encode: the request still routes, by its raw bytes below
        if text:
            encoded = text.encode("utf-8", "surrogatepass")
            ring_end = config.prefix_chars
            preamble = 0
            if config.ring_key is _RING_CONVERSATION and (
                "messages" in doc or path.endswith(("/chat/completions", "/responses"))
            ):
                ring_end = conversation_end(text, ring_end, config.preamble_share)
                if config.cold_preamble_share is not None:
                    preamble = cold_preamble_end(text, ring_end, config.cold_preamble_share)
            # The first ring_end characters: of ASCII text, the first as many bytes (a view: no copy).
            if text.isascii():
                material: bytes | memoryview = memoryview(encoded)[:ring_end]
            else:
                material = text[:ring_end].encode("utf-8", "surrogatepass")
            key = _key(_OPENAI, material, encoded[: config.max_key_bytes], tenant, model, config, streaming)
            key.reply = reply = _reply_span(text, encoded, config.max_key_bytes)
            if ring_end < config.prefix_chars:
                key.ring_bytes = len(material)
            if preamble:
                head = (
                    material[:preamble]
                    if text.isascii()
                    else text[:preamble].encode("utf-8", "surrogatepass")
                )
                key.preamble_ring_hash = hash_rooted(_key_root(tenant, model), head)
                key.preamble_bytes = len(head)
            if "messages" in doc or path.endswith("/responses"):
                # A conversation: a chat, or a Responses request (its `input` items are the messages;
                # a client that keeps no state on the server sends the whole history each turn).
                full, ends, root = encoded[: config.max_key_bytes], key.ends, _key_root(tenant, model)
                key.prompt_end = prompt_end_hash(root, full, ends, key.blocks, len(full))
                key.own_tail = own_tail_bytes(full, key.blocks_end, reply)
                if reply[1]:
                    key.previous_prompt_end = prompt_end_hash(root, full, ends, key.blocks, reply[0])
            return key

    if parsed:
        try:
            canon = canonical_prompt(doc) or canonical_bytes(doc)
            return _key(
                _NATIVE,
                memoryview(canon)[: config.prefix_bytes],
                canon,
                tenant,
                model,
                config,
                streaming,
            )
        except NotCanonicalisable:
            pass
    return _key(_RAW, memoryview(body)[: config.prefix_bytes], body, tenant, model, config)


_ASSISTANT = _MSG + "assistant" + _FIELD
_PREAMBLE = tuple(role + _FIELD for role in ("tools", "system", "developer", "instructions"))
_RING_CONVERSATION = RingKey.CONVERSATION
# A preamble shorter than this (~256 tokens: "You are a helpful assistant.") is shared too widely and
# saves too little to decide placement alone: the first message after it joins the key.
MIN_PREAMBLE_CHARS = 1024


# A preamble placed alone while it is cold: shorter ones save too little to group requests by.
MIN_COLD_PREAMBLE_CHARS = 512


def cold_preamble_end(text: str, ring_end: int, share: float) -> int:
    """Where the preamble ends when it may be placed alone while cold: at least MIN_COLD_PREAMBLE_CHARS
    and `share` of the first exchange; `ring_end` when it runs to the ring key's end (the ring key is
    the preamble already, or as much of it as a key holds); else 0."""
    exchange = _first_exchange(text, ring_end, share)
    if exchange is None:
        return ring_end
    preamble, first = exchange
    return preamble if preamble >= MIN_COLD_PREAMBLE_CHARS and preamble >= share * first else 0


def conversation_end(text: str, limit: int, preamble_share: float | None) -> int:
    """Where the ring key of rendered OpenAI text ends: the end of the preamble when it is at least
    MIN_PREAMBLE_CHARS and `preamble_share` (None: never) of the first exchange (preamble plus the
    message after it), else the end of that first message; never past `limit`.

    Both ends stay where they are as a conversation grows, so every turn has the ring position of the
    first, on every replica. Only the first `limit` characters are searched."""
    exchange = _first_exchange(text, limit, preamble_share)
    if exchange is None:
        return limit  # the preamble runs past the limit
    preamble, first = exchange
    if preamble_share is not None and preamble >= MIN_PREAMBLE_CHARS and preamble >= preamble_share * first:
        return preamble
    return min(first, limit)


def _first_exchange(text: str, limit: int, share: float | None) -> tuple[int, int] | None:
    """(where the preamble ends, where the first message after it ends) in rendered OpenAI text; None
    when the preamble runs past `limit`. The first message may end past the limit: with a `share`, it
    is looked for as far as weighing the preamble against it needs, and where it is not found by
    then, it ends there (or at the text's end)."""
    pos = 0
    while text.startswith(_MSG, pos) and text.startswith(_PREAMBLE, pos + 1):
        pos = text.find(_MSG, pos + 1, limit)
        if pos < 0:
            return None
    bound = limit if not share else max(limit, int(pos / share) + 1)
    first = text.find(_MSG, pos + 1, bound)
    if first < 0:
        first = min(bound, len(text))
    return pos, first


def _reply_span(text: str, encoded: bytes, limit: int) -> tuple[int, int]:
    """Byte span of the last reply starting in the first `limit` characters (the blocks go no deeper):
    the last assistant message, with the assistant items just before it (a Responses turn answers
    with several: reasoning, a message, function calls); (0, 0) when there is none."""
    last = text.rfind(_ASSISTANT, 0, limit)
    if last < 0:
        return (0, 0)
    end = text.find(_MSG, last + 1)
    if end < 0:
        end = len(text)
    start = last
    while start > 0:
        before = text.rfind(_MSG, 0, start)
        if before < 0 or not text.startswith(_ASSISTANT, before):
            break
        start = before
    if len(encoded) == len(text):  # ASCII: characters are bytes
        return (start, end)
    return (
        len(text[:start].encode("utf-8", "surrogatepass")),
        len(text[:end].encode("utf-8", "surrogatepass")),
    )


def own_tail_bytes(full: bytes, covered: int, reply: tuple[int, int]) -> int:
    """Bytes of `full` past `covered` (where its last block ends) from the last reply on (the previous
    turn's prompt ended there: its own tail counted up to it), or with no reply, those of the last
    message: the message separator is one byte, never inside a UTF-8 sequence, so bytes are searched
    directly."""
    if reply[1]:
        return len(full) - max(covered, min(reply[0], len(full)))
    last = full.rfind(_MSG_BYTE, covered)
    return len(full) - max(covered, last)


_MSG_BYTE = _MSG.encode()


def _key(
    source: KeySource,
    material: bytes | memoryview,
    full: bytes,
    tenant: str | None,
    model: str | None,
    config: KeyConfig,
    streaming: bool = False,
) -> RoutingKey:
    root = _key_root(tenant, model)
    ring = hash_rooted(root, material)  # == hash_parts(tenant, model, material)
    ends = block_ends(config.block_bytes, config.max_key_bytes)
    blocks = prefix_hashes(root, full, ends)
    size = min(len(full), config.max_key_bytes)
    return RoutingKey(ring, blocks, source, model, tenant, streaming, size, ends)


def _key_root(tenant: str | None, model: str | None) -> bytes:
    """What seeds every hash of a key: the tenant, then the model, encoded."""
    if (tenant is None or len(tenant) <= _CACHED_ROOT_CHARS) and (
        model is None or len(model) <= _CACHED_ROOT_CHARS
    ):
        return _cached_key_root(tenant, model)
    return _encode_key_root(tenant, model)


# A deployment serves a few models and, usually, a bounded set of tenants, so the encoding is almost
# always a cache hit (0.2 µs against 0.9). Both come from clients: only short ones are cached, so the
# cache stays within ~2.5 MB whatever they send (1,024 entries of at most 128 characters each, four
# bytes a character at worst, twice over: the key and the encoding).
_CACHED_ROOT_CHARS = 128


@functools.lru_cache(maxsize=1024)
def _cached_key_root(tenant: str | None, model: str | None) -> bytes:
    return _encode_key_root(tenant, model)


def _encode_key_root(tenant: str | None, model: str | None) -> bytes:
    return encode_parts(
        b"" if tenant is None else tenant.encode("utf-8", "surrogatepass"),
        b"" if model is None else model.encode("utf-8", "surrogatepass"),
    )


@functools.lru_cache(maxsize=8)
def block_ends(first_block: int, limit: int) -> tuple[int, ...]:
    """Where blocks of the key material end: `first_block` bytes each, doubling every 2 blocks, up to
    64x. Fine grain where conversations diverge, coarse deep in long documents, so a 32 KB body costs
    12 hashes and the 256 KB read of a long one 26, rather than 1,000. Depends on position only, so
    two keys sharing a prefix of length L share every boundary below L.

    Deep blocks can be coarse because the index decides by the owners of the deepest known block, not
    by its depth, and a conversation's own blocks all have its backend as owner. Doubling every 4
    blocks (20 hashes at 32 KB) made no difference to the hit rates of benchmarks/routing_quality.py
    and cost 1.6 µs more per 32 KB decision (benchmarks/routing_decision.py)."""
    ends: list[int] = []
    size, pos = first_block, 0
    while True:
        for _ in range(2):
            pos += size
            if pos > limit:
                return tuple(ends)
            ends.append(pos)
        size = min(size * 2, first_block * 64)


@functools.lru_cache(maxsize=8)
def block_sizes(ends: tuple[int, ...]) -> tuple[int, ...]:
    """The byte length of each block cut at `ends`."""
    return tuple(end - start for start, end in zip((0, *ends), ends, strict=False))


def openai_text(path: str, doc: dict[str, Any]) -> str:
    """The prompt text of an OpenAI-style request, in the order the engine sees it ('' if none)."""
    parts: list[str] = []
    if path.endswith("/chat/completions") or "messages" in doc:
        tools = doc.get("tools")
        if tools is not None:
            parts.append(_MSG + "tools" + _FIELD + _json_text(tools))
        messages = doc.get("messages")
        if isinstance(messages, list):
            _append_messages(parts, messages)
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


def _append_messages(parts: list[str], messages: list[Any]) -> None:
    append = parts.append
    markers = _ROLE_MARKERS
    for message in messages:
        # Most messages are a known role and a string, only: one inlined check (subscripts and class
        # reads, no calls but len: 0.25 µs a message, not 0.35), and the text is appended as it is, to
        # be copied once by the final join. Anything else takes the general path.
        try:
            if message.__class__ is dict and len(message) == 2:
                content = message["content"]
                if content.__class__ is str:
                    append(markers[message["role"]])
                    append(content)
                    continue
        except (KeyError, TypeError):  # no such field, or a role that is not a known string
            pass
        _append_message(parts, message)


_ROLE_MARKERS = {role: _MSG + role + _FIELD for role in ("system", "developer", "user", "assistant", "tool")}


def _append_message(parts: list[str], message: Any) -> None:
    if not isinstance(message, dict):
        parts.append(_MSG + _json_text(message))
        return
    role = message.get("role")
    content = message.get("content")
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
            if _is_model_output(item):
                # The model's own output, sent back: part of the reply the previous turn generated.
                parts.append(_ASSISTANT + _json_text(item))
            elif isinstance(item, dict) and ("role" in item or "content" in item):
                _append_message(parts, item)
            elif isinstance(item, str):
                parts.append(_MSG + _FIELD + item)
            else:
                parts.append(_MSG + _json_text(item))
    elif value is not None:
        parts.append(_MSG + _json_text(value))


# Responses items only the model produces (reasoning, and its calls of tools: `function_call`,
# `web_search_call`, ...); their results (`function_call_output`, ...) are the client's input.
_MODEL_OUTPUT_TYPES = frozenset({"reasoning", "mcp_list_tools", "mcp_approval_request"})


def _is_model_output(item: Any) -> bool:
    kind = item.get("type") if isinstance(item, dict) else None
    return isinstance(kind, str) and (kind in _MODEL_OUTPUT_TYPES or kind.endswith("_call"))


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
