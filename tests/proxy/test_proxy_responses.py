"""What the router sends the backend that stored a response, and what it does when that one fails:
fake backends on loopback ports that echo what they receive or misbehave on purpose."""

from __future__ import annotations

from typing import Any

import orjson

from prefix_router.routing.response_ids import backend_tag, encode_id

from fakebackend import Reply
from routerkit import router_settings

ORIGINAL = "resp_0123456789abcdef0123456789abcdef"


async def test_the_backends_own_id_is_restored_in_the_path_and_the_query_kept(
    fake_backends: Any, router: Any, client: Any
) -> None:
    a, b = await fake_backends(2)
    r = await router(router_settings([a, b]))
    client_id = encode_id(ORIGINAL, backend_tag(a.url))
    for _ in range(4):
        resp = await client.get(f"{r.url}/v1/responses/{client_id}?stream=true&starting_after=3")
        assert resp.status_code == 200
    cancel = await client.post(f"{r.url}/v1/responses/{client_id}/cancel")
    assert cancel.status_code == 200
    assert [(s.method, s.path, s.query) for s in a.seen] == [
        *[("GET", f"/v1/responses/{ORIGINAL}", "stream=true&starting_after=3")] * 4,
        ("POST", f"/v1/responses/{ORIGINAL}/cancel", ""),
    ]
    assert b.seen == []


async def test_previous_response_id_is_restored_in_the_body(
    fake_backends: Any, router: Any, client: Any
) -> None:
    a, b = await fake_backends(2)
    r = await router(router_settings([a, b]))
    client_id = encode_id(ORIGINAL, backend_tag(b.url))
    body = {"model": "m", "input": "and then?", "previous_response_id": client_id}
    for i in range(4):
        resp = await client.post(f"{r.url}/v1/responses", json={**body, "input": f"turn {i}"})
        assert resp.status_code == 200
    assert a.seen == [] and len(b.seen) == 4
    assert all(orjson.loads(s.body)["previous_response_id"] == ORIGINAL for s in b.seen)


async def test_a_failing_storing_backend_is_not_replaced_by_one_that_cannot_answer(
    fake_backends: Any, router: Any, client: Any
) -> None:
    (busy,) = await fake_backends(1, script=Reply(503))
    others = await fake_backends(2)
    r = await router(router_settings([busy, *others]))
    client_id = encode_id(ORIGINAL, backend_tag(busy.url))
    resp = await client.get(f"{r.url}/v1/responses/{client_id}")
    assert resp.status_code == 503, "the storing backend's answer, not another backend's 404"
    follow = {"model": "m", "input": "x", "previous_response_id": client_id}
    assert (await client.post(f"{r.url}/v1/responses", json=follow)).status_code == 503
    assert len(busy.seen) == 2
    assert all(o.seen == [] for o in others), "no retry on a backend that never stored it"


async def test_an_unreachable_storing_backend_is_a_502_with_no_other_attempt(
    fake_backends: Any, router: Any, client: Any
) -> None:
    gone, other = await fake_backends(2)
    r = await router(router_settings([gone, other]))
    await gone.stop()
    resp = await client.get(f"{r.url}/v1/responses/{encode_id(ORIGINAL, backend_tag(gone.url))}")
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unavailable"
    assert other.seen == []


async def test_ids_the_router_did_not_make_pass_through_untouched(
    fake_backends: Any, router: Any, client: Any
) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    resp = await client.get(f"{r.url}/v1/responses/{ORIGINAL}")
    assert resp.status_code == 200
    assert [s.path for b in backends for s in b.seen] == [f"/v1/responses/{ORIGINAL}"]
