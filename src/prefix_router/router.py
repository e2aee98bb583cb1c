"""`create_app(settings)`: the composition root. It builds the router's parts from the settings, wires
them, and owns their start and stop.

The main port's requests come from a front end (frontend.http1.Listener) to `RouterApp.handle`: the
local routes (frontend.local_routes) and the fleet's `/v1/models` are answered here, everything else is
`Proxy.handle`. The metrics port and the admin API are ops.admin's FastAPI apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefix_router import errors
from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy
from prefix_router.fleet.bytes_per_token import DEFAULT_BYTES_PER_TOKEN, BytesPerTokenProbe
from prefix_router.fleet.discovery import build_discovery
from prefix_router.fleet.health import HealthProber
from prefix_router.fleet.kv_capacity import KvCapacityProbe
from prefix_router.fleet.load_signal import LoadSignalScraper
from prefix_router.fleet.model_probe import ModelProber
from prefix_router.fleet.models import AdapterPolicy, ModelDirectory
from prefix_router.fleet.shared_state import SharedPlacement
from prefix_router.frontend.exchange import Exchange, ResponseParts
from prefix_router.frontend.local_routes import (
    LOCAL_PATHS,
    LOCAL_RAW_PATHS,
    LocalRoutes,
    error_code,
    error_response_parts,
    json_parts,
)
from prefix_router.ops.access_log import LOGGER_NAME, JsonAccessLog
from prefix_router.ops.admin import build_admin_app, build_metrics_app
from prefix_router.ops.metrics import BackendStatus, FleetSnapshot, RouterMetrics
from prefix_router.placement import PlacementConfig, Placer
from prefix_router.relay import Proxy
from prefix_router.routing.picker import Picker
from prefix_router.settings import Settings
from prefix_router.upstream.client import Upstream

log = logging.getLogger("prefix_router")
access_log = logging.getLogger(LOGGER_NAME)

MODELS_PATH = "/v1/models"


class RouterApp:
    """The router: `handle` answers the main port; `.admin_app` and `.metrics_app` (ASGI) share its state."""

    def __init__(self, settings: Settings, *, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        h = settings.health
        static = [BackendSpec(b.url, b.weight, frozenset(b.models)) for b in settings.backends]
        self.backends = BackendSet(
            static,
            vnodes=settings.routing.vnodes,
            health=HealthPolicy(
                unhealthy_threshold=h.unhealthy_threshold,
                healthy_threshold=h.healthy_threshold,
                max_ejected_ratio=h.max_ejected_ratio,
                slow_start_s=h.slow_start_s,
                probe_grace_s=2 * h.interval_s,
            ),
        )
        self.picker = Picker(settings.balance_config(), rng)
        self.upstream = Upstream(settings.upstream.to_config())
        self.metrics = RouterMetrics(self.registry, self.snapshot)
        m = settings.models
        self.models = ModelDirectory(
            self.backends, settings.routing.vnodes, AdapterPolicy(m.adapters_to_base, m.adapter_bases)
        )
        self.models.declare({spec.url: spec.models for spec in static})
        self._static = static
        self._model_prober: ModelProber | None = None
        # Replicas share placements through the store for our policy's index and ledgers only.
        self.shared: SharedPlacement | None = None
        if settings.routing.shared_state_url and self.picker.ledgers is not None:
            self.shared = SharedPlacement(
                settings.routing.shared_state_url,
                settings.routing.shared_state_timeout_s,
                self.registry,
                load=self.backends.load,
                held=self.picker.held_by_backend,
                prefill_wait_s=settings.routing.prefill_wait_s,
            )
        elif settings.routing.shared_state_url:
            log.warning("routing.shared_state_url is ignored: it serves the prefix policy with its index")
        b = settings.balancing
        self.placer = Placer(
            PlacementConfig(b.max_inflight, b.queue_max, b.queue_timeout_s, settings.routing.prefill_wait_s),
            self.backends,
            self.picker,
            self.metrics,
            rng,
            models=self.models,
            shared=self.shared,
        )
        # Each backend's bytes per token, learnt from its /tokenize unless configured (the ledgers'
        # capacities are in key bytes; fleet/bytes_per_token.py).
        self.token_ratios: BytesPerTokenProbe | None = None
        if self.picker.ledgers is not None and settings.routing.bytes_per_token is None:
            self.token_ratios = BytesPerTokenProbe(
                self.upstream,
                self.backends.live_urls,
                self._bytes_per_token_changed,
                interval_s=settings.health.interval_s,
                timeout_s=settings.health.timeout_s,
                clock=time.monotonic,
            )
        self._capacity: KvCapacityProbe | None = None
        self.proxy = Proxy(
            settings, self.backends, self.placer, self.upstream, self.metrics, self.token_ratios
        )
        self.draining = False
        self.access_log: JsonAccessLog | None = None
        if settings.server.access_log:
            skip = () if settings.server.access_log_probes else LOCAL_PATHS
            self.access_log = JsonAccessLog(access_log, skip)
        self._known: set[str] = set(b.url for b in self.backends.backends())
        for url in self._known:
            self.metrics.backend(url)  # its series at 0 from the start
        self.backends.on_change(self._membership_changed)
        self._tasks: list[asyncio.Task[None]] = []
        self.local_routes = LocalRoutes(self._not_ready, self._metrics_exposition)
        self.metrics_app = build_metrics_app(self.local_answer)
        self.admin_app = build_admin_app(
            settings.server.admin_token, self.backends, self.models, self.snapshot
        )

    # -- the main port -------------------------------------------------------------------------

    async def handle(self, ex: Exchange) -> None:
        if ex.raw_path in LOCAL_RAW_PATHS:
            if ex.method in ("GET", "HEAD"):
                ex.respond(*self.local_answer(ex.path))
            else:
                self._answer_error(ex, errors.MethodNotAllowed(f"{ex.path} answers GET only"))
            return
        if ex.path.startswith(MODELS_PATH) and ex.method in ("GET", "HEAD"):
            answer = self._models_answer(ex.path)
            if answer is not None:
                ex.respond(*answer)
                return
        try:
            await self.proxy.handle(ex)
        except errors.RouterError as exc:
            if not ex.started:
                self._answer_error(ex, exc)
        finally:
            if ex.status:
                self.metrics.model_answered(ex.model, ex.status)

    def _models_answer(self, path: str) -> ResponseParts | None:
        """`/v1/models` (the fleet's union) and `/v1/models/{id}`, once backends said what they serve;
        None: proxy it, as before."""
        if path == MODELS_PATH:
            listing = self.models.listing_body()
            return None if listing is None else json_parts(200, listing)
        if not path.startswith(MODELS_PATH + "/") or not self.models.view.known:
            return None
        model = path[len(MODELS_PATH) + 1 :]
        card = next((c for c in self.models.view.listing if c.get("id") == model), None)
        if card is None:
            return self.render_error(errors.ModelNotFound(f"The model `{model}` does not exist."))
        return json_parts(200, orjson.dumps(card))

    def _answer_error(self, ex: Exchange, exc: errors.RouterError) -> None:
        """An error the router answers on an exchange: counted with the backend tried, if any."""
        parts = error_response_parts(exc)
        self.metrics.router_errors.labels(error_code(exc)[2]).inc()
        self.metrics.answered_by_router(parts[0], ex.backend, ex.branch)
        ex.respond(*parts)

    def render_error(self, exc: errors.RouterError) -> ResponseParts:
        """An error the listener answers before the request reached `handle`, counted by its code."""
        parts = error_response_parts(exc)
        self.metrics.router_errors.labels(error_code(exc)[2]).inc()
        self.metrics.answered_by_router(parts[0], None, None)
        return parts

    def local_answer(self, path: str) -> ResponseParts:
        """(status, headers, body) of /healthz, /readyz or /metrics, on every port that serves them."""
        return self.local_routes.answer(path)

    def _not_ready(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.backends.is_ready():
            return "no backend has passed a health probe"
        return None

    def _metrics_exposition(self) -> tuple[bytes, bytes]:
        return CONTENT_TYPE_LATEST.encode(), generate_latest(self.registry)

    # -- resources -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.upstream.start()
        prober = HealthProber(self.settings.health, self.backends, self.upstream)
        self._spawn(prober.run(), "health")
        # What the listener should know when it opens, read side by side (each bounded by its own
        # timeout): the models each backend serves, so the first requests of a fleet of several
        # models go to their own backends, and each cache's KV capacity, so the first placements weigh
        # its room rather than an unknown, unbounded one.
        first_reads: list[Awaitable[None]] = []
        if self.settings.models.probe:
            m = self.settings.models
            self._model_prober = ModelProber(
                self.models,
                self.backends,
                self.upstream,
                path=m.path,
                interval_s=self.settings.health.interval_s,
                timeout_s=m.timeout_s,
            )
            first_reads.append(self._model_prober.probe(self.backends.live_urls()))
        capacity: KvCapacityProbe | None = None
        if self.picker.ledgers is not None:
            capacity = self._capacity = KvCapacityProbe(
                self.backends,
                self.upstream,
                self.picker.set_capacity,
                metrics_path=self.settings.load_signal.path,
                bytes_per_token=self.bytes_per_token,
                configured_tokens=self.settings.routing.kv_capacity_tokens,
                interval_s=self.settings.health.interval_s,
                timeout_s=self.settings.health.timeout_s,
            )
            first_reads.append(capacity.probe_due())
        await asyncio.gather(*first_reads)
        if self._model_prober is not None:
            self._spawn(self._model_prober.run(asked=True), "models")
        if capacity is not None:
            self._spawn(capacity.run(), "kv_capacity")
        if self.token_ratios is not None:
            self._spawn(self.token_ratios.run(), "bytes_per_token")
        discovery = build_discovery(self.settings.discovery, self._static)
        if discovery is not None:
            self._spawn(discovery.run(self._discovered), "discovery")
        if self.shared is not None:
            self._spawn(self.shared.run(), "shared_state")
        if self.settings.load_signal.enabled:
            scraper = LoadSignalScraper(
                self.settings.load_signal, self.backends, self.upstream, self.placer.capacity_changed
            )
            self._spawn(scraper.run(), "load_signal")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.shared is not None:
            await self.shared.close()
        await self.upstream.close()

    def _spawn(self, coro: Any, name: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s failed", name)

        self._tasks.append(asyncio.get_running_loop().create_task(guarded(), name=f"prefix_router.{name}"))

    def snapshot(self) -> FleetSnapshot:
        load = self.backends.load
        ledgers = self.picker.ledgers
        return FleetSnapshot(
            [
                BackendStatus(
                    b.url,
                    load.inflight(b.url),
                    load.load(b.url),
                    b.state.value,
                    ledgers.capacity(b.url) if ledgers is not None else None,
                    self.bytes_per_token(b.url),
                )
                for b in self.backends.backends()
            ],
            self.backends.all_ejected_override,
        )

    def _discovered(self, specs: list[BackendSpec]) -> None:
        """Discovery's current list: what it declares each backend serves, then the members."""
        self.models.declare({spec.url: spec.models for spec in specs})
        self.backends.replace_members(specs)

    def bytes_per_token(self, url: str) -> float:
        """The backend's bytes of key material a token: configured, else learnt, else the default."""
        configured = self.settings.routing.bytes_per_token
        if configured is not None:
            return configured
        learnt = self.token_ratios.ratio(url) if self.token_ratios is not None else None
        return DEFAULT_BYTES_PER_TOKEN if learnt is None else learnt

    def _bytes_per_token_changed(self, url: str) -> None:
        if self._capacity is not None:
            self._capacity.bytes_per_token_changed(url)

    def _membership_changed(self) -> None:
        now = {b.url for b in self.backends.backends()}
        for gone in self._known - now:
            self.picker.forget(gone)
            self.metrics.forget_backend(gone)
            self.backends.load.clear_external(gone)
            self.upstream.forget(gone)
        for joined in now - self._known:
            self.metrics.backend(joined)
        if self._model_prober is not None and now - self._known:
            self._model_prober.joined()
        self._known = now


def create_app(settings: Settings, *, rng: random.Random | None = None) -> RouterApp:
    """A fresh router: every test and every process builds its own."""
    return RouterApp(settings, rng=rng)
