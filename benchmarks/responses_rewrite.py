"""Cost of carrying the backend in Responses API ids: what the Responses path pays, and the others don't.

On the way in, a request naming a router-made id has it restored (`Proxy._restore_response_ids`: find
the mark, parse the body, decode, replace, look the tag up; a retrieve rewrites its path instead). On
the way out, a JSON body is rewritten whole (`rewrite_ids`) and an event stream line by line
(`StreamRewriter`). Bodies are shaped like vLLM's: a response object of ~1.5 KB (and one with a 16 KB
answer), a stream of created / in_progress / N text deltas / done events / completed. Every other path
pays one `str.startswith` per request, timed too. Best of --repeats in µs per call, as timeit reports.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table, package_version, print_header, report_results
from prefix_router.router import create_app
from prefix_router.routing.response_ids import (
    RESPONSES_PATH,
    StreamRewriter,
    backend_tag,
    encode_id,
    rewrite_ids,
)
from prefix_router.settings import load_settings

BACKENDS = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]


class _Request:
    """The fields of an Exchange the restore reads."""

    def __init__(self, path: str, body: bytes) -> None:
        self.path = path
        self.raw_path = path.encode()
        self.query = b""
        self.target = self.raw_path
        self.body = body


def response_object(text_chars: int, previous: str | None) -> dict[str, Any]:
    text = ("lorem ipsum dolor sit amet " * (text_chars // 27 + 1))[:text_chars]
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": 1_700_000_000,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "status": "completed",
        "previous_response_id": previous,
        "output": [
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {"input_tokens": 812, "output_tokens": 64, "total_tokens": 876},
        "store": True,
    }


def event_stream(deltas: int) -> list[bytes]:
    """One chunk per event, as vLLM flushes them."""
    obj = response_object(deltas * 6, None)

    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    started = {**obj, "status": "in_progress", "output": []}
    where = {"item_id": obj["output"][0]["id"], "output_index": 0, "content_index": 0}
    chunks = [event("response.created", response=started), event("response.in_progress", response=started)]
    chunks += [event("response.output_text.delta", delta=" lorem", **where) for _ in range(deltas)]
    chunks += [event("response.output_text.done", text="lorem " * deltas, **where)]
    chunks += [event("response.completed", response=obj)]
    return chunks


def best_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    meta = print_header("Responses id rewrite", {"orjson": package_version("orjson")})

    settings = load_settings(None, {"backends": [{"url": u} for u in BACKENDS]}, environ=False)
    proxy = create_app(settings).proxy
    tag = backend_tag(BACKENDS[3])
    client_id = encode_id(f"resp_{uuid.uuid4().hex}", tag)
    follow_small = orjson.dumps(
        {"model": "m", "input": "and then what happened?", "previous_response_id": client_id}
    )
    follow_large = orjson.dumps(
        {"model": "m", "input": "word " * 6500, "previous_response_id": client_id}  # ~32 KB
    )
    fresh_large = orjson.dumps({"model": "m", "input": "word " * 6500})
    restore: Callable[[Any, bytes], object] = proxy._restore_response_ids
    small_json = orjson.dumps(response_object(300, None))
    large_json = orjson.dumps(response_object(16_000, client_id))
    stream = event_stream(256)

    def run_stream() -> None:
        out: list[bytes] = []
        rewriter = StreamRewriter(tag, out.append)
        for chunk in stream:
            rewriter.write(chunk)
        rewriter.flush()

    retrieve = _Request(f"{RESPONSES_PATH}/{client_id}", b"")
    create = _Request(RESPONSES_PATH, fresh_large)
    small = _Request(RESPONSES_PATH, follow_small)
    large = _Request(RESPONSES_PATH, follow_large)
    chat = _Request("/v1/chat/completions", b"")
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("other paths: the path check", lambda: chat.path.startswith(RESPONSES_PATH), 0),
        ("in: create, 32 KB, no router id", lambda: restore(create, create.body), 0),
        ("in: follow-up, small body", lambda: restore(small, small.body), 0),
        ("in: follow-up, 32 KB body", lambda: restore(large, large.body), 0),
        ("in: GET /v1/responses/{id}", lambda: restore(retrieve, b""), 0),
        (f"out: JSON response, {len(small_json)} B", lambda: rewrite_ids(small_json, tag), len(small_json)),
        (f"out: JSON response, {len(large_json)} B", lambda: rewrite_ids(large_json, tag), len(large_json)),
        (f"out: stream of {len(stream)} events, whole stream", run_stream, sum(map(len, stream))),
    ]
    rows = []
    results = []
    for name, fn, size in cases:
        us = best_us(fn, args.number, args.repeats)
        per_event = f"{us / len(stream):.2f}" if "stream" in name else "–"
        rows.append([name, f"{us:.2f}", per_event, size or "–"])
        results.append({"case": name, "us": us, "bytes": size})
    print(markdown_table(["case", "µs per call", "µs per event", "bytes"], rows))
    report_results("responses_rewrite", {**meta, "results": results}, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
