"""A request served leaves nothing for the garbage collector: its objects go when it ends (issue 56).

Objects in a reference cycle are freed only by a collection, and a full one comes more rarely the more the
daemon holds, so every request's cycles piled up between them: 35 objects a request (a cancelled
watcher's traceback holding its frames, a grant and its permit's hold pointing at each other), and the
daemon's memory rose with the requests it had served. llama-server closes its connection after each
answer, so every request's upstream connection ends too: a connection and its parser held each other."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

CHAT = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def cycles() -> Iterator[list[object]]:
    """What a collection finds unreachable from here on (kept for the test to read, not freed)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _ours(garbage: list[object]) -> list[str]:
    return sorted({type(o).__qualname__ for o in garbage if type(o).__module__.startswith("proxy.")})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_leaves_no_cycles_of_the_proxy_s_objects(
    proxy_factory: ProxyFactory, cycles: list[object], stream: bool
) -> None:
    async with proxy_factory() as p, p.client() as c:
        p.fake.close_after_answer = True  # as llama-server does: a connection a request
        for _ in range(20):
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 200
        await eventually(lambda: p.fake.connections == 20)
        gc.collect()
        assert _ours(cycles) == []
