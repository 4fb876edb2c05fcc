"""A row's ``access`` is what the proxy enforces: change the row in the route table, and the answer changes
(no endpoint decides on its own who may call it)."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.routes import build
from proxy.routes.table import ROUTES
from tests.unit.proxy.conftest import ProxyFactory


@pytest.mark.parametrize(
    ("method", "path", "access", "key", "before", "after"),
    [
        ("GET", "/slots", "inference", "user", 403, 200),  # admin -> inference: an inference key passes
        ("GET", "/v1/models", "admin", "user", 200, 403),  # inference -> admin: the same key is refused
        ("POST", "/tokenize", "admin", "user", 200, 403),  # any key -> admin
        ("GET", "/props", "inference", "admin_only", 200, 403),  # any key -> inference
        ("GET", "/healthz", "admin", None, 200, 401),  # none -> admin: no credentials is refused
        ("GET", "/metrics", "none", None, 401, 200),  # admin -> none
    ],
)
async def test_the_rows_access_is_what_is_enforced(
    proxy_factory: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    path: str,
    access: str,
    key: str | None,
    before: int,
    after: int,
) -> None:
    body = {"content": "hi"} if method == "POST" else None
    async with proxy_factory() as p, p.client(key) as c:
        assert (await c.request(method, path, json=body)).status_code == before
    changed = tuple(dataclasses.replace(r, access=access) if r.path == path else r for r in ROUTES)
    monkeypatch.setattr(build, "ROUTES", changed)
    async with proxy_factory() as p, p.client(key) as c:
        r = await c.request(method, path, json=body)
        assert r.status_code == after, r.text
