"""Canonical JSON: one document, one byte string, whatever the serialisation; errors are always ours."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.canonical import (
    PROMPT_FIELDS,
    NotCanonicalisable,
    canonical_bytes,
    canonical_prompt,
    canonicalise,
)

TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON_DOCS = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=20,
)
SERIALISATIONS = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 1, 4, "\t"]),
        "separators": st.sampled_from([None, (",", ":"), (", ", ": "), (" ,", " : ")]),
        "sort_keys": st.booleans(),
        "ensure_ascii": st.booleans(),
    }
)


def _reference(doc: Any) -> bytes:
    return canonicalise(orjson.dumps(doc))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(b'{"a":1,"b":2}', b'{"b":2,"a":1}', id="key-order"),
        pytest.param(
            b'{"a":{"y":1,"x":[1,{"q":0,"p":1}]}}', b'{"a":{"x":[1,{"p":1,"q":0}],"y":1}}', id="nested"
        ),
        pytest.param(b'{"a":1,"b":[1,2]}', b' {\n  "a" : 1 ,\r\n\t"b":[ 1 , 2 ] }\n', id="whitespace"),
        pytest.param(b'{"s":"\\u00e9"}', '{"s":"é"}'.encode(), id="unicode-escape"),
        pytest.param(b'{"s":"\\/"}', b'{"s":"/"}', id="solidus-escape"),
        pytest.param(b'{"\\u0061":1}', b'{"a":1}', id="escaped-key"),
        pytest.param(b'{"s":"\\ud83d\\ude00"}', '{"s":"😀"}'.encode(), id="surrogate-pair"),
        pytest.param(b'{"a":1,"a":2}', b'{"a":2}', id="duplicate-key-last-wins"),
    ],
)
def test_canonical_invariance(a: bytes, b: bytes) -> None:
    assert canonicalise(a) == canonicalise(b)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(b'{"b":2,"a":1}', b'{"a":1,"b":2}', id="sorted-compact"),
        pytest.param(b'{"s":"\\u00e9"}', '{"s":"é"}'.encode(), id="utf8-not-escaped"),
        pytest.param(
            b'{"temperature":0.5,"prompt":"hi","model":"m"}',
            b'{"prompt":"hi","model":"m","temperature":0.5}',
            id="prompt-first",
        ),
        pytest.param(
            b'{"z":0,"input":"i","messages":[],"text":"t","prompt":"p","inputs":"x"}',
            b'{"inputs":"x","prompt":"p","text":"t","messages":[],"input":"i","z":0}',
            id="prompt-fields-in-fixed-order",
        ),
        pytest.param(b'{"prompt":{"b":1,"a":2}}', b'{"prompt":{"a":2,"b":1}}', id="prompt-value-sorted"),
        pytest.param(b"[3,1,2]", b"[3,1,2]", id="array-untouched"),
        pytest.param(b'"x"', b'"x"', id="scalar"),
    ],
)
def test_canonical_exact_bytes(body: bytes, expected: bytes) -> None:
    assert canonicalise(body) == expected


@settings(max_examples=120)
@given(JSON_DOCS, SERIALISATIONS)
def test_canonical_invariant_under_serialisation(doc: Any, how: dict[str, Any]) -> None:
    body = json.dumps(doc, **how).encode()
    canon = canonicalise(body)
    assert canon == _reference(doc)
    assert orjson.loads(canon) == doc
    assert canonicalise(canon) == canon  # idempotent


@settings(max_examples=50)
@given(st.dictionaries(TEXT, JSON_DOCS, max_size=5), st.data())
def test_canonical_key_order_never_matters(doc: dict[str, Any], data: st.DataObject) -> None:
    items = data.draw(st.permutations(list(doc.items())))
    assert canonicalise(json.dumps(dict(items)).encode()) == canonicalise(json.dumps(doc).encode())


@settings(max_examples=60)
@given(
    st.dictionaries(st.sampled_from(PROMPT_FIELDS), JSON_DOCS, min_size=1),
    st.dictionaries(TEXT.filter(lambda k: k not in PROMPT_FIELDS), JSON_DOCS, max_size=3),
    st.floats(0, 2),
    st.floats(0, 2),
)
def test_temperature_never_shifts_the_prompt(
    prompt: dict[str, Any], rest: dict[str, Any], t1: float, t2: float
) -> None:
    head = canonical_prompt(prompt)
    assert head is not None
    prompt_len = len(head) - 1  # without the closing brace
    a = canonicalise(json.dumps({**rest, "temperature": t1, **prompt}).encode())
    b = canonicalise(json.dumps({"temperature": t2, **prompt, **rest}).encode())
    for n in (1, prompt_len // 2, prompt_len):
        assert a[:n] == b[:n]
    assert a[:prompt_len] == head[:prompt_len]


def test_canonical_prompt_only_prompt_fields() -> None:
    assert (
        canonical_prompt({"temperature": 1, "prompt": "p", "inputs": "i"}) == b'{"inputs":"i","prompt":"p"}'
    )
    assert canonical_prompt({"temperature": 1}) is None
    assert canonical_prompt(["prompt"]) is None


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not json", id="not-json"),
        pytest.param(b'{"a":1', id="truncated"),
        pytest.param(b'{"a":1} trailing', id="trailing-garbage"),
        pytest.param(b'{"s":"\\ud800"}', id="lone-high-surrogate"),
        pytest.param(b'{"s":"\\udc00"}', id="lone-low-surrogate"),
        pytest.param(b'{"s":"\xff\xfe"}', id="invalid-utf8"),
        pytest.param(DEEP, id="100k-deep"),
        pytest.param(b"[" * 300 + b"]" * 300, id="300-deep-parses-but-cannot-encode"),
        pytest.param(b'{"a":NaN}', id="nan"),
        pytest.param(b"1e400", id="float-overflow"),
    ],
)
def test_not_canonicalisable(body: bytes) -> None:
    with pytest.raises(NotCanonicalisable):
        canonicalise(body)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"123456789012345678901234567890", id="huge-positive"),
        pytest.param(b'{"a":-9223372036854775809}', id="below-int64"),
    ],
)
def test_big_ints_not_canonicalisable(body: bytes) -> None:
    # Parsed exactly (msgspec), then refused by the encoder: the request routes by its raw bytes
    # instead of sharing a key with every document that rounds to the same float.
    with pytest.raises(NotCanonicalisable):
        canonicalise(body)


def _nested(depth: int) -> Any:
    doc: Any = []
    for _ in range(depth):
        doc = [doc]
    return doc


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param({"a": "\ud800"}, id="lone-surrogate-str"),
        pytest.param({"prompt": "\udfff"}, id="lone-surrogate-prompt"),
        pytest.param({1: 2}, id="non-str-key"),
        pytest.param({"a": {1, 2}}, id="set"),
        pytest.param({"a": object()}, id="object"),
        pytest.param(_nested(100_000), id="100k-deep-python"),
        pytest.param({"prompt": _nested(1000)}, id="deep-prompt"),
        pytest.param({"a": 2**70}, id="big-int-value"),
    ],
)
def test_canonical_bytes_raises_only_not_canonicalisable(doc: Any) -> None:
    with pytest.raises(NotCanonicalisable):
        canonical_bytes(doc)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_canonicalise_never_raises_another_exception(body: bytes) -> None:
    try:
        out = canonicalise(body)
    except NotCanonicalisable:
        return
    assert canonicalise(out) == out
