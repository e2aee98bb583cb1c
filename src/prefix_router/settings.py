"""Configuration: a YAML file, overridden by `PREFIX_ROUTER_<SECTION>__<FIELD>` environment variables,
overridden by command-line flags. Validated once at start-up; the result is passed in, never global.
This is the only module that reads the environment.
"""

from __future__ import annotations

import ipaddress
import os
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
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from prefix_router.errors import SettingsError
from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig, KeyMode, Policy, RingKey
from prefix_router.upstream.config import UpstreamConfig

ENV_PREFIX = "PREFIX_ROUTER_"
CONFIG_ENV = "PREFIX_ROUTER_CONFIG"  # path of the YAML file, when --config is not given


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = "0.0.0.0"  # listen on every interface: the router is the front door
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)  # 32 MiB: long contexts are a few MB of JSON
    max_header_bytes: int = Field(65536, ge=1024)  # total request-head size; over it -> 431
    header_timeout_s: float = Field(10.0, gt=0)  # slowloris bound for the request head -> 408
    body_timeout_s: float = Field(30.0, gt=0)  # slowloris bound between body chunks -> 408
    # A client that takes nothing of a response for this long is disconnected, and its backend
    # request cancelled with it (nginx's send_timeout): a stalled reader must not hold a GPU slot.
    send_timeout_s: float = Field(60.0, gt=0)
    # An idle kept-alive client connection closes after this. nginx's 75 s: longer than the pools of
    # common clients (httpx and so the OpenAI SDK expire theirs at 5 s), so the client always closes
    # first and never reuses a connection the router is closing.
    keepalive_timeout_s: float = Field(75.0, gt=0)
    # All request bodies the listener holds at once, from their first byte until their response
    # starts (a non-streaming request holds its body through its generation). 48 MiB: one body at
    # max_body_bytes beside many ordinary ones (chat bodies are KBs; a 128k-token prompt is ~0.5 MB of
    # JSON). The process peaks near twice it (each body and the upstream request carrying it):
    # benchmarks/listener_memory.py measured +90 MiB under 12 concurrent 30 MiB uploads. Over it a
    # request waits up to 2 s for room, then gets 503 + Retry-After. Must be >= max_body_bytes.
    max_buffered_body_bytes: int = Field(48 * 1024 * 1024, gt=0)
    # Open client connections; one more is answered 503 and closed (Envoy's overflow). Above the
    # 10,000 concurrent streams one process is sized for, below common open-file limits.
    max_connections: int = Field(16384, gt=0)
    # nginx's underscores_in_headers (off): header names with "_" are dropped, because backends that
    # map names to CGI-style variables read X_Tenant as X-Tenant.
    underscores_in_headers: bool = False
    access_log: bool = False  # one JSON line per request on logger prefix_router.access (INFO)
    # Also log /healthz, /readyz and /metrics: off, as probes and scrapes would be most of the lines.
    access_log_probes: bool = False
    # Add x-prefix-router-backend naming the backend (its URL) that answered. Off: the URL is an
    # internal address that every client would see; operators have the access log and metrics.
    backend_header: bool = False
    metrics_port: int | None = Field(None, ge=0, le=65535)  # None: /metrics on the main port only
    admin_host: str = "127.0.0.1"  # the admin listener is private by default
    admin_port: int | None = Field(None, ge=0, le=65535)  # None: no admin listener (drain API off)
    admin_token: SecretStr | None = None  # when set, admin calls need `Authorization: Bearer <token>`
    drain_timeout_s: float = Field(30.0, ge=0)  # SIGTERM: how long in-flight streams may finish
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _check_body_budget(self) -> ServerSettings:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError("server.max_buffered_body_bytes must be at least server.max_body_bytes")
        return self


