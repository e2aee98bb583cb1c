"""prefix_router: a prefix-cache-aware HTTP routing proxy for vLLM fleets."""

from __future__ import annotations

__version__ = "0.1.0"
