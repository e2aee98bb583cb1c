"""How many bytes of key material one token of each backend's model stands for, learnt from the engine.

The ledgers count what the router placed in bytes of key material, and each cache's capacity is in
tokens (kv_capacity.py). The ratio between the two is the tokenizer's and the text's: about 4 for
English under Llama 3's, under 2 for a small model's vocabulary, other again for code or other scripts.
A ratio too high makes a cache look bigger than it is, so owners the engine has evicted stay "held".

Now and then the router sends a prompt it has just routed to a backend, and that backend answered, to
the backend's vLLM `/tokenize` (the same messages and template arguments, so the count includes the
chat template's tokens) and keeps bytes and tokens summed over the last SAMPLES samples. Until a
backend has answered one, and for engines without `/tokenize`, `routing.bytes_per_token`'s default
stands; a configured value is never replaced.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from prefix_router.upstream.client import Upstream

log = logging.getLogger(__name__)

DEFAULT_BYTES_PER_TOKEN = 4.0  # about English text's under common tokenizers
TOKENIZE_PATH = "/tokenize"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TOKENIZABLE_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})  # the prompts tokenize_body can send
SAMPLES = 16  # the ratio is the sums' over this many recent prompts
SETTLED_INTERVAL_S = 60.0  # one sample a backend this often once SAMPLES are in
# What shapes the rendered prompt, as vLLM's TokenizeChatRequest takes it.
_CHAT_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message",
                "chat_template", "chat_template_kwargs", "add_special_tokens")  # fmt: skip
_COMPLETION_FIELDS = ("model", "add_special_tokens")
# Answers that say the engine has no /tokenize for this: asked again a settled interval later.
_NOT_SERVED = frozenset({404, 405, 501})


def tokenize_body(path: str, body: bytes) -> bytes | None:
    """The `/tokenize` request for a chat or completions body, with what shapes its prompt; None when
    the body is not one to learn from (no messages, media in them, a prompt of token ids, not JSON)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    out: dict[str, Any]
    if path == CHAT_PATH:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages or not all(map(_text_only, messages)):
            return None
        out = {name: doc[name] for name in _CHAT_FIELDS if doc.get(name) is not None}
    elif path == COMPLETIONS_PATH:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str) or not prompt:
            return None
        out = {name: doc[name] for name in _COMPLETION_FIELDS if doc.get(name) is not None}
        out["prompt"] = prompt
    else:
        return None
    try:
        return orjson.dumps(out)
    except TypeError:  # orjson.JSONEncodeError: nested deeper than it writes, though it read it
        return None


def _text_only(message: object) -> bool:
    """Is the message text alone? An image's or audio's tokens stand for no key bytes, and the engine
    would fetch and process the media again to count them."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if not isinstance(content, list):
        return True
    return all(isinstance(part, dict) and part.get("type") == "text" for part in content)


def parse_token_count(body: bytes) -> int | None:
    """vLLM's `/tokenize` answer's `count`; None unless it is a positive integer."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    count = doc.get("count") if isinstance(doc, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


class TokenRatio:
    """Bytes over tokens, summed over the last SAMPLES samples: long prompts weigh as they fill caches."""

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: deque[tuple[int, int]] = deque(maxlen=SAMPLES)

    def add(self, key_bytes: int, tokens: int) -> None:
        self._samples.append((key_bytes, tokens))

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def value(self) -> float | None:
        tokens = sum(t for _, t in self._samples)
        return sum(b for b, _ in self._samples) / tokens if tokens else None


class BytesPerTokenProbe:
    """Takes at most one prompt a backend when `wants` says so, tokenizes it off the data path, and calls
    `changed(url)` when that backend's ratio moved."""

    def __init__(
        self,
        upstream: Upstream,
        live_urls: Callable[[], list[str]],
        changed: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._upstream = upstream
        self._live_urls = live_urls
        self._changed = changed
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._ratios: dict[str, TokenRatio] = {}
        self._due: dict[str, float] = {}  # url -> when the next prompt is wanted
        self._pending: dict[str, tuple[str, bytes, int]] = {}  # url -> (path, body, key bytes)
        self._offered = asyncio.Event()

    def ratio(self, url: str) -> float | None:
        """The backend's learnt bytes per token; None until it answered one prompt."""
        ratio = self._ratios.get(url)
        return ratio.value if ratio is not None else None

    def wants(self, url: str) -> bool:
        """Is a prompt routed to this backend wanted now? (A dict look-up: the data path asks.)"""
        return self._clock() >= self._due.get(url, 0.0)

    def offer(self, url: str, path: str, body: bytes, key_bytes: int) -> None:
        """A prompt of `key_bytes` bytes of key material (the whole of it, not cut at max_key_bytes)
        the backend answered; kept until the probe sends it, and no other is wanted before then."""
        self._due[url] = self._clock() + self._interval_s
        self._pending[url] = (path, body, key_bytes)
        self._offered.set()

    async def run(self) -> None:
        while True:
            await self._offered.wait()
            self._offered.clear()
            await self.probe_pending()

    async def probe_pending(self) -> None:
        live = set(self._live_urls())
        for gone in [u for u in self._due if u not in live]:
            del self._due[gone]
            self._ratios.pop(gone, None)
        pending, self._pending = self._pending, {}
        await asyncio.gather(*(self._guarded(url, *sample) for url, sample in pending.items() if url in live))

    async def _guarded(self, url: str, path: str, body: bytes, key_bytes: int) -> None:
        # Nothing one prompt holds may end the learning for every backend.
        try:
            await self._probe(url, path, body, key_bytes)
        except Exception:
            log.exception("learning the bytes per token of %s from one prompt failed", url)

    async def _probe(self, url: str, path: str, body: bytes, key_bytes: int) -> None:
        request = tokenize_body(path, body)
        if request is None:
            return  # (not a prompt to learn from: the next is wanted an interval later, as after any)
        answer = await self._upstream.fetch(url + TOKENIZE_PATH, self._timeout_s, json_body=request)
        if url not in self._live_urls():
            return  # it left meanwhile: its ledger is gone
        tokens = parse_token_count(answer[1]) if answer is not None and answer[0] == 200 else None
        if tokens is None:
            if answer is not None and (answer[0] in _NOT_SERVED or answer[0] == 200):
                # Not vLLM's /tokenize: the default stands, asked again a settled interval later.
                self._due[url] = self._clock() + SETTLED_INTERVAL_S
            return  # (busy, or the answer timed out: the next prompt an interval later)
        ratio = self._ratios.setdefault(url, TokenRatio())
        before = ratio.value
        ratio.add(key_bytes, tokens)
        if len(ratio) >= SAMPLES:
            self._due[url] = self._clock() + SETTLED_INTERVAL_S
        if before is None:
            log.info("backend %s: %.2f bytes of key material a token (from /tokenize)", url, ratio.value)
        if ratio.value != before:
            self._changed(url)
