from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import httpx
import pytest

from supervisor.artifacts.smoke import describe_exit, stop_child
from supervisor.child.probes import ProbeError, ServedModel, get_health, get_models, one_token_completion

BASE = "http://127.0.0.1:9"
SECRET = "s3cret"


def _client(handler: httpx.MockTransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=handler)


async def test_health_returns_the_status() -> None:
    async with _client(httpx.MockTransport(lambda r: httpx.Response(503, json={"error": {}}))) as c:
        assert await get_health(c, BASE) == 503


async def test_models_parse_ids_and_context_and_send_the_secret() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"data": [{"id": "gemma-3-270m", "meta": {"n_ctx": 512}}, {"id": "x"}]}
        )

    async with _client(httpx.MockTransport(handler)) as c:
        models = await get_models(c, BASE, SECRET)
    assert models == [ServedModel("gemma-3-270m", 512), ServedModel("x", None)]
    assert seen[0].headers["authorization"] == f"Bearer {SECRET}"
    assert seen[0].url.path == "/v1/models"


async def test_models_error_carries_the_servers_message() -> None:
    body = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    async with _client(httpx.MockTransport(lambda r: httpx.Response(401, json=body))) as c:
        with pytest.raises(ProbeError, match="HTTP 401: Invalid API Key") as info:
            await get_models(c, BASE, SECRET)
    assert info.value.status == 401


async def test_one_token_completion_asks_for_exactly_one_greedy_token() -> None:
    sent: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": " Paris"}], "usage": {"completion_tokens": 1}})

    async with _client(httpx.MockTransport(handler)) as c:
        got = await one_token_completion(c, BASE, SECRET)
    assert got.text == " Paris" and got.completion_tokens == 1
    assert sent[0]["max_tokens"] == 1 and sent[0]["temperature"] == 0


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, {"error": {"message": "boom"}}, "HTTP 500: boom"),
        (200, {"choices": []}, "unexpected answer shape"),
        (
            200,
            {"choices": [{"text": "a b"}], "usage": {"completion_tokens": 2}},
            "expected 1 generated token",
        ),
    ],
)
async def test_one_token_completion_failures_are_clear(status: int, body: object, message: str) -> None:
    async with _client(httpx.MockTransport(lambda r: httpx.Response(status, json=body))) as c:
        with pytest.raises(ProbeError, match=message):
            await one_token_completion(c, BASE, SECRET)


async def test_transport_errors_propagate_for_pollers() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with _client(httpx.MockTransport(refuse)) as c:
        with pytest.raises(httpx.ConnectError):
            await get_health(c, BASE)


def test_describe_exit_explains_sigill_and_sigkill() -> None:
    assert "illegal instruction" in describe_exit(-signal.SIGILL)
    assert "out of memory?" in describe_exit(-signal.SIGKILL)
    assert describe_exit(1) == "exited with code 1"


async def test_stop_child_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = (
        "import signal, time, pathlib, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(60)\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(ready), start_new_session=True
    )
    async with asyncio.timeout(20):
        while True:  # the child is ready once it has set its SIGTERM handler
            if ready.exists():
                break
            await asyncio.sleep(0.02)
    await stop_child(proc, grace_s=0.3)
    assert proc.returncode == -signal.SIGKILL
