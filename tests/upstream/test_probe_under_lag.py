"""A health probe answered while the router's event loop was stalled counts as answered.

The probe's deadline is kept on the same loop as everything else. Under load the loop stalls for longer
than a probe's timeout; a healthy, prompt backend then answered (or accepted the connect) during the
stall, but the deadline, read late, failed the probe first, and enough such probes ejected the backend.
The backend here runs on a loop of its own thread, so it really answers during the stall; the stall is
made by blocking the router's loop, on the standard asyncio loop and on uvloop. A backend that never
answers must still be ejected after the same number of probes, each failing at its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from test_connect_under_lag import LOOPS, run_on

from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy, HealthState
from prefix_router.fleet.health import HealthProber
from prefix_router.settings import HealthSettings
from prefix_router.upstream.client import Upstream
from prefix_router.upstream.config import UpstreamConfig
from prefix_router.upstream.http1 import State

from rawbackend import RawBackend, RawConn, RawRequest, ok

PROBE_TIMEOUT_S = 0.2
THRESHOLD = 2
STALL_S = 5 * PROBE_TIMEOUT_S
ANSWER_AFTER_S = 0.02  # prompt, but slow enough for the test to see the request in flight
HEALTH_PATH = "/probe"
DEAD_TIMEOUT_S = 0.5  # long enough that a generous bound still tells one timeout from two


async def prompt_health(req: RawRequest, conn: RawConn) -> bool:
    await asyncio.sleep(ANSWER_AFTER_S)
    await conn.send(ok(b"", b"connection: close\r\n"))  # each probe a connect of its own
    return False


@contextlib.contextmanager
def backend_on_its_own_thread() -> Iterator[str]:
    """A prompt backend on a loop the router's stalls do not block."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backend = RawBackend(prompt_health)
    asyncio.run_coroutine_threadsafe(backend.start(), loop).result(10)
    try:
        yield backend.url
    finally:
        asyncio.run_coroutine_threadsafe(backend.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def backend_that_never_answers() -> Iterator[str]:
    """A listener that never accepts: the kernel completes connects, nothing ever answers."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        lsock.close()


def prober(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[HealthProber, BackendSet, Upstream]:
    backends = BackendSet([BackendSpec(url)], vnodes=8, health=HealthPolicy(unhealthy_threshold=THRESHOLD))
    upstream = Upstream(UpstreamConfig())
    settings = HealthSettings(path=HEALTH_PATH, timeout_s=timeout_s, unhealthy_threshold=THRESHOLD)
    return HealthProber(settings, backends, upstream), backends, upstream


async def probe_round(p: HealthProber, upstream: Upstream, url: str, stall_in: State | None) -> float:
    """One probe of every backend; the loop blocks for STALL_S once the probe reaches `stall_in` (its
    connect issued, or its request written). How long the round took."""
    started = time.monotonic()
    probing = asyncio.ensure_future(p.probe_all())
    if stall_in is not None:
        pool = upstream._pool(url)
        while not any(c.state is stall_in for c in pool.busy):  # one turn at a time
            assert not probing.done(), f"the probe never was {stall_in.value}"
            await asyncio.sleep(0)
        time.sleep(STALL_S)  # noqa: ASYNC251 - the stall under test
    await asyncio.wait_for(probing, 30)
    return time.monotonic() - started


@pytest.mark.parametrize("stall_in", [State.CONNECTING, State.AWAITING_HEAD], ids=["connect", "answer"])
@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_probes_of_a_prompt_backend_pass_through_loop_stalls(loop_name: str, stall_in: State) -> None:
    async def main() -> None:
        with backend_on_its_own_thread() as url:
            p, backends, upstream = prober(url)
            await upstream.start()
            try:
                for _ in range(THRESHOLD + 1):
                    await probe_round(p, upstream, url, stall_in)
                    backend = backends.get(url)
                    assert backend is not None and backend.failures == 0, "a probe failed for the stall"
                assert backend is not None
                assert backend.state is HealthState.HEALTHY and backend.probed
            finally:
                await upstream.close()

    run_on(loop_name, main())


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_a_backend_that_never_answers_is_ejected_after_the_same_probes(loop_name: str) -> None:
    async def main() -> None:
        with backend_that_never_answers() as url:
            p, backends, upstream = prober(url, DEAD_TIMEOUT_S)
            await upstream.start()
            try:
                took = [await probe_round(p, upstream, url, None) for _ in range(THRESHOLD)]
                backend = backends.get(url)
                assert backend is not None and backend.state is HealthState.EJECTED
                # each probe failed at its timeout: no extension without a stall of the loop
                assert all(DEAD_TIMEOUT_S <= t < 2 * DEAD_TIMEOUT_S for t in took), took
                # a stall does not save it either: the time it took is not counted, nothing more
                await probe_round(p, upstream, url, State.AWAITING_HEAD)
                assert backend.failures == THRESHOLD + 1
            finally:
                await upstream.close()

    run_on(loop_name, main())
