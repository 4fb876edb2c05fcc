"""``llamagate models list|load|unload`` against the proxy app (fake models, ``tests.unit.proxy.models.
test_model_control``): what it prints and its exit codes, 0 done, 1 refused with the daemon's reason,
2 usage or unreachable."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import NotReady
from supervisor.child.spawn import free_port
from supervisor.cli import main
from tests.unit.proxy.models.test_model_control import door


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def test_list_load_and_unload_print_the_rows_and_refusals_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with door() as d:
        flags = ("--url", d.url, "--key", d.keys["admin"])
        d.lazy.update(state="STARTING", progress=0.5, load_step="health", load_eta_s=3.0)
        code, out = await run(capsys, "models", "list", *flags)
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0].split()[:3] == ["chat", "READY", "always"]
        assert lines[1].split()[:3] == ["lazy", "STARTING", "on_demand"]
        assert "(30% of usable)" in lines[1] and "loading 50% (health, about 3 s left)" in lines[1]

        code, out = await run(capsys, "models", "load", "lazy", *flags)
        assert code == 0 and out.split()[:2] == ["lazy", "READY"] and d.lazy.loads == 1
        code, out = await run(capsys, "models", "unload", "lazy", *flags)
        assert code == 0 and out.split()[:2] == ["lazy", "UNLOADED"]

        code, out = await run(capsys, "models", "unload", "chat", *flags)
        assert code == 1 and "refused (HTTP 409)" in out and "residency 'always'" in out
        code, out = await run(capsys, "models", "load", "nope", *flags)
        assert code == 1 and "this server serves 'chat', 'lazy'" in out
        d.lazy.refusal = NotReady("needs 300 MiB and does not fit: held by chat 700 MiB", 30)
        code, out = await run(capsys, "models", "load", "lazy", *flags)
        assert code == 1 and "held by chat 700 MiB" in out

        # Not an admin key, or none at all: a usage problem (2), not a refusal of the action.
        code, out = await run(capsys, "models", "list", "--url", d.url, "--key", d.keys["user"])
        assert code == 2 and "admin key" in out


def test_without_a_key_or_a_daemon_it_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMAGATE_ADMIN_KEY", raising=False)
    assert main(["models", "list", "--url", "127.0.0.1:1"]) == 2
    assert "an admin key is needed" in capsys.readouterr().err
    assert main(["models", "list", "--url", f"127.0.0.1:{free_port()}", "--key", "k"]) == 2
    assert "unreachable" in capsys.readouterr().out
