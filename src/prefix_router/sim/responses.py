"""The Responses API as vLLM serves it with its response store on: request parsing, the stored
conversation behind `previous_response_id`, response objects and their stream of events.

vLLM keeps stored responses in the server's memory only (VLLM_ENABLE_RESPONSES_API_STORE=1), which
is what makes routing follow-ups matter: an id another server made is answered with vLLM's 404,
`Response with id '...' not found.` (type invalid_request_error, param response_id).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from prefix_router.sim.config import SimConfig
from prefix_router.sim.protocol import RequestRejected, filler_token, parse_body, parse_cache_salt
from prefix_router.sim.tokens import ChatMessage, Prompt, render_chat, tokenize_text


def not_found(response_id: str) -> RequestRejected:
    return RequestRejected(
        f"Response with id '{response_id}' not found.",
        status=404,
        param="response_id",
        error_type="invalid_request_error",
    )


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as last returned
    conversation: tuple[ChatMessage, ...]  # what a follow-up continues: inputs and outputs, in order


class ResponseStore:
    """Stored responses by id, the oldest dropped past `max_entries`."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse:
        stored = self._entries.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            raise not_found(response_id)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    prompt: Prompt
    conversation: tuple[ChatMessage, ...]  # the history plus this request's input (no instructions)
    instructions: str | None
    previous_response_id: str | None
    max_tokens: int
    is_stream: bool
    store: bool
    cache_salt: str | None


def parse_responses_request(body: bytes, config: SimConfig, store: ResponseStore) -> ResponsesRequest:
    """Validate a POST /v1/responses body; raises RequestRejected (404 for an unknown previous id)."""
    fields = parse_body(body, config)
    if fields.get("background") is True:
        raise RequestRejected("the simulator does not support background responses", param="background")
    previous_id = fields.get("previous_response_id")
    history: tuple[ChatMessage, ...] = ()
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise RequestRejected("`previous_response_id` must be a string", param="previous_response_id")
        history = store.get(previous_id).conversation
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestRejected("`instructions` must be a string", param="instructions")
    conversation = history + input_messages(fields.get("input"))
    rendered = rendered_messages(instructions, conversation)
    max_tokens = fields.get("max_output_tokens", config.default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestRejected("`max_output_tokens` must be a positive integer", param="max_output_tokens")
    model = fields.get("model")
    return ResponsesRequest(
        model=model if isinstance(model, str) else config.model,
        prompt=tokenize_text(render_chat(rendered)),
        conversation=conversation,
        instructions=instructions,
        previous_response_id=previous_id,
        max_tokens=min(max_tokens, config.max_tokens_limit),
        is_stream=fields.get("stream") is True,
        store=fields.get("store", True) is not False and config.responses_store,
        cache_salt=parse_cache_salt(fields),
    )


def rendered_messages(instructions: str | None, conversation: Sequence[ChatMessage]) -> list[ChatMessage]:
    """What the engine renders for a Responses request: `instructions` as the system message, then
    the conversation (the benchmarks' oracle renders a request alike)."""
    return ([ChatMessage("system", instructions)] if instructions else []) + list(conversation)


def input_messages(value: Any) -> tuple[ChatMessage, ...]:
    """The messages a Responses `input` renders as (the benchmarks' oracle renders it alike); raises
    RequestRejected for an input the simulator does not take."""
    if isinstance(value, str) and value:
        return (ChatMessage("user", value),)
    if not isinstance(value, list) or not value:
        raise RequestRejected("`input` must be a non-empty string or list of items", param="input")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise RequestRejected("each `input` item must be an object", param="input")
        role = item.get("role")
        content = item.get("content")
        if isinstance(role, str) and isinstance(content, str):
            out.append(ChatMessage(role, content))
        elif isinstance(role, str) and isinstance(content, list):
            text = "".join(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
            out.append(ChatMessage(role, text))
        else:  # a tool call's output and the like: its JSON, as the user's turn
            out.append(ChatMessage("user", orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode()))
    return tuple(out)


class ResponseBuilder:
    """The response object and events of one request; ids and timestamps are fixed per request."""

    def __init__(self, request: ResponsesRequest) -> None:
        self._request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._sequence = 0

    def response(
        self, status: str, text: str | None, cached_tokens: int = 0, output_tokens: int = 0
    ) -> dict[str, Any]:
        request = self._request
        usage = None
        if status == "completed":
            input_tokens = request.prompt.num_tokens
            usage = {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "model": request.model,
            "status": status,
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "output": [] if text is None else [self.message(text, "completed")],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "background": False,
            "max_output_tokens": request.max_tokens,
            "store": request.store,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
            "error": None,
            "incomplete_details": None,
            "metadata": {},
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {
            "id": self._message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event, vLLM's framing: `event: <type>` then its JSON on one `data:` line."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening_events(self) -> bytes:
        started = self.response("in_progress", None)
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        item = self.message("", "in_progress")
        return b"".join(
            [
                self.event("response.created", response=started),
                self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", part=part, **where),
            ]
        )

    def delta_event(self, delta: str) -> bytes:
        where = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        return self.event("response.output_text.delta", delta=delta, logprobs=[], **where)

    def closing_events(self, final: dict[str, Any]) -> bytes:
        text = final["output"][0]["content"][0]["text"]
        where = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        return b"".join(
            [
                self.event("response.output_text.done", text=text, logprobs=[], **where),
                self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
                self.event("response.completed", response=final),
            ]
        )


def output_text(num_tokens: int) -> str:
    return "".join(filler_token(index) for index in range(num_tokens))


def replay_events(body: dict[str, Any], starting_after: int | None) -> Iterator[bytes]:
    """The events of a stored response for `GET ...?stream=true`, after `starting_after`."""
    started = {**body, "status": "in_progress", "output": [], "usage": None}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
    ]
    for index, item in enumerate(body.get("output", [])):
        events.append(("response.output_item.added", {"output_index": index, "item": item}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append((f"response.{body['status']}", {"response": body}))
    for sequence, (kind, fields) in enumerate(events):
        if starting_after is None or sequence > starting_after:
            payload = {"type": kind, "sequence_number": sequence, **fields}
            yield b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
