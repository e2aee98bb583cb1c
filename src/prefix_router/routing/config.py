"""Plain configuration values the routing core takes; settings.py validates and builds them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class KeyMode(StrEnum):
    AUTO = "auto"  # OpenAI message text on OpenAI endpoints, native byte prefix elsewhere
    OPENAI = "openai"
    NATIVE = "native"


class Policy(StrEnum):
    PREFIX = "prefix"  # ours: prefix index + consistent-hash ring + bounded load
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


class RingKey(StrEnum):
    """Where an OpenAI request's ring key ends (never past prefix_chars)."""

    # The preamble (tools, system and developer messages) when it is most of the first exchange and
    # at least MIN_PREAMBLE_CHARS long, else the preamble and the first message after it: stable over
    # a conversation's turns and the same on every replica, with no state shared.
    CONVERSATION = "conversation"
    PREFIX = "prefix"  # always the first prefix_chars characters


class FirstPlacement(StrEnum):
    """Where a prefix goes that no backend holds enough of."""

    CACHE_ROOM = "cache_room"  # the backend whose cache keeps things longest (routing/footprint.py)
    RING = "ring"  # the ring's choice: the same on every replica, with no state shared


@dataclass(frozen=True, slots=True)
class KeyConfig:
    mode: KeyMode = KeyMode.AUTO
    prefix_chars: int = 4096
    prefix_bytes: int = 4096
    block_bytes: int = 256
    max_key_bytes: int = 262144
    tenant_body_field: str | None = "prompt_cache_key"  # OpenAI's field; None: header only
    ring_key: RingKey = RingKey.CONVERSATION
    # Of the first exchange, for the preamble alone to be the ring key; None: never (first placements
    # by the ring, where a preamble key would send every conversation behind one system prompt to
    # one backend on every replica).
    preamble_share: float | None = 0.5
    # Of the first exchange, for the key to carry the preamble's own ring position as well, by which
    # the picker tells how much of the traffic that preamble carries (routing/preamble_heat.py) and,
    # with first placements by the ring, places by it while that is little; None: never.
    cold_preamble_share: float | None = None


@dataclass(frozen=True, slots=True)
class BalanceConfig:
    policy: Policy = Policy.PREFIX
    max_inflight: int = 32
    load_factor: float = 1.25
    load_floor: int = 8  # the relative bound never falls below this many in flight
    spill: bool = True  # off: the ring's choice always wins while healthy (a benchmark baseline)
    prefix_index: bool = True
    prefix_index_entries: int = 200_000
    # A known prefix is followed only when it covers at least this share of the request's key
    # material: one system prompt shared by all traffic must not decide where conversations go.
    follow_threshold: float = 0.5
    first_placement: FirstPlacement = FirstPlacement.CACHE_ROOM
