"""The sim's stand-in for a chat template and a tokenizer.

Chat messages render as `<|role|>content` one after another, then `<|assistant|>` as the
generation prompt (vLLM's `add_generation_prompt`, on by default). Text becomes UTF-8 bytes, and
token i is bytes [4i, 4i+4) of them: the "~4 characters per token" rule of thumb for English, exact
enough for cache and timing arithmetic and free to compute. A prompt given as token ids (the
completions API allows it) packs each id into 4 bytes, so the two forms share one representation.

What must stay true: equal prompts give equal bytes, and a prompt that extends another gives bytes
that extend the other's — that is what makes prefix caching work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BYTES_PER_TOKEN = 4
GENERATION_PROMPT = "<|assistant|>"


@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenised prompt: its bytes, BYTES_PER_TOKEN to a token (the last may be short)."""

    data: bytes

    @property
    def num_tokens(self) -> int:
        return -(-len(self.data) // BYTES_PER_TOKEN)

    def token(self, index: int) -> bytes:
        """The bytes of token `index`; for tests and explanations, the hot path never splits."""
        if not 0 <= index < self.num_tokens:
            raise IndexError(index)
        return self.data[index * BYTES_PER_TOKEN : (index + 1) * BYTES_PER_TOKEN]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def render_chat(messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
    parts = [f"<|{message.role}|>{message.content}" for message in messages]
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def tokenize_text(text: str) -> Prompt:
    return Prompt(text.encode("utf-8", "surrogatepass"))


def tokenize_ids(token_ids: Sequence[int]) -> Prompt:
    """Pack ids as 4-byte little-endian words (mod 2**32), one token each."""
    return Prompt(
        b"".join((token_id & 0xFFFFFFFF).to_bytes(BYTES_PER_TOKEN, "little") for token_id in token_ids)
    )