class BackendSettings(_Section):
    url: str
    weight: float = Field(1.0, gt=0, le=100)
    # What it serves, until its own /v1/models says (or for good, if it lists none): model names.
    models: tuple[str, ...] = ()

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
    mode: DiscoveryMode = DiscoveryMode.STATIC
    scheme: Literal["http", "https"] = "http"
    dns_name: str | None = None  # a headless Service name; every A/AAAA record is a backend
    dns_port: int = Field(8000, ge=1, le=65535)
    dns_interval_s: float = Field(5.0, gt=0)
    dns_nameserver: str | None = None  # resolver address (tests, or to bypass /etc/resolv.conf)
    dns_nameserver_port: int = Field(53, ge=1, le=65535)
    k8s_namespace: str | None = None  # default: the pod's own namespace
    k8s_service: str | None = None
    k8s_port_name: str | None = None  # EndpointSlice port name; default: the slice's first port
    k8s_api_url: str | None = None  # default: in-cluster service account config
    # A pod label naming the model the pod serves (needs pods: list): declared until /v1/models answers.
    k8s_model_label: str | None = None

    @model_validator(mode="after")
    def _check_mode(self) -> DiscoverySettings:
        if self.mode is DiscoveryMode.DNS and not self.dns_name:
            raise ValueError("discovery.mode 'dns' needs discovery.dns_name")
        if self.mode is DiscoveryMode.KUBERNETES and not self.k8s_service:
            raise ValueError("discovery.mode 'kubernetes' needs discovery.k8s_service")
        return self


class RoutingSettings(_Section):
    mode: KeyMode = KeyMode.AUTO
    prefix_chars: int = Field(4096, gt=0)  # ~1k tokens: a system prompt, not the whole conversation
    # `conversation`: the ring key ends at the end of the preamble (tools, system) when it is most of
    # the first exchange, else at the end of the first message after it (at most prefix_chars), so
    # every turn of a conversation and every replica agree; `prefix`: always prefix_chars.
    ring_key: RingKey = RingKey.CONVERSATION
    prefix_bytes: int = Field(4096, gt=0)  # native APIs: the same budget in bytes of canonical JSON
    tenant_header: str = "x-prefix-cache-key"
    trust_prompt_cache_key: bool = True  # use OpenAI's `prompt_cache_key` body field as the tenant
    vnodes: int = Field(160, ge=1, le=10000)  # shares spread ~1/sqrt(160) = 8%; busiest 1.16x mean (N=16)
    prefix_index: bool = True  # follow conversations past the fixed prefix (see routing/prefix_index.py)
    prefix_index_entries: int = Field(200_000, ge=1)  # ~40 MB at most
    block_bytes: int = Field(256, ge=16)  # prefix-index granularity at the start of the key
    max_key_bytes: int = Field(262_144, ge=256)  # how deep the prefix index looks into a body
    # Hold a streaming request whose prefix another request is prefilling on its backend right now,
    # up to this long, so it finds the prefix cached (0: off). See routing/prefill.py.
    prefill_wait_s: float = Field(5.0, ge=0)
    # A known prefix is followed only when it covers this share of the request (0: any known prefix):
    # SGLang's cache_threshold. A system prompt all traffic shares stays under it.
    follow_threshold: float = Field(0.5, ge=0, le=1)
    # Where a prefix goes that no backend holds enough of: `cache_room`, the backend whose cache keeps
    # things longest (best for one router, or replicas with shared state); `ring`, the ring's choice,
    # which stateless replicas agree on.
    first_placement: FirstPlacement = FirstPlacement.CACHE_ROOM
    # Each backend's KV capacity in tokens; None: read from vLLM's vllm:cache_config_info.
    kv_capacity_tokens: int | None = Field(None, gt=0)
    bytes_per_token: float = Field(4.0, gt=0)  # key bytes a cached token stands for (~4 for English)
    # Several replicas share prefix owners and footprints through this Redis/Valkey
    # (redis://host:port/db, rediss://, unix://path): one round trip per request at most, and local
    # routing while it is slow or down. Empty: each replica keeps its own state (fleet/shared_state.py).
    shared_state_url: str = ""
    shared_state_timeout_s: float = Field(0.05, gt=0)  # a reply later than this routes from local state
    set_cache_salt: bool = False  # set vLLM's cache_salt from the tenant, overwriting the client's
    cache_salt_secret: SecretStr | None = None  # key of the keyed hash that makes the salt

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
    policy: Policy = Policy.PREFIX
    max_inflight: int = Field(32, ge=1)  # per backend; ~vLLM's running batch under prefix-heavy load
    load_factor: float = Field(1.25, ge=1.0)  # bounded-load c: no backend above ceil(c * mean)
    load_floor: int = Field(8, ge=0)  # ...unless it holds fewer than this: small counts never spill
    spill: bool = True  # off: the ring's choice wins regardless of load (a benchmark baseline)
    queue_max: int = Field(64, ge=0)  # requests that may wait for a free backend when all are full
    queue_timeout_s: float = Field(0.5, ge=0)  # how long one may wait before a 503 + Retry-After


