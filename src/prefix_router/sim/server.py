"""The HTTP face of one simulated vLLM server (aiohttp.web): OpenAI routes, health, metrics, admin.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, GET /sim/stats, POST /sim/reset. Run it with `handler_cancellation=True` (as
`SimBackend` does) so a client disconnect cancels the handler and frees the request's slot.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from prefix_router.sim.cache import PrefixCache
from prefix_router.sim.config import SimConfig
from prefix_router.sim.metrics import SimMetrics
from prefix_router.sim.protocol import (
    Endpoint,
    RequestRejected,
    ResponseWriter,
    encode_error,
    parse_generation_request,
)
from prefix_router.sim.scheduler import Scheduler

# Long prompts are the point of prefix caching; aiohttp's 1 MiB default would cut them off.
MAX_BODY_BYTES = 64 * 1024 * 1024
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class SimServer:
    """One backend's state (cache, scheduler, metrics) and the handlers that serve it."""

    def __init__(self, config: SimConfig) -> None:
        config.validate()
        self.config = config
        self.cache = PrefixCache(block_size=config.block_size, capacity_blocks=config.capacity_blocks)
        self.scheduler = Scheduler(config, self.cache)
        self.metrics = SimMetrics(config.model, self.scheduler)
        self._started_at = int(time.time())

    def create_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.handle_chat_completions)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/sim/stats", self.handle_stats)
        app.router.add_post("/sim/reset", self.handle_reset)
        return app

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        counters = scheduler.counters
        return {
            "model": self.config.model,
            "requests": counters.requests_arrived,
            "requests_finished": counters.requests_finished,
            "requests_aborted": counters.requests_aborted,
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "peak_running": counters.peak_running,
            "peak_waiting": counters.peak_waiting,
            "peak_inflight": counters.peak_inflight,
            "prefix_cache_queries": counters.prefix_cache_queries_tokens,
            "prefix_cache_hits": counters.prefix_cache_hits_tokens,
            "prompt_tokens": counters.prompt_tokens,
            "generation_tokens": counters.generation_tokens,
            "kv_cache_usage": scheduler.kv_cache_usage,
            "cached_blocks": self.cache.num_cached_blocks,
        }

    async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def handle_models(self, request: web.Request) -> web.Response:
        model = self.config.model
        listing = {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": self._started_at,
                    "owned_by": "vllm",
                    "root": model,
                }
            ],
        }
        return _json_response(listing)

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_stats(self, request: web.Request) -> web.Response:
        return _json_response(self.stats())

    async def handle_reset(self, request: web.Request) -> web.Response:
        self.scheduler.reset()
        return _json_response(self.stats())

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            generation = parse_generation_request(endpoint, await request.read(), self.config)
            scheduled = self.scheduler.schedule(generation.prompt, cache_salt=generation.cache_salt)
        except RequestRejected as exc:
            return web.Response(status=exc.status, body=exc.to_body(), content_type="application/json")
        except ValueError as exc:  # the prompt can never fit the KV cache: vLLM's too-long answer
            body = encode_error(str(exc), error_type="BadRequestError", status=400, param="prompt")
            return web.Response(status=400, body=body, content_type="application/json")
        writer = ResponseWriter(generation, self.config.model)
        if generation.is_stream:
            # Headers go out at once, body bytes from the first token on, as vLLM's stream does.
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            async with scheduled as running:
                await running.prefill()
                first_chunk = writer.first_chunk()
                await response.write(first_chunk + writer.token_chunk(0))
                for index in range(1, generation.max_tokens):
                    await running.decode_token()
                    await response.write(writer.token_chunk(index))
                running.finish()
                await response.write(writer.last_chunks(running.cached_tokens, running.num_generated))
            await response.write_eof()
            return response
        async with scheduled as running:
            await running.prefill()
            for _ in range(1, generation.max_tokens):
                await running.decode_token()
            running.finish()
            body = writer.full_response(running.cached_tokens, running.num_generated)
        return web.Response(body=body, content_type="application/json")


def _json_response(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
