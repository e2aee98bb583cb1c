"""Configuration: a YAML file, overridden by `PREFIX_ROUTER_<SECTION>__<FIELD>` environment variables,
overridden by command-line flags. Validated once at start-up; the result is passed in, never global.
This is the only module that reads the environment, and only `load_settings` reads it: constructing a
`Settings` reads nothing. Each field's `description` is its documentation (docs/configuration.md is
generated from them by tools/gen_config_reference.py).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import types
import typing
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from prefix_router.errors import SettingsError
from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig, KeyMode, Policy, RingKey
from prefix_router.upstream.config import UpstreamConfig

ENV_PREFIX = "PREFIX_ROUTER_"
CONFIG_ENV = "PREFIX_ROUTER_CONFIG"  # path of the YAML file, when --config is not given
ENV_DELIMITER = "__"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = Field(
        "0.0.0.0",
        description="Listen address of the proxy port. Every interface by default: the router is "
        "the front door.",
    )
    port: int = Field(8080, ge=0, le=65535, description="Proxy port (also /healthz, /readyz, /metrics).")
    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="Largest request body, in bytes; a larger one gets 413 before it is read whole. 32 MiB: "
        "long contexts are a few MB of JSON.",
    )
    max_header_bytes: int = Field(
        65536, ge=1024, description="Largest request head (request line and fields), in bytes; over it: 431."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds the whole request head may take to arrive (a slowloris bound); over it: 408.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds allowed between two chunks of a request body (a slowloris bound); over it: 408.",
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a client may take nothing of a response before it is disconnected and its "
        "backend request cancelled (nginx's send_timeout): a stalled reader must not hold a GPU slot.",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="Seconds an idle kept-alive client connection stays open. nginx's 75 s: longer than the "
        "pools of common clients (httpx, and so the OpenAI SDK, expire theirs at 5 s), so the client always "
        "closes first and never reuses a connection the router is closing.",
    )
    max_buffered_body_bytes: int = Field(
        48 * 1024 * 1024,
        gt=0,
        description="Bytes of request bodies the listener holds at once, from their first byte until their "
        "response starts (a non-streaming request holds its body through its generation). 48 MiB: one body "
        "at max_body_bytes beside many ordinary ones; the process peaks near twice it. Over it a request "
        "waits up to 2 s for room, then gets 503 + Retry-After. At least max_body_bytes.",
    )
    max_connections: int = Field(
        16384,
        gt=0,
        description="Open client connections; one more is answered 503 and closed (Envoy's overflow). Above "
        "the 10,000 concurrent streams one process is sized for, below common open-file limits.",
    )
    underscores_in_headers: bool = Field(
        False,
        description="Forward header names that contain '_'. Off, as nginx's default: backends that map "
        "names to CGI-style variables would read X_Tenant as X-Tenant.",
    )
    access_log: bool = Field(
        False,
        description="One JSON line per request on stdout (logger prefix_router.access): time, client, "
        "method, path without the query, status, duration_s, backend, branch, bytes. Never a body, a query, "
        "a tenant or a header.",
    )
    access_log_probes: bool = Field(
        False,
        description="Also log /healthz, /readyz and /metrics. Off: probes and scrapes would be most of the "
        "lines.",
    )
    backend_header: bool = Field(
        False,
        description="Add x-prefix-router-backend naming the backend (its URL) that answered. Off: the URL is "
        "an internal address every client would see; operators have the access log and metrics.",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Also serve /metrics on this port; null: on the main port only."
    )
    admin_host: str = Field(
        "127.0.0.1", description="Listen address of the admin API; loopback by default, as it can drain."
    )
    admin_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the admin API (drain, backend states); null: no admin API."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="When set, admin calls need `Authorization: Bearer <token>`. A secret: give it through "
        "the environment.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="Seconds in-flight requests may finish after SIGTERM (/readyz fails at once, the "
        "listener closes).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="Level of the router's own log lines on stderr (the access log has its own switch).",
    )

    @model_validator(mode="after")
    def _check_body_budget(self) -> ServerSettings:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError("server.max_buffered_body_bytes must be at least server.max_body_bytes")
        return self


class BackendSettings(_Section):
    url: str = Field(
        description="scheme://host:port of a vLLM server, no path: the backend's identity on the hash ring."
    )
    weight: float = Field(1.0, gt=0, le=100, description="Share of the ring relative to the other backends.")
    models: tuple[str, ...] = Field(
        (),
        description="Model names it serves until its own /v1/models says (for good, if it lists none).",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return normalise_backend_url(value)


def normalise_backend_url(value: str) -> str:
    """`scheme://host:port` with no path: a backend's stable identity on the ring."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"backend url {value!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"backend url {value!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"backend url {value!r} must be scheme://host[:port] only")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"backend url {value!r}: {exc}") from exc
    host = parts.hostname
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{parts.scheme}://{host}:{port}"


