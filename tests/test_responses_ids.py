"""Response ids that carry their backend: encoding, the rewrite of bodies and streams, the tag table."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.routing.response_ids import (
    BackendTags,
    StreamRewriter,
    backend_tag,
    decode_id,
    encode_id,
    response_id_in_path,
    rewrite_error_ids,
    rewrite_ids,
)

A = "http://10.0.0.1:8000"
B = "http://10.0.0.2:8000"
TAG = backend_tag(A)
VLLM_ID = "resp_0123456789abcdef0123456789abcdef"


def test_the_tag_is_fixed_opaque_and_per_backend() -> None:
    # THE hash of the URL: every replica computes the same tag, and it names no address.
    assert backend_tag(A) == backend_tag(A)
    assert backend_tag(A) != backend_tag(B)
    assert len(TAG) == 16 and set(TAG) <= set("0123456789abcdef")
    assert "10.0.0.1" not in encode_id(VLLM_ID, TAG)


@pytest.mark.parametrize(
    ("original", "encoded"),
    [
        pytest.param(VLLM_ID, f"resp_pr1{TAG}0123456789abcdef0123456789abcdef", id="vllm"),
        pytest.param("resp_a-b_C", f"resp_pr1{TAG}a-b_C", id="url-safe-rest"),
        pytest.param("chatcmpl-1", "chatcmpl-1", id="not-a-response-id"),
        pytest.param("resp_", "resp_", id="empty-rest"),
        pytest.param("resp_a/b", "resp_a/b", id="not-url-safe"),
        pytest.param(f"resp_pr1{TAG}abc", f"resp_pr1{TAG}abc", id="already-encoded"),
    ],
)
def test_encode(original: str, encoded: str) -> None:
    assert encode_id(original, TAG) == encoded


@pytest.mark.parametrize(
    ("client_id", "decoded"),
    [
        pytest.param(f"resp_pr1{TAG}abc", (TAG, "resp_abc"), id="ours"),
        pytest.param(VLLM_ID, None, id="a-backends-own"),
        pytest.param(f"resp_pr1{TAG}", None, id="no-rest"),
        pytest.param(f"resp_pr1{TAG[:15]}", None, id="short-tag"),
        pytest.param(f"resp_pr1{TAG.upper()}abc", None, id="upper-hex-tag"),
        pytest.param(f"resp_pr1{TAG}a%2Fb", None, id="unsafe-rest"),
        pytest.param("", None, id="empty"),
    ],
)
def test_decode(client_id: str, decoded: tuple[str, str] | None) -> None:
    assert decode_id(client_id) == decoded


_REST = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1)
_TAGS = st.integers(0, 2**64 - 1).map(lambda n: format(n, "016x"))


@given(rest=_REST, tag=_TAGS)
def test_round_trip(rest: str, tag: str) -> None:
    original = "resp_" + rest
    encoded = encode_id(original, tag)
    if decode_id(original) is not None:  # an id that already looks like the router's is left alone
        assert encoded == original
        return
    assert decode_id(encoded) == (tag, original)


@given(rest=st.text(alphabet="0123456789abcdef", min_size=1))
def test_no_hex_backend_id_is_mistaken_for_the_routers(rest: str) -> None:
    assert decode_id("resp_" + rest) is None


def _body(**fields: object) -> bytes:
    return orjson.dumps(fields)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            _body(id=VLLM_ID, object="response"),
            _body(id=encode_id(VLLM_ID, TAG), object="response"),
            id="top-level-id",
        ),
        pytest.param(
            _body(id="resp_x", previous_response_id="resp_y"),
            _body(id=encode_id("resp_x", TAG), previous_response_id=encode_id("resp_y", TAG)),
            id="previous-id",
        ),
        pytest.param(
            _body(type="response.created", response={"id": "resp_x"}),
            _body(type="response.created", response={"id": encode_id("resp_x", TAG)}),
            id="nested-response",
        ),
        pytest.param(
            b'{"id" : "resp_x"}', b'{"id" : "' + encode_id("resp_x", TAG).encode() + b'"}', id="spaces"
        ),
        pytest.param(
            _body(id="msg_1", item_id="resp_x"), _body(id="msg_1", item_id="resp_x"), id="other-fields"
        ),
        pytest.param(_body(text='{"id":"resp_x"}'), _body(text='{"id":"resp_x"}'), id="model-text-escaped"),
        pytest.param(_body(text="resp_x"), _body(text="resp_x"), id="model-text-bare"),
        pytest.param(
            _body(id=encode_id("resp_x", TAG)), _body(id=encode_id("resp_x", TAG)), id="already-encoded"
        ),
        pytest.param(b"not json at all", b"not json at all", id="not-json"),
    ],
)
def test_rewrite_ids(body: bytes, expected: bytes) -> None:
    assert rewrite_ids(body, TAG) == expected


def _stream(n: int) -> bytes:
    events = []
    for i in range(n):
        payload = orjson.dumps({"type": "response.created", "response": {"id": f"resp_{i:032x}"}})
        events.append(b"event: response.created\ndata: " + payload + b"\n\n")
    return b"".join(events)


@given(data=st.data(), n=st.integers(1, 4))
def test_a_stream_cut_anywhere_is_rewritten_as_if_whole(data: st.DataObject, n: int) -> None:
    whole = _stream(n)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=6)))
    out: list[bytes] = []
    rewriter = StreamRewriter(TAG, out.append)
    start = 0
    for cut in [*cuts, len(whole)]:
        rewriter.write(whole[start:cut])
        start = cut
    rewriter.flush()
    assert b"".join(out) == rewrite_ids(whole, TAG)
    assert b"".join(out).count(b"resp_pr1") == n


def test_an_unfinished_line_waits_for_the_rest() -> None:
    out: list[bytes] = []
    rewriter = StreamRewriter(TAG, out.append)
    rewriter.write(b'data: {"id":"resp_')
    assert out == []
    rewriter.write(b'abc"}\n\n')
    assert out == [b'data: {"id":"' + encode_id("resp_abc", TAG).encode() + b'"}\n\n']


def test_backend_tags_follow_the_member_set() -> None:
    tags = BackendTags([A])
    assert tags.url_of(backend_tag(A)) == A
    assert tags.url_of(backend_tag(B)) is None
    tags.update([A, B])
    assert tags.url_of(backend_tag(B)) == B
    tags.update([B])
    assert tags.url_of(backend_tag(A)) is None, "a backend that left resolves to nothing"
    assert tags.tag_of(B) == backend_tag(B)


@pytest.mark.parametrize(
    ("path", "found"),
    [
        pytest.param("/v1/responses/resp_1", ("resp_1", ""), id="retrieve"),
        pytest.param("/v1/responses/resp_1/cancel", ("resp_1", "/cancel"), id="cancel"),
        pytest.param("/v1/responses/resp_1/input_items", ("resp_1", "/input_items"), id="input-items"),
        pytest.param("/v1/responses", None, id="create"),
        pytest.param("/v1/responses/", None, id="no-id"),
        pytest.param("/v1/chat/completions", None, id="other-path"),
    ],
)
def test_response_id_in_path(path: str, found: tuple[str, str] | None) -> None:
    assert response_id_in_path(path) == found


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            b'{"error":{"message":"Response with id \'resp_ab\' not found.","param":"response_id"}}',
            b'{"error":{"message":"Response with id \''
            + encode_id("resp_ab", TAG).encode()
            + b'\' not found.","param":"response_id"}}',
            id="vllm-404",
        ),
        pytest.param(b'{"m":"xresp_ab"}', b'{"m":"xresp_ab"}', id="inside-a-word"),
        pytest.param(
            f'{{"m":"{encode_id("resp_ab", TAG)}"}}'.encode(),
            f'{{"m":"{encode_id("resp_ab", TAG)}"}}'.encode(),
            id="already-encoded",
        ),
    ],
)
def test_rewrite_error_ids(body: bytes, expected: bytes) -> None:
    assert rewrite_error_ids(body, TAG) == expected
