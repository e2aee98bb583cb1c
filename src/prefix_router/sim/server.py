"""The HTTP face of one simulated vLLM server (aiohttp.web): OpenAI routes, health, metrics, admin.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /tokenize, GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/models, GET /health, GET /metrics,
GET /sim/stats, POST /sim/reset. Run it with `handler_cancellation=True` (as
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
    filler_token,
    parse_generation_request,
    parse_tokenize_request,
)
from prefix_router.sim.responses import (
    ResponseBuilder,
    ResponseStore,
    StoredResponse,
    output_text,
    parse_responses_request,
    replay_events,
)
from prefix_router.sim.scheduler import Scheduler
from prefix_router.sim.tokens import ChatMessage

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
        self.responses = ResponseStore(config.responses_store_max)
        self._started_at = int(time.time())

    def create_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.handle_chat_completions)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/v1/responses", self.handle_responses)
        app.router.add_get("/v1/responses/{response_id}", self.handle_get_response)
        app.router.add_delete("/v1/responses/{response_id}", self.handle_delete_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.handle_cancel_response)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_post("/tokenize", self.handle_tokenize)
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
            "stored_responses": len(self.responses),
        }

    async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def handle_models(self, request: web.Request) -> web.Response:
        model = self.config.model
        base = {"object": "model", "created": self._started_at, "owned_by": "vllm"}
        # vLLM lists each loaded LoRA adapter after the base model, with `parent` naming it.
        data = [{"id": model, **base, "root": model, "parent": None}]
        for name in self.config.adapters:
            data.append({"id": name, **base, "root": f"/adapters/{name}", "parent": model})
        return _json_response({"object": "list", "data": data})

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        # vLLM's /tokenize: a chat body (its template applied, as for generation) or a prompt.
        try:
            prompt = parse_tokenize_request(await request.read(), self.config)
        except RequestRejected as exc:
            return _rejected(exc)
        tokens = [int.from_bytes(prompt.token(i), "little") for i in range(prompt.num_tokens)]
        # The longest prompt the sim admits is its whole cache.
        max_model_len = self.config.capacity_blocks * self.config.block_size
        return _json_response(
            {"count": prompt.num_tokens, "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_stats(self, request: web.Request) -> web.Response:
        return _json_response(self.stats())

    async def handle_reset(self, request: web.Request) -> web.Response:
        self.scheduler.reset()
        return _json_response(self.stats())

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        try:
            parsed = parse_responses_request(await request.read(), self.config, self.responses)
            scheduled = self.scheduler.schedule(parsed.prompt, cache_salt=parsed.cache_salt)
        except RequestRejected as exc:
            return _rejected(exc)
        except ValueError as exc:
            body = encode_error(str(exc), error_type="BadRequestError", status=400, param="input")
            return web.Response(status=400, body=body, content_type="application/json")
        builder = ResponseBuilder(parsed)
        response: web.StreamResponse | None = None
        if parsed.is_stream:
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
        async with scheduled as running:
            await running.prefill()
            if response is not None:
                await response.write(builder.opening_events() + builder.delta_event(filler_token(0)))
            for index in range(1, parsed.max_tokens):
                await running.decode_token()
                if response is not None:
                    await response.write(builder.delta_event(filler_token(index)))
            running.finish()
            final = builder.response(
                "completed", output_text(running.num_generated), running.cached_tokens, running.num_generated
            )
        if parsed.store:
            reply = ChatMessage("assistant", final["output"][0]["content"][0]["text"])
            self.responses.put(builder.id, StoredResponse(final, (*parsed.conversation, reply)))
        if response is None:
            return _json_response(final)
        await response.write(builder.closing_events(final))
        await response.write_eof()
        return response

    async def handle_get_response(self, request: web.Request) -> web.StreamResponse:
        try:
            stored = self.responses.get(request.match_info["response_id"])
            after = request.query.get("starting_after")
            starting_after = int(after) if after is not None else None
        except RequestRejected as exc:
            return _rejected(exc)
        except ValueError:
            return _rejected(RequestRejected("`starting_after` must be an integer", param="starting_after"))
        if request.query.get("stream", "false").lower() not in ("true", "1"):
            return _json_response(stored.body)
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        for event in replay_events(stored.body, starting_after):
            await response.write(event)
        await response.write_eof()
        return response

    async def handle_delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        try:
            self.responses.delete(response_id)
        except RequestRejected as exc:
            return _rejected(exc)
        return _json_response({"id": response_id, "object": "response", "deleted": True})

    async def handle_cancel_response(self, request: web.Request) -> web.Response:
        try:
            self.responses.get(request.match_info["response_id"])
        except RequestRejected as exc:
            return _rejected(exc)
        # The sim has no background mode, and vLLM cancels only background responses.
        return _rejected(RequestRejected("Cannot cancel a synchronous response.", param="response_id"))

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            generation = parse_generation_request(endpoint, await request.read(), self.config)
            scheduled = self.scheduler.schedule(generation.prompt, cache_salt=generation.cache_salt)
        except RequestRejected as exc:
            return web.Response(status=exc.status, body=exc.to_body(), content_type="application/json")
        except ValueError as exc:  # the prompt can never fit the KV cache: vLLM's too-long answer
            body = encode_error(str(exc), error_type="BadRequestError", status=400, param="prompt")
            return web.Response(status=400, body=body, content_type="application/json")
        writer = ResponseWriter(generation, generation.model or self.config.model)
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


def _rejected(exc: RequestRejected) -> web.Response:
    return web.Response(status=exc.status, body=exc.to_body(), content_type="application/json")


def _json_response(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
