"""Response ids that carry the backend that stored them, so any replica can route a follow-up there.

vLLM keeps a stored response in the memory of the server that generated it (its response store), so
`previous_response_id`, `GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` only
work on that server. The router rewrites every response id the client sees from `resp_<rest>` to
`resp_pr1<tag><rest>`, where `<tag>` is 16 hex digits of THE hash of the backend's URL, and restores the
original on the way in. Every replica computes the same tag from its own member list, so no state is
shared, and the id names no URL. vLLM's ids are `resp_` + hex, and `p` is not a hex digit, so an id the
router made can never be mistaken for one a backend made. LiteLLM routes Responses follow-ups the same
way, with the deployment encoded in the id.

Only the Responses path pays for this: ids are found with one regular expression per JSON body or per
line of an event stream, keyed on the field names that hold response ids (`id`,
`previous_response_id`, `response_id`), so text that merely looks like an id is left alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prefix_router.routing.hashing import hash_bytes

RESPONSES_PATH = "/v1/responses"
_MARK = "resp_pr1"
_TAG_CHARS = 16
_HEX = frozenset("0123456789abcdef")
_SAFE = re.compile(r"[A-Za-z0-9_-]+")

# A response id as a JSON value of the fields that hold one, in a body or one SSE data line. Inside a
# JSON string quotes are escaped (\"), so model text that spells out such a field cannot match.
_OUT = re.compile(rb'("(?:id|previous_response_id|response_id)"[ \t]*:[ \t]*")resp_([A-Za-z0-9_-]+)"')
# An error body holds no model text: an id anywhere in it (vLLM: "Response with id 'resp_…' not found.").
_IN_ERROR = re.compile(rb"(?<![A-Za-z0-9_-])resp_([A-Za-z0-9_-]+)")


def backend_tag(url: str) -> str:
    """The stable, opaque id of a backend in response ids: the same on every replica."""
    return format(hash_bytes(url.encode("utf-8")), "016x")


def encode_id(original: str, tag: str) -> str:
    """`resp_<rest>` as the client sees it; an id that is not one of those is returned unchanged."""
    if not original.startswith("resp_") or decode_id(original) is not None:
        return original
    rest = original[5:]
    if not _SAFE.fullmatch(rest):
        return original
    return f"{_MARK}{tag}{rest}"


def decode_id(client_id: str) -> tuple[str, str] | None:
    """(backend tag, the backend's own id) of an id the router made; None for any other string."""
    if not client_id.startswith(_MARK):
        return None
    tag = client_id[len(_MARK) : len(_MARK) + _TAG_CHARS]
    rest = client_id[len(_MARK) + _TAG_CHARS :]
    if len(tag) != _TAG_CHARS or not _HEX.issuperset(tag) or not rest or not _SAFE.fullmatch(rest):
        return None
    return tag, "resp_" + rest


def rewrite_ids(data: bytes, tag: str) -> bytes:
    """Every response id of a JSON body (or of whole SSE lines) as the client must see it."""
    if b'"resp_' not in data:
        return data
    mark = (_MARK + tag).encode("ascii")

    def encoded(match: re.Match[bytes]) -> bytes:
        rest = match[2]
        if decode_id("resp_" + rest.decode("ascii")) is not None:
            return match[0]  # already the router's: a backend echoed what it was sent
        return match[1] + mark + rest + b'"'

    return _OUT.sub(encoded, data)


def rewrite_error_ids(data: bytes, tag: str) -> bytes:
    """An error body with every response id in it as the client knows it (its messages name them)."""
    if b"resp_" not in data:
        return data
    mark = (_MARK + tag).encode("ascii")

    def encoded(match: re.Match[bytes]) -> bytes:
        if decode_id("resp_" + match[1].decode("ascii")) is not None:
            return match[0]
        return mark + match[1]

    return _IN_ERROR.sub(encoded, data)


class StreamRewriter:
    """`rewrite_ids` over an event stream, line by line: a chunk's unfinished last line waits for the
    next chunk (SSE events end with a blank line, so a chunk from vLLM usually ends one)."""

    __slots__ = ("_carry", "_sink", "_tag")

    def __init__(self, tag: str, sink: Callable[[bytes], None]) -> None:
        self._tag = tag
        self._sink = sink
        self._carry = b""

    def write(self, chunk: bytes) -> None:
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(b"\n") + 1
        self._carry = data[end:]
        if end:
            self._sink(rewrite_ids(data[:end], self._tag))

    def flush(self) -> None:
        if self._carry:
            carry, self._carry = self._carry, b""
            self._sink(rewrite_ids(carry, self._tag))


class BackendTags:
    """Tag -> backend URL over the current members; rebuilt when the member set changes."""

    __slots__ = ("_by_tag", "_members", "_tag_of")

    def __init__(self, urls: Iterable[str] = ()) -> None:
        self._members: frozenset[str] = frozenset()
        self._by_tag: dict[str, str] = {}
        self._tag_of: dict[str, str] = {}
        self.update(urls)

    def update(self, urls: Iterable[str]) -> None:
        members = frozenset(urls)
        if members == self._members:
            return
        tag_of = {url: self._tag_of.get(url) or backend_tag(url) for url in members}
        self._members = members
        self._tag_of = tag_of
        self._by_tag = {tag: url for url, tag in tag_of.items()}

    def url_of(self, tag: str) -> str | None:
        return self._by_tag.get(tag)

    def tag_of(self, url: str) -> str:
        return self._tag_of.get(url) or backend_tag(url)


def response_id_in_path(path: str) -> tuple[str, str] | None:
    """(the id, what follows it) of `/v1/responses/{id}[/...]`; None for any other path."""
    if not path.startswith(RESPONSES_PATH + "/"):
        return None
    segment, slash, tail = path[len(RESPONSES_PATH) + 1 :].partition("/")
    if not segment:
        return None
    return segment, slash + tail
