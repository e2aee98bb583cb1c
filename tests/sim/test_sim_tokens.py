"""The chat template and the 4-bytes-per-token approximation."""

from __future__ import annotations

import pytest

from prefix_router.sim.tokens import ChatMessage, Prompt, render_chat, tokenize_ids, tokenize_text


def test_chat_renders_role_tags_and_a_generation_prompt() -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert render_chat(messages) == "<|system|>Be brief.<|user|>Hi<|assistant|>"
    assert render_chat(messages, add_generation_prompt=False) == "<|system|>Be brief.<|user|>Hi"


@pytest.mark.parametrize(
    ("text", "num_tokens"),
    [
        pytest.param("", 0, id="empty"),
        pytest.param("abc", 1, id="short-last-token"),
        pytest.param("abcd", 1, id="one-token"),
        pytest.param("abcde", 2, id="two-tokens"),
        pytest.param("é" * 4, 2, id="utf8-bytes-not-characters"),
    ],
)
def test_four_utf8_bytes_make_a_token(text: str, num_tokens: int) -> None:
    assert tokenize_text(text).num_tokens == num_tokens


def test_token_i_is_the_ith_four_byte_chunk() -> None:
    prompt = tokenize_text("abcdefghij")
    assert [prompt.token(i) for i in range(prompt.num_tokens)] == [b"abcd", b"efgh", b"ij"]
    with pytest.raises(IndexError):
        prompt.token(3)


def test_token_ids_take_one_token_each() -> None:
    assert tokenize_ids([1, 2, 3]) == Prompt(b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00")
    assert tokenize_ids([7] * 33).num_tokens == 33
