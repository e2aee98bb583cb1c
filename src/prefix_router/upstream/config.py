"""The upstream client's frozen configuration: built once from the validated settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """What the client needs of `upstream.*` settings, frozen (settings.py validates and builds it)."""

    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 120.0
    max_connections: int = 4096
    max_connections_per_backend: int = 1024
    keepalive_timeout_s: float = 4.0