class DiscoveryMode(StrEnum):
    STATIC = "static"
    DNS = "dns"
    KUBERNETES = "kubernetes"


class DiscoverySettings(_Section):
    mode: DiscoveryMode = Field(
        DiscoveryMode.STATIC,
        description="Where the backends come from: static (the `backends` list), dns (every A/AAAA record "
        "of dns_name) or kubernetes (the EndpointSlices of k8s_service; needs the `kubernetes` extra).",
    )
    scheme: Literal["http", "https"] = Field("http", description="Scheme used to reach discovered backends.")
    dns_name: str | None = Field(
        None, description="Mode dns: a headless Service name; every A/AAAA record is a backend."
    )
    dns_port: int = Field(8000, ge=1, le=65535, description="Mode dns: the backends' port.")
    dns_interval_s: float = Field(5.0, gt=0, description="Mode dns: seconds between two resolutions.")
    dns_nameserver: str | None = Field(
        None,
        description="Mode dns: a resolver address instead of /etc/resolv.conf's (tests, or to bypass it).",
    )
    dns_nameserver_port: int = Field(53, ge=1, le=65535, description="Mode dns: the resolver's port.")
    k8s_namespace: str | None = Field(
        None, description="Mode kubernetes: the namespace to watch; null: the pod's own."
    )
    k8s_service: str | None = Field(
        None, description="Mode kubernetes: the Service whose EndpointSlices list the vLLM pods."
    )
    k8s_port_name: str | None = Field(
        None, description="Mode kubernetes: the EndpointSlice port name; null: the slice's first port."
    )
    k8s_api_url: str | None = Field(
        None, description="Mode kubernetes: the API server; null: the in-cluster service account config."
    )
    k8s_model_label: str | None = Field(
        None,
        description="Mode kubernetes: a pod label naming the model the pod serves, declared until its "
        "/v1/models answers (needs pods: list).",
    )

    @model_validator(mode="after")
    def _check_mode(self) -> DiscoverySettings:
        if self.mode is DiscoveryMode.DNS and not self.dns_name:
            raise ValueError("discovery.mode 'dns' needs discovery.dns_name")
        if self.mode is DiscoveryMode.KUBERNETES and not self.k8s_service:
            raise ValueError("discovery.mode 'kubernetes' needs discovery.k8s_service")
        return self


