"""Canonical JSON bytes, so two serialisations of one document route alike.

Sorted keys, compact separators, UTF-8 without escaping non-ASCII; the prompt-bearing fields first,
so that a sampling parameter such as `temperature` never shifts the prefix. orjson does the encoding
(sorted keys and compact output are its defaults), which keeps a 1 MB body within a few milliseconds.
"""

from __future__ import annotations

from typing import Any

import orjson

PROMPT_FIELDS: tuple[str, ...] = ("inputs", "prompt", "text", "messages", "input")


class NotCanonicalisable(ValueError):
    """The body is not a JSON document orjson can round-trip (invalid, too deep, lone surrogate…)."""


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise NotCanonicalisable(str(exc)) from exc


def canonical_bytes(doc: Any) -> bytes:
    """Canonical encoding of a parsed document, prompt fields first when it is an object."""
    try:
        if isinstance(doc, dict):
            head = [(k, doc[k]) for k in PROMPT_FIELDS if k in doc]
            if head:
                parts = [
                    orjson.dumps(k) + b":" + orjson.dumps(v, option=orjson.OPT_SORT_KEYS) for k, v in head
                ]
                rest = {k: v for k, v in doc.items() if k not in PROMPT_FIELDS}
                if rest:
                    parts.append(orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)[1:-1])
                return b"{" + b",".join(parts) + b"}"
        return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise NotCanonicalisable(str(exc)) from exc


def canonical_prompt(doc: Any) -> bytes | None:
    """Canonical bytes of only the prompt fields of an object (None if it has none).

    The key of a native request is this when it exists: the KV cache depends on the prompt, so two
    requests for one prompt with other sampling parameters must not be split by a short prompt
    leaving room for `temperature` inside the first N bytes.
    """
    if not isinstance(doc, dict):
        return None
    head = [(k, doc[k]) for k in PROMPT_FIELDS if k in doc]
    if not head:
        return None
    try:
        return (
            b"{"
            + b",".join(
                orjson.dumps(k) + b":" + orjson.dumps(v, option=orjson.OPT_SORT_KEYS) for k, v in head
            )
            + b"}"
        )
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise NotCanonicalisable(str(exc)) from exc


def canonicalise(body: bytes) -> bytes:
    """Canonical bytes of a JSON body; raises NotCanonicalisable for anything else."""
    return canonical_bytes(parse_json(body))
