"""What each backend serves and where a request for a model may go: listings, routes, per-model rings."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.errors import ModelNotFound
from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy
from prefix_router.fleet.models import AdapterPolicy, ModelCard, ModelDirectory, parse_model_list

A, B, C, D = (f"http://10.0.0.{i}:8000" for i in range(1, 5))
LLAMA, OTHER, LORA = "sim-llama", "other-llama", "sql-lora"


def listing(*entries: tuple[str, str | None]) -> bytes:
    return orjson.dumps(
        {"object": "list", "data": [{"id": m, "object": "model", "parent": p} for m, p in entries]}
    )


@pytest.mark.parametrize(
    ("body", "ids"),
    [
        pytest.param(listing((LLAMA, None)), [(LLAMA, None)], id="one-model"),
        pytest.param(listing((LLAMA, None), (LORA, LLAMA)), [(LLAMA, None), (LORA, LLAMA)], id="adapter"),
        pytest.param(listing(), [], id="empty"),
        pytest.param(listing((LLAMA, None), (LLAMA, None)), [(LLAMA, None)], id="duplicate"),
        pytest.param(
            b'{"object":"list","data":[{"id":3},"x",{"id":""},{"id":"m"}]}', [("m", None)], id="junk"
        ),
        pytest.param(b'{"object":"list","data":[{"id":"a","parent":""}]}', [("a", None)], id="empty-parent"),
        pytest.param(b'{"backend":"b0","path":"/v1/models"}', None, id="not-a-list"),
        pytest.param(b"<html>", None, id="not-json"),
        pytest.param(b"[]", None, id="array"),
    ],
)
def test_parse_model_list(body: bytes, ids: list[tuple[str, str | None]] | None) -> None:
    cards = parse_model_list(body)
    assert (None if cards is None else [(c.id, c.parent) for c in cards]) == ids


def fleet(*urls: str) -> BackendSet:
    return BackendSet([BackendSpec(u) for u in urls], vnodes=64, health=HealthPolicy(slow_start_s=0))


def cards(*entries: tuple[str, str | None]) -> tuple[ModelCard, ...]:
    parsed = parse_model_list(listing(*entries))
    assert parsed is not None
    return parsed


def two_models(adapters: AdapterPolicy | None = None) -> tuple[BackendSet, ModelDirectory]:
    backends = fleet(A, B, C)
    directory = ModelDirectory(backends, 64, adapters)
    directory.report(A, cards((LLAMA, None)))
    directory.report(B, cards((LLAMA, None), (LORA, LLAMA)))
    directory.report(C, cards((OTHER, None)))
    return backends, directory


def servers(directory: ModelDirectory, model: str | None) -> tuple[str, ...] | None:
    route = directory.route(model)
    return None if route is None else route.candidates.ids


def test_a_fleet_that_said_nothing_routes_over_everyone() -> None:
    directory = ModelDirectory(fleet(A, B), 64)
    assert servers(directory, LLAMA) is None
    assert directory.listing_body() is None, "the router's /v1/models is proxied as before"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param(LLAMA, (A, B), id="base-model"),
        pytest.param(OTHER, (C,), id="other-model"),
        pytest.param(LORA, (B,), id="adapter-where-loaded"),
        pytest.param(None, None, id="no-model-whole-fleet"),
    ],
)
def test_each_model_goes_to_its_servers_only(model: str | None, expected: tuple[str, ...] | None) -> None:
    _, directory = two_models()
    assert servers(directory, model) == expected


def test_a_model_nobody_serves_is_not_found() -> None:
    _, directory = two_models()
    with pytest.raises(ModelNotFound, match="does not exist"):
        directory.route("gpt-4o")


def test_an_unloaded_adapter_is_not_found_unless_sent_to_its_base() -> None:
    _, directory = two_models(AdapterPolicy(bases={"new-lora": LLAMA}))
    with pytest.raises(ModelNotFound, match="no backend has loaded"):
        directory.route("new-lora")
    _, directory = two_models(AdapterPolicy(to_base=True, bases={"new-lora": LLAMA}))
    assert servers(directory, "new-lora") == (A, B)
    # Two base models and no declared base: the router cannot guess which one.
    with pytest.raises(ModelNotFound):
        directory.route("unknown-lora")


def test_with_one_base_model_an_unlisted_adapter_goes_to_it_when_allowed() -> None:
    backends = fleet(A, B)
    directory = ModelDirectory(backends, 64, AdapterPolicy(to_base=True))
    directory.report(A, cards((LLAMA, None)))
    directory.report(B, cards((LLAMA, None), (LORA, LLAMA)))
    assert servers(directory, "some-lora") == (A, B)


def eject(backends: BackendSet, url: str) -> None:
    for _ in range(3):
        backends.record_failure(url, probe=False)


def test_an_adapter_whose_backends_are_out_goes_to_its_base_only_when_allowed() -> None:
    backends, directory = two_models()
    eject(backends, B)  # the only one with the adapter loaded
    assert servers(directory, LORA) == ()  # 503 from the picker, not someone else's 404
    backends, directory = two_models(AdapterPolicy(to_base=True))
    eject(backends, B)
    assert servers(directory, LORA) == (A,)


def test_declared_models_stand_in_until_the_backend_reports() -> None:
    backends = fleet(A, B)
    directory = ModelDirectory(backends, 64)
    directory.declare({A: [LLAMA], B: [OTHER]})
    assert servers(directory, LLAMA) == (A,)
    directory.report(A, cards((OTHER, None)))  # what it really serves wins
    assert servers(directory, OTHER) == (A, B)
    with pytest.raises(ModelNotFound):
        directory.route(LLAMA)


def test_a_backend_that_said_nothing_may_serve_a_model_no_one_listed() -> None:
    backends = fleet(A, B)
    directory = ModelDirectory(backends, 64)
    directory.report(A, cards((LLAMA, None)))
    assert servers(directory, LLAMA) == (A,), "a listed model goes to its servers only"
    assert servers(directory, OTHER) == (B,), "an unlisted one to those that have not said"


def test_listing_is_the_deduplicated_union_over_backends_in_service() -> None:
    backends, directory = two_models()
    body = directory.listing_body()
    assert body is not None
    doc = orjson.loads(body)
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == [LLAMA, LORA, OTHER]
    assert next(m for m in doc["data"] if m["id"] == LORA)["parent"] == LLAMA
    backends.drain(C)
    assert [m["id"] for m in orjson.loads(directory.listing_body() or b"")["data"]] == [LLAMA, LORA]


def test_a_backend_that_leaves_takes_its_listing_with_it() -> None:
    backends, directory = two_models()
    backends.replace_members([BackendSpec(A), BackendSpec(B)])  # C drains, then leaves (nothing in flight)
    assert not directory.has_report(C)
    with pytest.raises(ModelNotFound):
        directory.route(OTHER)


def test_rings_are_values_rebuilt_only_when_their_members_change() -> None:
    backends, directory = two_models()
    llama_ring = directory.view.routes[LLAMA].ring
    directory.report(C, cards((OTHER, None), ("third", None)))
    assert directory.view.routes[LLAMA].ring is llama_ring, "another model's change moves nothing here"
    backends.record_failure(A, probe=False)  # health changes candidates, never rings
    assert directory.view.routes[LLAMA].ring is llama_ring


KEYS = st.lists(st.integers(0, 2**64 - 1), min_size=50, max_size=200, unique=True)


@settings(max_examples=30, deadline=None)
@given(keys=KEYS)
def test_a_models_keys_stay_put_when_another_models_backends_change(keys: list[int]) -> None:
    backends = fleet(A, B, C, D)
    directory = ModelDirectory(backends, 64)
    for url in (A, B):
        directory.report(url, cards((LLAMA, None)))
    directory.report(C, cards((OTHER, None)))
    before = [directory.view.routes[LLAMA].ring.primary(k) for k in keys]
    directory.report(D, cards((OTHER, None)))  # the other model gains a backend
    backends.replace_members([BackendSpec(u) for u in (A, B, D)])  # and loses one
    assert [directory.view.routes[LLAMA].ring.primary(k) for k in keys] == before
    assert set(before) <= {A, B}