class RoutingSettings(_Section):
    mode: KeyMode = Field(
        KeyMode.AUTO,
        description="How the routing key is taken: auto (message text on OpenAI endpoints, a byte prefix "
        "of canonical JSON elsewhere), openai or native.",
    )
    prefix_chars: int = Field(
        4096,
        gt=0,
        description="Characters of message text in the ring key. ~1k tokens: a system prompt, not the "
        "whole conversation.",
    )
    ring_key: RingKey = Field(
        RingKey.CONVERSATION,
        description="Where the ring key ends. conversation: at the end of the preamble (tools, system) when "
        "it is most of the first exchange, else at the end of the first message after it (at most "
        "prefix_chars), so every turn of a conversation and every replica agree; prefix: always "
        "prefix_chars.",
    )
    prefix_bytes: int = Field(
        4096, gt=0, description="Native APIs: the ring key's budget in bytes of canonical JSON."
    )
    tenant_header: str = Field(
        "x-prefix-cache-key",
        description="Request header naming the tenant; it seeds the hash, so tenants never share a "
        "placement.",
    )
    trust_prompt_cache_key: bool = Field(
        True, description="Use OpenAI's `prompt_cache_key` body field as the tenant too."
    )
    vnodes: int = Field(
        160,
        ge=1,
        le=10000,
        description="Ring points per backend (times its weight). Shares spread ~1/sqrt(160) = 8%; the "
        "busiest backend gets ~1.16x the mean with 16 backends.",
    )
    prefix_index: bool = Field(
        True,
        description="Follow conversations past the fixed prefix with a longest-prefix index "
        "(routing/prefix_index.py).",
    )
    prefix_index_entries: int = Field(
        200_000,
        ge=1,
        description="Block hashes the prefix index remembers (LRU), and as many chat prompts' ends; "
        "~70 MB at most.",
    )
    block_bytes: int = Field(
        256, ge=16, description="Prefix-index granularity at the start of the key, in bytes (coarser deeper)."
    )
    max_key_bytes: int = Field(
        262_144, ge=256, description="How deep into a body the prefix index looks, in bytes."
    )
    prefill_wait_s: float = Field(
        5.0,
        ge=0,
        description="Seconds a streaming request whose prefix another request is prefilling on its backend "
        "right now is held, so it finds the prefix cached (0: off; routing/prefill.py).",
    )
    follow_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A known prefix is followed only when it covers this share of the request (0: any "
        "known prefix), as SGLang's cache_threshold: a system prompt all traffic shares stays under it.",
    )
    first_placement: FirstPlacement = Field(
        FirstPlacement.CACHE_ROOM,
        description="Where a prefix goes that no backend holds enough of. cache_room: the backend whose "
        "cache keeps things longest (best for one router, or replicas with shared state); ring: the ring's "
        "choice, which stateless replicas agree on (the ring key then takes the first message after the "
        "preamble unless that preamble carries little of the traffic, and the prefix index is followed "
        "only past the ring key).",
    )
    kv_capacity_tokens: int | None = Field(
        None,
        gt=0,
        description="Each backend's KV capacity in tokens; null: read from vLLM's vllm:cache_config_info.",
    )
    bytes_per_token: float | None = Field(
        None,
        gt=0,
        description="Key bytes a cached token stands for, to compare text with KV capacity; null: learnt "
        "per backend from prompts it answered, sent now and then to vLLM's /tokenize (4, about English's, "
        "until one is learnt, and for engines without /tokenize).",
    )
    shared_state_url: str = Field(
        "",
        description="Replicas share prefix owners, footprints, prefills in progress and in-flight counts "
        "through this Redis/Valkey (redis://host:port/db, rediss://, unix://path): one round trip per "
        "request at most, and local routing while it is slow or down. Empty: each replica keeps its own "
        "state.",
    )
    shared_state_timeout_s: float = Field(
        0.05, gt=0, description="Seconds a shared-state reply may take; a later one routes from local state."
    )
    set_cache_salt: bool = Field(
        False,
        description="Set vLLM's cache_salt from the tenant (a keyed hash), overwriting the client's, so "
        "tenants cannot probe each other's cache.",
    )
    cache_salt_secret: SecretStr | None = Field(
        None,
        description="The key of the hash that makes the salt; required with set_cache_salt. A secret: give "
        "it through the environment.",
    )

    @field_validator("tenant_header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("shared_state_url")
    @classmethod
    def _check_shared_state_url(cls, value: str) -> str:
        value = value.strip()
        if value and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be empty or start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _check_salt(self) -> RoutingSettings:
        if self.set_cache_salt and not self.cache_salt_secret:
            raise ValueError("routing.set_cache_salt needs routing.cache_salt_secret")
        return self


class BalancingSettings(_Section):
    policy: Policy = Field(
        Policy.PREFIX,
        description="prefix (prefix index + consistent-hash ring + bounded load), random, round_robin or "
        "least_loaded.",
    )
    max_inflight: int = Field(
        32,
        ge=1,
        description="Requests in flight per backend before the next one spills over; ~vLLM's running batch "
        "under prefix-heavy load.",
    )
    load_factor: float = Field(
        1.25,
        ge=1.0,
        description="Bounded-load c: no backend above ceil(c x mean load), counting the new request.",
    )
    load_floor: int = Field(
        8,
        ge=0,
        description="...but the bound never falls below this many in flight: a few requests never "
        "spill a prefix.",
    )
    spill: bool = Field(
        True, description="Off: the ring's choice wins whatever the load (a benchmark baseline)."
    )
    queue_max: int = Field(
        64, ge=0, description="Requests that may wait for a free backend when every backend is full."
    )
    queue_timeout_s: float = Field(
        0.5,
        ge=0,
        description="Seconds one may wait in that queue before a 503 + Retry-After; also how long a "
        "request waits for the full backend holding its prefix while the others are as busy, before it "
        "takes any backend with room.",
    )


class UpstreamSettings(_Section):
    connect_timeout_s: float = Field(
        3.0, gt=0, description="Seconds to connect to a backend; a failure is retried on the next one."
    )
    first_byte_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds until the response head arrives (then 504). Generous: non-streaming "
        "completions send nothing until generation ends.",
    )
    stream_idle_timeout_s: float = Field(
        120.0, gt=0, description="Seconds allowed between two chunks of a response; never a total deadline."
    )
    max_connections: int = Field(4096, ge=1, description="Pooled connections to all backends at most.")
    max_connections_per_backend: int = Field(
        1024, ge=1, description="Pooled connections to one backend at most."
    )
    keepalive_timeout_s: float = Field(
        4.0,
        gt=0,
        description="Seconds an idle pooled connection is kept; below vLLM's (uvicorn's) own 5 s, so the "
        "router closes first instead of racing the backend's close with a new request.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="Tries per request, the first included (retries only before the first "
        "byte, on a connect failure or 503/429).",
    )
    retry_budget_ratio: float = Field(
        0.2, ge=0, le=1, description="Retries in progress at once, as a share of active requests."
    )
    retry_budget_min: int = Field(
        3, ge=0, description="Retries always allowed at once, however few requests are active."
    )

    def to_config(self) -> UpstreamConfig:
        return UpstreamConfig(
            connect_timeout_s=self.connect_timeout_s,
            first_byte_timeout_s=self.first_byte_timeout_s,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            max_connections=self.max_connections,
            max_connections_per_backend=self.max_connections_per_backend,
            keepalive_timeout_s=self.keepalive_timeout_s,
        )


class HealthSettings(_Section):
    path: str = Field("/health", description="Backend health endpoint probed actively (vLLM serves /health).")
    interval_s: float = Field(5.0, gt=0, description="Seconds between two probes of a backend.")
    timeout_s: float = Field(2.0, gt=0, description="Seconds a probe may take.")
    unhealthy_threshold: int = Field(
        3, ge=1, description="Consecutive failures (probes or connects) before a backend is ejected."
    )
    healthy_threshold: int = Field(
        2, ge=1, description="Consecutive passed probes before an ejected backend comes back."
    )
    max_ejected_ratio: float = Field(
        0.5, ge=0, le=1, description="Never eject more than this share of the fleet (a shared fault)."
    )
    slow_start_s: float = Field(
        10.0, ge=0, description="Seconds over which a recovered backend's share ramps up."
    )


class LoadSignalSettings(_Section):
    enabled: bool = Field(
        False,
        description="Scrape each backend's vLLM /metrics so several router replicas respect one load bound.",
    )
    interval_s: float = Field(0.5, gt=0, description="Seconds between two scrapes of a backend.")
    timeout_s: float = Field(1.0, gt=0, description="Seconds a scrape may take.")
    path: str = Field("/metrics", description="The backends' metrics endpoint.")


class ModelSettings(_Section):
    probe: bool = Field(
        True,
        description="Ask every backend's /v1/models what it serves (at start, each health interval, when "
        "one joins) and send a request only to backends serving its `model`. Off: every backend serves "
        "every model.",
    )
    path: str = Field("/v1/models", description="The backends' model list endpoint.")
    timeout_s: float = Field(2.0, gt=0, description="Seconds a model-list request may take.")
    adapters_to_base: bool = Field(
        False,
        description="A request for a LoRA adapter no backend has loaded goes to its base model's backends "
        "(for vLLM with runtime LoRA loading, which loads it there) instead of a 404 from the router.",
    )
    adapter_bases: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter -> base model, for adapters no backend lists yet (with one base model in the "
        "fleet, it is assumed).",
    )


class Settings(BaseModel):
    """Every setting, validated. A plain model: building one reads no file and no environment
    (`load_settings` does that)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerSettings = Field(ServerSettings(), description="The proxy's listener and side ports.")
    backends: tuple[BackendSettings, ...] = Field(
        (), description="The backends when discovery.mode is static: their URLs, weights and models."
    )
    discovery: DiscoverySettings = Field(DiscoverySettings(), description="Where the backends come from.")
    routing: RoutingSettings = Field(RoutingSettings(), description="The routing key and the placement.")
    balancing: BalancingSettings = Field(BalancingSettings(), description="The policy and its load bound.")
    upstream: UpstreamSettings = Field(UpstreamSettings(), description="Connections to the backends.")
    health: HealthSettings = Field(HealthSettings(), description="Active health probes of the backends.")
    load_signal: LoadSignalSettings = Field(
        LoadSignalSettings(), description="Load read from the backends' own metrics."
    )
    models: ModelSettings = Field(ModelSettings(), description="Which backend serves which model.")

    @model_validator(mode="after")
    def _check_backends(self) -> Settings:
        urls = [b.url for b in self.backends]
        if len(set(urls)) != len(urls):
            raise ValueError("backends: the same url is listed twice")
        return self

    def key_config(self) -> KeyConfig:
        r = self.routing
        return KeyConfig(
            r.mode,
            r.prefix_chars,
            r.prefix_bytes,
            r.block_bytes,
            r.max_key_bytes,
            "prompt_cache_key" if r.trust_prompt_cache_key else None,
            r.ring_key,
            # Placed by the ring, the preamble alone would send every conversation behind one system
            # prompt to the same backend from every replica.
            r.follow_threshold if r.first_placement is FirstPlacement.CACHE_ROOM else None,
            # The preamble's own position: placed by the ring, one that carries little of the traffic
            # is placed alone (routing/preamble_heat.py), so the requests behind it share a backend on
            # every replica; by cache room, a conversation behind one that carries less than a
            # backend's share stays where that preamble is cached.
            r.follow_threshold,
        )

    def balance_config(self) -> BalanceConfig:
        b = self.balancing
        return BalanceConfig(
            policy=b.policy,
            max_inflight=b.max_inflight,
            load_factor=b.load_factor,
            load_floor=b.load_floor,
            spill=b.spill,
            prefix_index=self.routing.prefix_index,
            prefix_index_entries=self.routing.prefix_index_entries,
            follow_threshold=self.routing.follow_threshold,
            first_placement=self.routing.first_placement,
        )


def load_settings(
    path: str | Path | None = None,
    *overrides: Mapping[str, Any] | None,
    environ: Mapping[str, str] | bool = True,
) -> Settings:
    """The one merge path: the YAML file (`path`, else $PREFIX_ROUTER_CONFIG), then the environment's
    PREFIX_ROUTER_* variables, then each of `overrides` in turn (flags), each layer beating the ones
    before it section by section; then one validation.

    `environ`: True reads os.environ, False no environment, a mapping that one. Raises SettingsError with
    one line naming the field (or the variable) and the reason.
    """
    env: Mapping[str, str] = os.environ if environ is True else (environ or {})
    if path is None:
        path = _config_path(env)
    merged = read_yaml(Path(path)) if path is not None else {}
    for layer in (values_from_environ(env), *overrides):
        merged = _deep_merge(merged, dict(layer or {}))
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc


def _config_path(env: Mapping[str, str]) -> str | None:
    for name, value in env.items():
        if name.upper() == CONFIG_ENV:
            return value or None
    return None


def values_from_environ(env: Mapping[str, str]) -> dict[str, Any]:
    """The PREFIX_ROUTER_<SECTION>__<FIELD> variables as a settings mapping (names case-insensitive).

    A variable that names no setting is an error, not ignored: a misspelt section or field would
    otherwise leave the default in force without a word. The message names the nearest valid variable.
    """
    out: dict[str, Any] = {}
    for raw_name, value in sorted(env.items()):
        name = raw_name.upper()
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        rest = name.removeprefix(ENV_PREFIX).lower()
        section, _, field = rest.partition(ENV_DELIMITER)
        model = _section_model(section) if section in Settings.model_fields else None
        if section not in Settings.model_fields or (
            field and (model is None or field not in model.model_fields)
        ):
            _unknown_variable(raw_name, rest)
        if not field:
            out[section] = _parse_json(raw_name, value) if model is not None else _parse_backends(value)
            continue
        assert model is not None
        structured = _is_structured(model.model_fields[field].annotation)
        out.setdefault(section, {})[field] = _parse_json(raw_name, value) if structured else value
    return out


def _section_model(section: str) -> type[BaseModel] | None:
    """The model of a section such as `server`; None for `backends`, a list."""
    annotation = Settings.model_fields[section].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _known_variables() -> list[str]:
    """Every variable name after the prefix, lower-case: `server`, `server__port`, ..."""
    names = []
    for section in Settings.model_fields:
        names.append(section)
        model = _section_model(section)
        names += [f"{section}{ENV_DELIMITER}{field}" for field in (model.model_fields if model else ())]
    return names


def _unknown_variable(name: str, rest: str) -> typing.NoReturn:
    close = difflib.get_close_matches(rest, _known_variables(), n=1, cutoff=0.6)
    if close:
        hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?"
    else:
        hint = f" (settings are {ENV_PREFIX}<SECTION>{ENV_DELIMITER}<FIELD>)"
    raise SettingsError(f"config error: environment variable {name} names no setting{hint}")


def _is_structured(annotation: Any) -> bool:
    """Lists, mappings and models come from the environment as JSON; scalars as they are."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_structured(arg) for arg in typing.get_args(annotation) if arg is not type(None))
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and (issubclass(origin, (tuple, list, dict, BaseModel)))


def _parse_json(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as exc:
        raise SettingsError(f"config error: {name} is not valid JSON: {exc}") from exc


def _parse_backends(value: str) -> Any:
    """PREFIX_ROUTER_BACKENDS: a JSON list, or comma-separated URLs (the short form for `docker run -e`)."""
    if value.lstrip().startswith("["):
        return _parse_json(f"{ENV_PREFIX}BACKENDS", value)
    return [{"url": url.strip()} for url in value.split(",") if url.strip()]


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"config error: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"config error: {path} is not valid YAML: {exc}".replace("\n", " ")) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config error: {path} must hold a mapping of sections")
    return data


def describe_validation_error(exc: ValidationError) -> str:
    """One line: the first offending field, dotted, and why."""
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    extra = f" (got {err['input']!r})" if err["type"] not in ("extra_forbidden", "missing") else ""
    if len(extra) > 80:
        extra = ""
    more = f"; and {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
    return f"config error: {loc}: {msg}{extra}{more}".replace("\n", " ")


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, mapping by mapping; anything else (a list, a value) in `top` replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
