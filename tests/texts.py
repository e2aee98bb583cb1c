"""Pseudo-random prompt text of an exact length, for tests and benchmarks that need many distinct prompts."""

from __future__ import annotations

import random
from collections.abc import Sequence


def random_text(rng: random.Random, chars: int, vocabulary: Sequence[str]) -> str:
    """Words drawn from `vocabulary`, space-separated, cut to exactly `chars` characters."""
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]
