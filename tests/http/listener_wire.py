"""One raw exchange with the router's listener: bytes in (whole or in pieces), every answer out.

The answers are parsed by llhttp's response parser from everything the router sent until it closed the
connection (the tests run it with short idle timeouts, so every connection ends).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httptools


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""

    @property
    def from_backend(self) -> bool:
        return "x-fake-backend" in self.headers

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Outcome:
    answers: list[Answer] = field(default_factory=list)
    closed: bool = False  # the router closed (EOF or reset) before the read deadline
    raw: bytes = b""
    malformed: bool = False  # the bytes the router sent are not a sequence of HTTP/1.1 responses

    @property
    def statuses(self) -> list[int]:
        return [a.status for a in self.answers]


class _Collector:
    def __init__(self, out: Outcome) -> None:
        self.out = out
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.out.answers.append(Answer(self.parser.get_status_code(), self.headers, bytes(self.body)))
        self.headers, self.body = {}, bytearray()


def parse_answers(raw: bytes, out: Outcome) -> None:
    collector = _Collector(out)
    parser = httptools.HttpResponseParser(collector)
    collector.parser = parser
    try:
        parser.feed_data(raw)
    except httptools.HttpParserUpgrade:
        pass  # a 101 (relayed from a backend): what follows is not HTTP/1.1
    except httptools.HttpParserError:
        out.malformed = True


async def exchange(
    port: int, pieces: list[bytes], *, gap_s: float = 0.0, read_timeout_s: float = 10.0
) -> Outcome:
    """Send `pieces` in order (each its own write, `gap_s` apart), then read until the router closes."""
    out = Outcome()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = bytearray()
    try:
        try:
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                if gap_s:
                    await asyncio.sleep(gap_s)
        except ConnectionError:
            pass  # the router refused and closed early: what it answered is still to be read
        async with asyncio.timeout(read_timeout_s):
            while chunk := await reader.read(65536):
                raw += chunk
        out.closed = True
    except TimeoutError:
        pass
    except ConnectionError:
        out.closed = True
    finally:
        writer.close()
    out.raw = bytes(raw)
    parse_answers(out.raw, out)
    return out
