"""The simulated server's Responses API (its response store, as vLLM's) and its adapters, through the
official OpenAI client and raw HTTP."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from openai.types.responses import ResponseCompletedEvent

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend

CONFIG = SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.01, itl_ms=0.1, adapters=("sql-lora",))


@pytest.fixture
def sim_config() -> SimConfig:
    return CONFIG


async def test_models_lists_the_base_model_then_its_adapters_with_parent(backend: SimBackend) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{backend.url}/v1/models") as resp:
        doc = await resp.json()
    assert doc["object"] == "list"
    assert [(m["id"], m["parent"]) for m in doc["data"]] == [("sim-llama", None), ("sql-lora", "sim-llama")]


async def test_an_adapter_is_served_and_named_in_the_answer(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="sql-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert completion.model == "sql-lora"


async def test_a_model_it_does_not_serve_gets_vllms_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model="other-llama", input="hi")
    assert caught.value.body == {
        "message": "The model `other-llama` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_a_follow_up_continues_the_stored_conversation(client: openai.AsyncOpenAI) -> None:
    story = "Tell me a long story about a lighthouse keeper and the sea. " * 4  # a few KV blocks
    first = await client.responses.create(model="sim-llama", input=story, max_output_tokens=4)
    assert first.id.startswith("resp_") and first.status == "completed"
    assert first.output_text == " lorem ipsum dolor sit"
    second = await client.responses.create(
        model="sim-llama", input="And then?", previous_response_id=first.id, max_output_tokens=3
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The follow-up's prompt holds the whole first turn, and finds it cached.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


async def test_retrieve_delete_and_cancel_find_what_was_stored(client: openai.AsyncOpenAI) -> None:
    made = await client.responses.create(model="sim-llama", input="hi", max_output_tokens=2)
    got = await client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        await client.responses.cancel(made.id)
    await client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)


async def test_an_unknown_id_gets_vllms_404_everywhere(backend: SimBackend) -> None:
    missing = "resp_0123456789abcdef0123456789abcdef"
    expected = {
        "error": {
            "message": f"Response with id '{missing}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    async with aiohttp.ClientSession() as http:
        for method, path, body in [
            ("POST", "/v1/responses", {"model": "sim-llama", "input": "x", "previous_response_id": missing}),
            ("GET", f"/v1/responses/{missing}", None),
            ("DELETE", f"/v1/responses/{missing}", None),
            ("POST", f"/v1/responses/{missing}/cancel", None),
        ]:
            async with http.request(method, f"{backend.url}{path}", json=body) as resp:
                assert (resp.status, await resp.json()) == (404, expected), (method, path)


async def test_a_streamed_response_is_stored_and_replayed(client: openai.AsyncOpenAI) -> None:
    events = [e async for e in await client.responses.create(model="sim-llama", input="hi", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    done = last.response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text
    replayed = [e async for e in await client.responses.retrieve(done.id, stream=True)]
    assert replayed[-1].type == "response.completed" and replayed[-1].response.id == done.id


async def test_store_false_keeps_nothing(client: openai.AsyncOpenAI, backend: SimBackend) -> None:
    made = await client.responses.create(model="sim-llama", input="hi", store=False, max_output_tokens=1)
    assert made.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)
    assert backend.server.stats()["stored_responses"] == 0


async def test_with_the_store_off_store_true_is_ignored_as_vllm_does() -> None:
    config = SimConfig(overhead_ms=0, prefill_ms_per_token=0, itl_ms=0, responses_store=False)
    async with SimBackend(config) as backend:
        sdk = openai.AsyncOpenAI(base_url=f"{backend.url}/v1", api_key="x", max_retries=0)
        made = await sdk.responses.create(model="sim-llama", input="hi", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(made.id)
        await sdk.close()
