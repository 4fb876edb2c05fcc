"""A proxy on a real uvicorn port in front of the fake llama-server, built per test."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from starlette.applications import Starlette

from proxy.accounts.service import Accounts
from proxy.app import create_app
from proxy.auth import new_key
from proxy.models.lane import Lane, ModelEntry
from proxy.models.router import ModelRouter
from proxy.settings import KeyEntry, ProxySettings, TenantSettings, Timeouts
from proxy.state import ProxyState
from tests.fakes.fake_upstream import FakeLlama, StaticSource, one_model, serve, snapshot_for

SECRET = "per-boot-secret-xyz"


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect after each test, so a socket left open is reported against the test that leaked it."""
    yield
    gc.collect()


@dataclass
class Proxy:
    app: Starlette
    url: str
    source: StaticSource
    fake: FakeLlama
    keys: dict[str, str]  # name -> plaintext key
    entries: dict[str, KeyEntry]
    settings: ProxySettings

    @property
    def state(self) -> ProxyState:
        state = self.app.state.proxy
        assert isinstance(state, ProxyState)
        return state

    @property
    def lane(self) -> Lane:
        """The one model's lane (its admission gate)."""
        (lane,) = self.state.router.lanes.values()
        return lane

    def serve_models(self, *entries: ModelEntry) -> ModelRouter:
        """Serve ``entries`` in place of the one model, as a SIGHUP that changes the models does."""
        router = self.state.router
        for name in list(router.lanes):
            router.remove(name)
        for entry in entries:
            router.add(entry)
        return router

    def client(self, key: str | None = "user", **kw: object) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.keys[key]}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]


ProxyFactory = Callable[..., AbstractAsyncContextManager[Proxy]]


def default_settings(entries: dict[str, KeyEntry], **changes: object) -> ProxySettings:
    settings = ProxySettings(
        tenants=(
            TenantSettings("team", max_concurrency=4, max_queue=8, queue_timeout_s=10),
            TenantSettings("other", max_concurrency=4, max_queue=8, queue_timeout_s=10),
            TenantSettings("ops", max_concurrency=4, max_queue=8, queue_timeout_s=10),
        ),
        keys=tuple(entries.values()),
        max_body_bytes=64 * 1024,
        timeouts=Timeouts(connect_s=2, first_token_s=30, total_s=60),
        # The fake child's switches (fake_delay_ms, fake_status...) are body fields no route declares:
        # passed here; the door's own refusals are tested with "refuse" (tests/unit/proxy/schema).
        unknown_fields="pass",
        admin_unknown_fields="pass",
    )
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


@pytest.fixture
def proxy_factory() -> ProxyFactory:
    @asynccontextmanager
    async def make(
        fake: FakeLlama | None = None,
        snapshot: dict[str, object] | None = None,
        accounts: Accounts | None = None,
        **changes: object,
    ) -> AsyncIterator[Proxy]:
        fake = fake or FakeLlama(secret=SECRET, tokens=4)
        if not fake.port:
            await fake.start()
        keys: dict[str, str] = {}
        entries: dict[str, KeyEntry] = {}
        for name, tenant, scopes in (
            ("user", "team", {"inference"}),
            ("other", "other", {"inference"}),
            ("admin", "ops", {"inference", "admin"}),
            ("admin_only", "ops", {"admin"}),
        ):
            keys[name], entries[name] = new_key(tenant, frozenset(scopes))  # type: ignore[arg-type]
        settings = default_settings(entries, **changes)
        source = StaticSource(snapshot_for(fake.base_url, SECRET, **(snapshot or {})))
        app = create_app(settings, source, one_model(source, "gpt-4o-mini"), accounts=accounts)
        async with serve(app) as url:
            yield Proxy(app, url, source, fake, keys, entries, settings)
        await fake.stop()

    return make