class UpstreamSettings(_Section):
    connect_timeout_s: float = Field(3.0, gt=0)
    # Non-streaming completions send nothing until generation ends, so this is generous by default.
    first_byte_timeout_s: float = Field(300.0, gt=0)
    stream_idle_timeout_s: float = Field(120.0, gt=0)  # between chunks; never a total deadline
    max_connections: int = Field(4096, ge=1)
    max_connections_per_backend: int = Field(1024, ge=1)
    # An idle pooled connection is closed after this; below vLLM's (uvicorn's) own 5 s, so the router
    # closes first instead of racing the backend's close with a new request.
    keepalive_timeout_s: float = Field(4.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=10)  # first try included
    retry_budget_ratio: float = Field(0.2, ge=0, le=1)  # retries at once, as a share of active requests
    retry_budget_min: int = Field(3, ge=0)  # retries always allowed at once, however few are active

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
    path: str = "/health"
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)  # consecutive failures (probes or connects) to eject
    healthy_threshold: int = Field(2, ge=1)  # consecutive probe successes to come back
    max_ejected_ratio: float = Field(0.5, ge=0, le=1)  # never eject more of the fleet than this
    slow_start_s: float = Field(10.0, ge=0)  # a recovered backend's weight ramps up over this


class LoadSignalSettings(_Section):
    enabled: bool = False  # scrape vLLM /metrics so several replicas respect one bound
    interval_s: float = Field(0.5, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    path: str = "/metrics"


class ModelSettings(_Section):
    # Ask every backend's /v1/models what it serves (at start, each health interval, when one joins),
    # and send a request only to backends serving its `model`. Off: every backend serves every model.
    probe: bool = True
    path: str = "/v1/models"
    timeout_s: float = Field(2.0, gt=0)
    # A request for a LoRA adapter no backend has loaded goes to its base model's backends (for vLLM
    # with runtime LoRA loading, which loads it there) instead of a 404 from the router.
    adapters_to_base: bool = False
    # adapter -> base model, for adapters no backend lists yet (one base model in the fleet: assumed).
    adapter_bases: dict[str, str] = Field(default_factory=dict)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True, case_sensitive=False
    )

    server: ServerSettings = ServerSettings()
    backends: tuple[BackendSettings, ...] = ()
    discovery: DiscoverySettings = DiscoverySettings()
    routing: RoutingSettings = RoutingSettings()
    balancing: BalancingSettings = BalancingSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    health: HealthSettings = HealthSettings()
    load_signal: LoadSignalSettings = LoadSignalSettings()
    models: ModelSettings = ModelSettings()

    @model_validator(mode="after")
    def _check_backends(self) -> Settings:
        urls = [b.url for b in self.backends]
        if len(set(urls)) != len(urls):
            raise ValueError("backends: the same url is listed twice")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags beat the environment, which beats the file.
        return init_settings, env_settings

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
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, *, environ: bool = True
) -> Settings:
    """Settings from a YAML file (or $PREFIX_ROUTER_CONFIG), the environment, then `overrides`.

    Raises SettingsError with one line naming the field and the reason.
    """
    if path is None and environ:
        path = os.environ.get(CONFIG_ENV) or None
    file_values: dict[str, Any] = {}
    if path is not None:
        file_values = read_yaml(Path(path))
    try:
        if environ:
            return _settings_class(file_values)(**(overrides or {}))
        return Settings.model_validate(_deep_merge(file_values, overrides or {}))
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc
    except ValueError as exc:  # a malformed JSON value in an environment variable
        raise SettingsError(f"config error: {exc}") from exc


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
    return f"config error: {loc}: {msg}{extra}{more}"


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _settings_class(file_values: dict[str, Any]) -> type[Settings]:
    """Settings whose lowest-priority source is the already-read YAML mapping."""

    class _FromFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, _MappingSource(settings_cls, file_values)

    return _FromFile


class _MappingSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)
