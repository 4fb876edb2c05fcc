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


class _DoorAtCap:
    def problem(self) -> str | None:
        return "the proxy is at its connection cap (6)"


async def test_a_door_problem_makes_a_ready_child_not_ready_with_retry_after(
    proxy_factory: ProxyFactory,
) -> None:
    # A balancer must hear that the proxy cannot take connections, and when to come back: the door's own
    # 503s say Retry-After: 1, and so does /readyz (the child being READY has no retry estimate of its own).
    async with proxy_factory() as p, p.client(None) as c:
        assert (await c.get("/readyz")).status_code == 200
        p.state.door = _DoorAtCap()  # type: ignore[assignment]
        r = await c.get("/readyz")
    assert r.status_code == 503
    assert r.json()["ready"] is False and "connection cap" in r.json()["reason"]
    assert r.headers["retry-after"] == "1" and r.json()["retry_after_s"] == 1.0
