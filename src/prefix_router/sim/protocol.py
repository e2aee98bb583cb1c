"""The OpenAI wire format as vLLM speaks it: request validation, response bodies and SSE chunks.

Only the fields the sim acts on are read; others are accepted and ignored, as vLLM ignores
sampling parameters that do not change the simulated cost. Errors are vLLM-shaped:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from prefix_router.sim.config import SimConfig
from prefix_router.sim.tokens import ChatMessage, Prompt, render_chat, tokenize_ids, tokenize_text

Endpoint = Literal["chat", "completion"]

# Deterministic output: token i of every completion is FILLER_TOKENS[i % len].
FILLER_TOKENS: tuple[str, ...] = tuple(
    f" {word}"
    for word in [
        "lorem",
        "ipsum",
        "dolor",
        "sit",
        "amet",
        "consectetur",
        "adipiscing",
        "elit",
        "sed",
        "do",
        "eiusmod",
        "tempor",
        "incididunt",
        "ut",
        "labore",
        "et",
        "dolore",
        "magna",
        "aliqua",
    ]
)

SSE_DONE = b"data: [DONE]\n\n"


class RequestRejected(Exception):
    """A request the sim refuses, with the HTTP status vLLM would answer."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type

    def to_body(self) -> bytes:
        error_type = self.error_type or ("NotFoundError" if self.status == 404 else "BadRequestError")
        return encode_error(self.message, error_type=error_type, status=self.status, param=self.param)


def encode_error(message: str, *, error_type: str, status: int, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}})


def check_model(fields: dict[str, Any], config: SimConfig) -> None:
    """vLLM's 404 for a model (or adapter) the server does not serve."""
    model = fields.get("model")
    if model is not None and model not in config.served_models:
        raise RequestRejected(f"The model `{model}` does not exist.", status=404, param="model")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    endpoint: Endpoint
    prompt: Prompt
    max_tokens: int
    is_stream: bool
    include_usage: bool
    cache_salt: str | None
    model: str | None = None  # as asked for: the model or one of its adapters


