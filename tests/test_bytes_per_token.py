"""What the router sends to vLLM's /tokenize to learn a backend's bytes per token, how it reads the
answer, and how samples add up."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.fleet.bytes_per_token import SAMPLES, TokenRatio, parse_token_count, tokenize_body

MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Every field of a chat body that shapes its prompt: sent to /tokenize as it is.
TEMPLATE_FIELDS = {
    "messages": MESSAGES,
    "tools": [{"type": "function"}],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template": "T",
    "chat_template_kwargs": {"x": 1},
    "add_special_tokens": True,
}


@pytest.mark.parametrize(
    ("path", "body", "sent"),
    [
        pytest.param(
            CHAT,
            {"model": "m", "messages": MESSAGES, "max_tokens": 9, "stream": True, "temperature": 0.1},
            {"model": "m", "messages": MESSAGES},
            id="chat-drops-what-does-not-shape-the-prompt",
        ),
        pytest.param(CHAT, TEMPLATE_FIELDS, TEMPLATE_FIELDS, id="chat-keeps-what-the-template-reads"),
        pytest.param(CHAT, {"model": "m", "messages": []}, None, id="chat-without-messages"),
        pytest.param(
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}]},
            id="chat-text-parts",
        ),
        pytest.param(
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Q"},
                            {"type": "image_url", "image_url": {"url": "x"}},
                        ],
                    }
                ]
            },
            None,
            id="chat-with-an-image",
        ),
        pytest.param(CHAT, {"messages": ["not a message"]}, None, id="chat-message-not-an-object"),
        pytest.param(
            COMPLETIONS,
            {"model": "m", "prompt": "abc", "max_tokens": 3, "add_special_tokens": False},
            {"model": "m", "prompt": "abc", "add_special_tokens": False},
            id="completion",
        ),
        pytest.param(COMPLETIONS, {"prompt": ["abc"]}, {"prompt": "abc"}, id="completion-batch-of-one"),
        pytest.param(COMPLETIONS, {"prompt": [1, 2, 3]}, None, id="completion-token-ids"),
        pytest.param(COMPLETIONS, {"prompt": ["a", "b"]}, None, id="completion-batch"),
        pytest.param("/v1/responses", {"input": "x"}, None, id="other-path"),
    ],
)
def test_the_tokenize_request_carries_the_prompt_as_the_engine_renders_it(
    path: str, body: dict[str, Any], sent: dict[str, Any] | None
) -> None:
    out = tokenize_body(path, orjson.dumps(body))
    assert (None if out is None else orjson.loads(out)) == sent


def test_a_body_nested_deeper_than_json_is_written_is_not_sent() -> None:
    # orjson reads 1,024 levels and writes 254: such a body is valid for vLLM, and skipped here.
    body = b'{"messages":[{"role":"user","content":"Q"}],"chat_template_kwargs":{"x":' + b"[" * 300
    body += b"1" + b"]" * 300 + b"}}"
    assert orjson.loads(body)["messages"]
    assert tokenize_body(CHAT, body) is None


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'"s"'])
def test_a_body_that_is_not_an_object_is_not_sent(body: bytes) -> None:
    assert tokenize_body(CHAT, body) is None


@pytest.mark.parametrize(
    ("answer", "count"),
    [
        pytest.param(b'{"count": 12, "max_model_len": 4096, "tokens": []}', 12, id="vllm"),
        pytest.param(b'{"count": 0, "tokens": []}', None, id="empty"),
        pytest.param(b'{"count": true}', None, id="bool"),
        pytest.param(b'{"count": "12"}', None, id="string"),
        pytest.param(b'{"ok": true}', None, id="not-tokenize"),
        pytest.param(b"<html>", None, id="not-json"),
    ],
)
def test_only_a_positive_count_is_read(answer: bytes, count: int | None) -> None:
    assert parse_token_count(answer) == count


def test_no_sample_no_ratio() -> None:
    assert TokenRatio().value is None


@given(st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**5)), min_size=1, max_size=3 * SAMPLES))
def test_the_ratio_is_the_recent_samples_bytes_over_their_tokens(samples: list[tuple[int, int]]) -> None:
    ratio = TokenRatio()
    for key_bytes, tokens in samples:
        ratio.add(key_bytes, tokens)
    recent = samples[-SAMPLES:]
    assert len(ratio) == len(recent)
    assert ratio.value == pytest.approx(sum(b for b, _ in recent) / sum(t for _, t in recent))
