"""The access log calls a failed readiness probe what it is, never ``outcome=ok``."""

from __future__ import annotations

import logging

import pytest

from tests.unit.proxy.conftest import ProxyFactory


async def test_a_failed_readyz_is_logged_as_not_ready(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with proxy_factory() as p, p.client(None) as c:
        p.source.update(ready=False, state="FAILED", reason="gave up", retry_after_s=30.0)
        r = await c.get("/readyz")
        assert r.status_code == 503
    access = [rec for rec in caplog.records if rec.name == "llamagate.access"]
    assert len(access) == 1
    fields = access[0].fields  # type: ignore[attr-defined]
    assert (fields["route"], fields["status"], fields["outcome"]) == ("/readyz", 503, "not_ready")
    assert "503 not_ready" in access[0].getMessage()