def parse_body(body: bytes, config: SimConfig) -> dict[str, Any]:
    """A request body's JSON object, for a model this server serves; raises RequestRejected."""
    try:
        fields = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestRejected(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise RequestRejected("request body must be a JSON object")
    check_model(fields, config)
    return fields


def parse_generation_request(endpoint: Endpoint, body: bytes, config: SimConfig) -> GenerationRequest:
    """Validate a chat or completions body; raises RequestRejected."""
    fields = parse_body(body, config)
    n = fields.get("n", 1)
    if n is not None and n != 1:
        raise RequestRejected("the simulator supports only n=1", param="n")
    prompt = _parse_chat_prompt(fields) if endpoint == "chat" else _parse_completion_prompt(fields)
    stream = fields.get("stream") is True
    stream_options = fields.get("stream_options")
    include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
    return GenerationRequest(
        endpoint=endpoint,
        prompt=prompt,
        max_tokens=_parse_max_tokens(fields, config),
        is_stream=stream,
        include_usage=stream and include_usage,
        cache_salt=parse_cache_salt(fields),
        model=fields.get("model") if isinstance(fields.get("model"), str) else None,
    )


def parse_tokenize_request(body: bytes, config: SimConfig) -> Prompt:
    """vLLM's /tokenize body, chat (`messages`) or completion (`prompt`); raises RequestRejected."""
    fields = parse_body(body, config)
    if "messages" in fields:
        return _parse_chat_prompt(fields)
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        raise RequestRejected("`prompt` must be a string, or `messages` a list", param="prompt")
    return tokenize_text(prompt)


def _parse_chat_prompt(fields: dict[str, Any]) -> Prompt:
    raw_messages = fields.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestRejected("`messages` must be a non-empty list", param="messages")
    messages = []
    for raw in raw_messages:
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise RequestRejected("each message needs a string `role`", param="messages")
        messages.append(ChatMessage(raw["role"], _message_text(raw.get("content"))))
    add_generation_prompt = fields.get("add_generation_prompt", True) is not False
    return tokenize_text(render_chat(messages, add_generation_prompt=add_generation_prompt))


def _message_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Content parts: text parts are concatenated; other kinds (images...) add nothing here.
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    raise RequestRejected("message `content` must be a string or a list of parts", param="messages")


def _parse_completion_prompt(fields: dict[str, Any]) -> Prompt:
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenize_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return tokenize_ids(prompt)
    raise RequestRejected(
        "`prompt` must be a non-empty string, a list of token ids, or a batch of one of those", param="prompt"
    )


def _parse_max_tokens(fields: dict[str, Any], config: SimConfig) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestRejected(f"`{name}` must be an integer", param=name)
        if value < 1:
            raise RequestRejected(f"`{name}` must be at least 1, got {value}", param=name)
        return min(value, config.max_tokens_limit)
    return config.default_max_tokens


def parse_cache_salt(fields: dict[str, Any]) -> str | None:
    salt = fields.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise RequestRejected("`cache_salt` must be a non-empty string if provided", param="cache_salt")
    return salt


class ResponseWriter:
    """Builds the bodies of one response; ids and timestamps are fixed per request."""

    def __init__(self, request: GenerationRequest, model: str) -> None:
        self._request = request
        self._model = model
        self._created = int(time.time())
        if request.endpoint == "chat":
            self._id = f"chatcmpl-{uuid.uuid4().hex}"
            self._chunk_object = "chat.completion.chunk"
        else:
            self._id = f"cmpl-{uuid.uuid4().hex}"
            self._chunk_object = "text_completion"

    def usage(self, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
        prompt_tokens = self._request.prompt.num_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def full_response(self, cached_tokens: int, completion_tokens: int) -> bytes:
        text = "".join(filler_token(index) for index in range(completion_tokens))
        choice: dict[str, Any]
        if self._request.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            response_object = "chat.completion"
        else:
            choice = {"index": 0, "text": text}
            response_object = "text_completion"
        choice |= {"logprobs": None, "finish_reason": "length"}
        return orjson.dumps(
            {
                "id": self._id,
                "object": response_object,
                "created": self._created,
                "model": self._model,
                "choices": [choice],
                "usage": self.usage(cached_tokens, completion_tokens),
            }
        )

    def first_chunk(self) -> bytes:
        """Chat streams open with the assistant role, as OpenAI's and vLLM's do; completions don't."""
        if self._request.endpoint != "chat":
            return b""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def token_chunk(self, index: int) -> bytes:
        text = filler_token(index)
        if self._request.endpoint == "chat":
            return self._chunk({"index": 0, "delta": {"content": text}, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None})

    def last_chunks(self, cached_tokens: int, completion_tokens: int) -> bytes:
        """The finish_reason chunk, the usage chunk if asked for (empty choices), and [DONE]."""
        if self._request.endpoint == "chat":
            finish = {"index": 0, "delta": {}, "finish_reason": "length"}
        else:
            finish = {"index": 0, "text": "", "finish_reason": "length"}
        body = self._chunk(finish)
        if self._request.include_usage:
            body += self._sse(
                {
                    "id": self._id,
                    "object": self._chunk_object,
                    "created": self._created,
                    "model": self._model,
                    "choices": [],
                    "usage": self.usage(cached_tokens, completion_tokens),
                }
            )
        return body + SSE_DONE

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        choice["logprobs"] = None
        return self._sse(
            {
                "id": self._id,
                "object": self._chunk_object,
                "created": self._created,
                "model": self._model,
                "choices": [choice],
            }
        )

    @staticmethod
    def _sse(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"


def filler_token(index: int) -> str:
    return FILLER_TOKENS[index % len(FILLER_TOKENS)]
