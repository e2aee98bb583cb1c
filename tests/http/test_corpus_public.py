"""The public HTTP corpora through the router, one parametrised test per corpus.

- llhttp: the request and response messages of its test/request/*.md and test/response/*.md;
- http-garden: the payloads of its TROPHIES.md (the bugs it found) and README.md;
- smuggler: its Transfer-Encoding gadgets (configs/*.py), each in a CL.TE and a TE.CL probe;
- h11 and uvicorn: the HTTP byte strings of their test modules.

A request payload goes to the listener: it is forwarded (the backend receives exactly the recorded
methods, targets and bodies, and nothing else) or refused with the recorded status, then a close. A
response payload is a raw backend's answer to a plain GET: the client gets it well framed and whole,
or a 502. After every case the router still answers /healthz. The payloads and the expected outcomes
(nginx's, or the router's where a recorded reason says why RFC 9112/9110 allow the difference) are
built by tools/build_http_corpus.py; the checks are corpus_wire's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from corpus_wire import Outcome, check, load_corpus, outcomes_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

CORPORA = {name: load_corpus(name) for name in ("llhttp", "garden", "smuggler", "h11", "uvicorn")}


F = TypeVar("F", bound=Callable[..., Any])


def cases(*names: str) -> Callable[[F], F]:
    chosen = [{**c, "id": f"{name}/{c['id']}"} for name in names for c in CORPORA[name]]
    mark: Callable[[F], F] = pytest.mark.parametrize("case", chosen, ids=[c["id"] for c in chosen])
    return mark


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def outcomes() -> dict[str, Outcome]:
    """Every corpus's cases once, over a few routers at a time (one module's worth of routers)."""
    return await outcomes_of(*CORPORA)


@cases("llhttp")
async def test_llhttp_case(outcomes: dict[str, Outcome], case: dict[str, Any]) -> None:
    check(case, outcomes[case["id"]])


@cases("garden")
async def test_http_garden_case(outcomes: dict[str, Outcome], case: dict[str, Any]) -> None:
    check(case, outcomes[case["id"]])


@cases("smuggler")
async def test_smuggler_case(outcomes: dict[str, Outcome], case: dict[str, Any]) -> None:
    check(case, outcomes[case["id"]])


@cases("h11", "uvicorn")
async def test_h11_and_uvicorn_case(outcomes: dict[str, Outcome], case: dict[str, Any]) -> None:
    check(case, outcomes[case["id"]])
