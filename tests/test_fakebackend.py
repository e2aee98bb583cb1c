"""The test kit's fake backend answers what its typed script says, and refuses any other script."""

from __future__ import annotations

import aiohttp
import pytest

from fakebackend import Close, Echo, FakeBackend, Reply, Reset, Stream


@pytest.mark.parametrize(
    "script", ["status:503", "echo", None, 503], ids=["old-mode", "echo-str", "none", "int"]
)
def test_a_script_that_is_not_a_script_type_is_refused(script: object) -> None:
    with pytest.raises(TypeError, match="FakeBackend script"):
        FakeBackend(name="b", script=script)  # type: ignore[arg-type]
    backend = FakeBackend(name="b")
    with pytest.raises(TypeError, match="FakeBackend script"):
        backend.script = script  # type: ignore[assignment]
    assert backend.script == Echo()


def test_a_retired_or_misspelt_attribute_is_refused() -> None:
    backend = FakeBackend(name="b")
    with pytest.raises(AttributeError, match="mode"):
        backend.mode = "hang"
    with pytest.raises(TypeError):
        FakeBackend(name="b", mode="status:503")  # type: ignore[call-arg]


async def test_each_script_answers_as_it_says(fake_backends) -> None:
    (backend,) = await fake_backends(1)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{backend.url}/v1/x", data=b"hi") as resp:
            assert resp.status == 200 and (await resp.json())["body"] == "hi"

        backend.script = Reply(503)
        async with s.get(f"{backend.url}/v1/x") as resp:
            assert resp.status == 503
            assert set((await resp.json())["error"]) == {"message", "type", "code"}

        backend.script = Reply(201, b"made", {"x-extra": "1"})
        async with s.get(f"{backend.url}/v1/x") as resp:
            assert (resp.status, await resp.read(), resp.headers["x-extra"]) == (201, b"made", "1")

        backend.script = Stream(chunks=3, gap_s=0)
        async with s.get(f"{backend.url}/v1/x") as resp:
            events = (await resp.read()).split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 5

        backend.script = Reset(after_chunks=1)
        async with s.get(f"{backend.url}/v1/x") as resp:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()

        backend.script = Close()
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with s.get(f"{backend.url}/v1/x"):
                pass
