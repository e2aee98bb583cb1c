"""A simulated vLLM backend: OpenAI-compatible HTTP, a vLLM-like prefix cache, a TTFT/ITL model.

The embedded default for the demo and the backend of the benchmarks. Independent of the router:
nothing here imports from outside `prefix_router.sim`, and the router core never imports this.
"""

from __future__ import annotations

from prefix_router.sim.cache import BlockAllocation, PrefixCache, hash_prompt_blocks
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend, SimFleet
from prefix_router.sim.scheduler import ScheduledRequest, Scheduler
from prefix_router.sim.server import SimServer

__all__ = [
    "BlockAllocation",
    "PrefixCache",
    "ScheduledRequest",
    "Scheduler",
    "SimBackend",
    "SimConfig",
    "SimFleet",
    "SimServer",
    "hash_prompt_blocks",
]
