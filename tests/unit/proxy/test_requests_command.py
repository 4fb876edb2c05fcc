"""``llamagate requests [--cancel ID]`` against the proxy app (fake child): what it prints and its exit
codes, 0 done, 1 refused with the daemon's reason, 2 usage or unreachable."""

from __future__ import annotations

import asyncio
import json

import pytest

from supervisor.child.spawn import free_port
from supervisor.cli import main
from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def test_lists_then_cancels(proxy_factory: ProxyFactory, capsys: pytest.CaptureFixture[str]) -> None:
    async with proxy_factory(snapshot={"slots": 1}) as p, p.client() as c:
        flags = ("--url", p.url, "--key", p.keys["admin"])
        code, out = await run(capsys, "requests", *flags)
        assert code == 0 and out.strip() == "no requests queued or running"
        hold = asyncio.create_task(
            c.post(
                "/v1/chat/completions", json={**CHAT, "fake_delay_ms": 3000}, headers={"x-request-id": "r-1"}
            )
        )
        await eventually(lambda: p.fake.active == 1)
        queued = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "q-1"})
        )
        await eventually(lambda: p.lane.gate.queued == 1)
        code, out = await run(capsys, "requests", *flags)
        assert code == 0, out
        lines = out.splitlines()
        assert [line.split()[:2] for line in lines] == [["q-1", "queued"], ["r-1", "running"]]
        assert "tenant team" in lines[0] and "tokens" in lines[1]
        code, out = await run(capsys, "requests", *flags, "--json")
        assert {row["id"] for row in json.loads(out)["requests"]} == {"q-1", "r-1"}

        code, out = await run(capsys, "requests", "--cancel", "q-1", *flags)
        assert code == 0 and out.startswith("cancelled q-1  queued"), out
        code, out = await run(capsys, "requests", "--cancel", "r-1", *flags)
        assert code == 0 and out.startswith("cancelled r-1  running"), out
        assert (await queued).status_code == 410 and (await hold).status_code == 410
        code, out = await run(capsys, "requests", *flags)
        assert out.strip() == "no requests queued or running"

        code, out = await run(capsys, "requests", "--cancel", "q-1", *flags)
        assert code == 1 and "refused (HTTP 404)" in out and "no request 'q-1'" in out
        code, out = await run(capsys, "requests", "--url", p.url, "--key", p.keys["user"])
        assert code == 2 and "admin key" in out


def test_without_a_key_or_a_daemon_it_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMAGATE_ADMIN_KEY", raising=False)
    assert main(["requests", "--url", "127.0.0.1:1"]) == 2
    assert "an admin key is needed" in capsys.readouterr().err
    assert main(["requests", "--url", f"127.0.0.1:{free_port()}", "--key", "k"]) == 2
    assert "unreachable" in capsys.readouterr().out
