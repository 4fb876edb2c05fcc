"""verify's smoke decode against the fake llama-server (a real process on a real loopback port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.artifacts.smoke import smoke_decode
from tests.fakes.fake_child import make_fake_binary


async def test_an_http_proxy_in_the_environment_is_not_used_for_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's HTTP(S)_PROXY (common on corporate hosts) must not route the probes of a child on
    # 127.0.0.1 through a proxy: here one that does not exist.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    binary = make_fake_binary(tmp_path / "bin")
    result = await smoke_decode(binary, tmp_path / "model.gguf", alias="fake", ready_timeout_s=20)
    assert result.token_text and [m.id for m in result.models] == ["fake"]
